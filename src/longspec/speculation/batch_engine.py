"""Speculative decoding of many sequences at once, with continuous batching.

Every request is a row with its own prompt, drafter, sampling parameters, seed and
stopping rule. Each `step()`:

1. admits waiting requests into free cache rows (FIFO) and runs a bounded amount of
   their prefill (`BatchOptions.prefill_tokens_per_step`), so a long prompt that
   joins does not stall the rows already decoding for more than that budget;
2. runs one round for every decoding row (`decode_round`, the single-sequence
   engine's round): the trees are padded to a common node count and verified in ONE
   target forward with per-row positions and tree masks (`RowsView`), each row by the
   lossless rules with its own random stream; every row's accepted path is compacted
   into its cache in one operation;
3. hands each row's committed tokens to its `RequestHandle`; rows that hit EOS,
   their token limit or a cancellation leave, and their cache row is reused.

A row's output is the output of `SpeculativeEngine.generate` for the same request:
the rows share forwards and the round's code, never state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from longspec.runtime.batch_cache import BatchKVCache, CacheRow
from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.runtime.setup_time import Stopwatch
from longspec.speculation.cost_model import ForwardCost, batch_context_bucket, batch_forward_cost_at, is_default
from longspec.speculation.decode_round import DecodingSequence
from longspec.speculation.decode_round import checked_proposal, decode_round, prefill_piece
from longspec.speculation.decoding_request import DecodingRequest
from longspec.speculation.drafters.base import DraftContext, TargetView
from longspec.speculation.engine import EngineOptions, learns_while_verifying
from longspec.speculation.joint_budget import ReachHistory, cut_to_depth, joint_depths, tree_levels
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.tree import Tree
from longspec.speculation.verification import NodeScores, certified_head_serves, needs_argmax_only


@dataclass(frozen=True)
class BatchOptions:
    max_rows: int = 8  # sequences decoded together (cache rows)
    row_capacity: int = 8192  # token slots per row: prompt + max_new_tokens + tree budget + 1 must fit
    # Prompt tokens prefilled per step while other rows decode: a joining 4k prompt
    # then delays each decoding round by about one 256-token forward, not 4k. A multiple
    # of the prefill chunk (`EngineOptions.prefill_chunk`, also 256) keeps a bf16 row's
    # cache bit for bit a single run's; a smaller budget cuts chunks further.
    prefill_tokens_per_step: int = 256
    max_waiting: int | None = None  # requests queued for a free row (None: unbounded)
    # Speculative nodes per verification forward over all rows (None: each row up to
    # max_tree_nodes). On a CPU a forward past the compute knee costs in proportion to
    # its width, so B rows share one budget: each gets budget // B nodes.
    max_forward_nodes: int | None = None
    # With two rows or more, each row's tree is capped at the widest that keeps the
    # shared forward within this many times the cost of a decode step of the same rows
    # (the batched forward's cost measured on this machine, `forward_cost`): past the
    # knee a longer tree costs more than its extra tokens bring. None: no cap; the joint
    # budget (below), which cuts trees from the same cost, replaces it. 2.5 picked the
    # best cap of a sweep on a 2-core CPU
    # (docs/lab-notes/batching.md#a-node-cap-from-the-measured-batched-cost-issue-batching);
    # the first round at each row count measures the cost.
    forward_cost_limit: float | None = 2.5
    # Rows whose drafter can grow its tree (`widen`, e.g. auto) fill the padding slots
    # of the shared forward with real nodes. Off by default: on a CPU a padding slot is
    # nearly free (it attends to itself only and gets no output-layer row) while a real
    # node pays attention over the row's context and the 262k-vocabulary head, so
    # filling did not pay
    # (docs/lab-notes/batching.md#filling-a-batchs-padding-with-autos-next-best-nodes-issue-batching--measured-left-off).
    fill_padding: bool = False
    # With two rows or more, cut the rows' trees to the depths that maximise expected
    # accepted tokens per second of the shared forward: levels ranked across rows by
    # their measured acceptance, the batched forward's cost measured on this machine
    # (`speculation/joint_budget.py`). Off by default: with PLD on 4k-token prompts it
    # beat uncut trees on LCC but lost on Multi-News
    # (docs/lab-notes/batching.md#the-joint-budget-again-with-packed-rows-and-copied-runs-issue-batching),
    # and the first round at each new row count measures the batched forward's cost
    # (seconds).
    joint_budget: bool = False

    def __post_init__(self) -> None:
        for name in ("max_rows", "row_capacity", "prefill_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_forward_nodes is not None and self.max_forward_nodes < 0:
            raise ValueError(f"max_forward_nodes must be >= 0, got {self.max_forward_nodes}")
        if self.forward_cost_limit is not None and not self.forward_cost_limit >= 1.0:
            raise ValueError(f"forward_cost_limit must be >= 1 (a decode step's cost) or None, got {self.forward_cost_limit}")


class EngineBusy(RuntimeError):
    """Every row is taken and the waiting queue is full."""


class RequestHandle:
    """A submitted request: its committed tokens arrive round by round.

    ``take()`` returns the token tensors committed since the last call (one per
    round); ``tokens`` is everything so far; ``finished`` is set when the row has
    left (``stats.stop_reason`` says why: "eos", "length", "cancelled" or "error",
    ``error`` then holding the exception of this request's drafter or sampling; the
    other rows go on).
    """

    def __init__(self, request_id: int, stats: GenerationStats) -> None:
        self.request_id = request_id
        self.stats = stats
        self.finished = False
        self.error: BaseException | None = None
        self._rounds: deque[torch.Tensor] = deque()
        self._all: list[torch.Tensor] = []

    def take(self) -> list[torch.Tensor]:
        rounds = list(self._rounds)
        self._rounds.clear()
        return rounds

    @property
    def pending_rounds(self) -> int:
        """Rounds committed but not yet taken."""
        return len(self._rounds)

    def pop_round(self) -> torch.Tensor:
        """The oldest round not yet taken."""
        return self._rounds.popleft()

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat(self._all) if self._all else torch.empty(0, dtype=torch.long, device=HOST)

    def _push(self, new: torch.Tensor) -> None:
        self._rounds.append(new)
        self._all.append(new)


@dataclass(eq=False)  # compared by identity
class _Row(DecodingSequence):
    """A sequence of the batch: the shared round's state, plus its place in the cache."""

    handle: RequestHandle | None = None
    cache_row: CacheRow | None = None
    prefilled: int = 0  # prompt tokens (all but the root) already in the cache
    prefill_hidden: list[torch.Tensor] = field(default_factory=list)
    reach: ReachHistory = field(default_factory=ReachHistory)  # acceptance by level, for the joint budget

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == self.request.prompt.numel() - 1


class BatchEngine:
    """Continuous batching over one `BatchKVCache`. Not thread-safe: one thread calls
    `submit`, `cancel` and `step` (a server runs them on its generation thread)."""

    def __init__(self, model: Decoder, options: EngineOptions = EngineOptions(), batch: BatchOptions = BatchOptions()) -> None:
        self.model = model
        self.options = options
        self.batch = batch
        self.cache = BatchKVCache(
            model.config, batch.row_capacity, batch.max_rows, max_forward_tokens=self.max_forward_tokens(options, batch),
            dtype=model.dtype, device=model.embed_weight.device,
        )
        self._waiting: deque[_Row] = deque()
        self._prefilling: list[_Row] = []  # hold cache rows in slots after the decoding rows
        self._decoding: list[_Row] = []  # row i sits in cache slot i
        self._next_id = 0
        # Tree nodes verified, and padding nodes added to align rows' trees (the cost of
        # padding over packing).
        self.forward_nodes = 0
        self.padding_nodes = 0
        self._reach_by_drafter: dict[type, ReachHistory] = {}
        self._affordable: dict[tuple[int, int], int] = {}  # (rows, context bucket) -> nodes per row
        self._pending_view = None  # the rows view of the round's forward, until its commit

    @staticmethod
    def prefill_chunk(options: EngineOptions, batch: BatchOptions) -> int:
        """Prompt tokens per prefill forward: the single-sequence engine's chunk, so a
        row's prompt is cut where a single run cuts it and its cache gets the same bits
        (a bf16 prefill chunk's attention depends on where the chunk starts). A step's
        budget below the chunk cuts it further, and then bf16 rows may round a near-tie
        differently from single runs (`BatchOptions.prefill_tokens_per_step`)."""
        return options.prefill_chunk

    @staticmethod
    def max_forward_tokens(options: EngineOptions, batch: BatchOptions) -> int:
        return max(BatchEngine.prefill_chunk(options, batch), options.max_tree_nodes + 1)

    @staticmethod
    def planned_cache_bytes(model: Decoder, options: EngineOptions, batch: BatchOptions) -> int:
        """Bytes the engine's target cache will take, before building it."""
        return BatchKVCache.planned_nbytes(model.config, batch.row_capacity, batch.max_rows,
                                           max_forward_tokens=BatchEngine.max_forward_tokens(options, batch),
                                           dtype=model.dtype)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt_ids: torch.Tensor | Sequence[int], request: DecodingRequest | None = None,
               **keywords) -> RequestHandle:
        """Queue a request (a `DecodingRequest`, or its fields as keywords); it joins at the
        next `step` with a free row. Everything that can be refused is refused here, before
        any prefill."""
        request = DecodingRequest.given(request, keywords)
        row = _Row.create(self.model, prompt_ids, request, tree_budget=self.options.max_tree_nodes)
        max_new_tokens = request.max_new_tokens
        prompt, budget = row.request.prompt, row.request.tree_budget
        needed = prompt.numel() + max_new_tokens + budget + 1
        if needed > self.batch.row_capacity:
            raise ValueError(
                f"this request needs {needed} token slots (prompt {prompt.numel()} + max_new_tokens {max_new_tokens} "
                f"+ tree budget {budget} + 1) but a cache row holds {self.batch.row_capacity} "
                f"({self.cache.bytes_per_row():,} bytes per row); lower max_new_tokens or start the engine with "
                f"BatchOptions(row_capacity >= {needed})"
            )
        if (self.batch.max_waiting is not None and not self.cache.free_rows
                and len(self._waiting) >= self.batch.max_waiting):
            raise EngineBusy(f"all {self.batch.max_rows} rows are busy and {len(self._waiting)} requests wait; retry later")
        row.request.stats.kv_cache_bytes = self.cache.bytes_per_row()
        row.handle = RequestHandle(self._next_id, row.request.stats)
        self._next_id += 1
        self._waiting.append(row)
        return row.handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request now (between steps); its cache row is freed at once."""
        for rows in (self._waiting, self._prefilling, self._decoding):
            for row in rows:
                if row.handle is handle:
                    self._finish(row, "cancelled")
                    return

    def __contains__(self, handle: RequestHandle) -> bool:
        """Whether this engine still holds the request (waiting, prefilling or decoding)."""
        return any(row.handle is handle for rows in (self._waiting, self._prefilling, self._decoding) for row in rows)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding)

    @property
    def active_rows(self) -> int:
        """Rows holding a cache row: prefilling or decoding."""
        return len(self._prefilling) + len(self._decoding)

    @property
    def decoding_rows(self) -> int:
        return len(self._decoding)

    @property
    def waiting(self) -> int:
        """Requests queued for a free row."""
        return len(self._waiting)

    def bytes_in_use(self) -> int:
        """Target cache bytes held by rows now in use (prefilling or decoding)."""
        return self.cache.bytes_in_use()

    def run(self) -> None:
        while self.has_work:
            self.step()

    def generate_all(self, requests: Sequence[dict]) -> list[RequestHandle]:
        """Submit every request (keyword arguments of `submit`) and run them to the end."""
        handles = [self.submit(**request) for request in requests]
        self.run()
        return handles

    # ---------------------------------------------------------------------- step
    def step(self) -> None:
        """Admit and prefill (within the step's budget), then one round of every decoding row."""
        while self._waiting and self.cache.free_rows:
            row = self._waiting.popleft()
            row.cache_row = self.cache.acquire()
            self._prefilling.append(row)
        # Alone, a prompt prefills at full speed; beside decoding rows, within the budget.
        budget = None if not self._decoding else self.batch.prefill_tokens_per_step
        while self._prefilling and (budget is None or budget > 0):
            row = self._prefilling[0]
            budget = self._prefill_some(row, budget)
            if row.prefill_done:
                try:
                    self._start_decoding(row)
                except Exception as error:  # its drafter's `begin`: this row fails, not its neighbours
                    row.handle.error = error
                    self._finish(row, "error")
        if self._decoding:
            self._round()

    # ------------------------------------------------------------------ prefill
    def _prefill_some(self, row: _Row, budget: int | None) -> int | None:
        ids = row.prefill_ids
        keep_hidden = row.prefill_hidden_rows
        keep_from = ids.numel() - keep_hidden if keep_hidden else ids.numel()
        chunk = self.prefill_chunk(self.options, self.batch)
        watch = Stopwatch()
        while not row.prefill_done and (budget is None or budget > 0):
            begin = row.prefilled
            # Pieces never cross the chunk boundaries a single run prefills at.
            end = min((begin // chunk + 1) * chunk, ids.numel())
            if budget is not None and end - begin > budget:
                if budget < self.batch.prefill_tokens_per_step:
                    budget = 0  # what another row left of this step would cut a chunk: go on next step
                    break
                end = begin + budget  # a per-step budget below the chunk cuts every chunk
            hidden = prefill_piece(self.model, row.cache_row.view(), ids, begin, end, keep_from)
            if hidden is not None:
                row.prefill_hidden.append(hidden)
            row.prefilled = end
            if budget is not None:
                budget -= end - begin
        row.request.stats.prefill_s += watch.stop()
        row.request.stats.add_setup(watch.setup)
        return budget

    def _start_decoding(self, row: _Row) -> None:
        self._prefilling.remove(row)
        slot = len(self._decoding)
        if row.cache_row.slot != slot:  # decoding rows stay in the leading slots
            self.cache.swap(row.cache_row, self.cache.row_at(slot))
        self._decoding.append(row)
        prefill_hidden = torch.cat(row.prefill_hidden) if row.prefill_hidden else None
        row.prefill_hidden = []
        # With `fill_padding` every round asks the drafter: another row's wider tree
        # leaves padding that its proposals may fill.
        watch = Stopwatch()
        row.start(TargetView(self.model, row.cache_row), prefill_hidden,
                  learns_while_verifying=learns_while_verifying(self.options, self.model.device),
                  plain_rounds=not self.batch.fill_padding)
        watch.stop()
        row.request.stats.add_setup(watch.setup)

    # ----------------------------------------- the round's target (decode_round.RoundTarget)
    # The engine is the target of its decoding rows' round: each row's drafting context
    # under the batch's caps, the trees cut or widened across rows, one padded forward,
    # one commit.
    def context(self, row: _Row) -> DraftContext:
        rows = max(len(self._decoding), 1)
        budget = row.request.tree_budget
        if self.batch.max_forward_nodes is not None:
            budget = min(budget, self.batch.max_forward_nodes // rows)
        if rows > 1 and budget > 0 and self.batch.forward_cost_limit is not None and not self.batch.joint_budget:
            budget = min(budget, self._affordable_nodes(rows, row.state.length))
        return row.context(budget, rows_in_forward=rows)

    # -------------------------------------------------------------------- round
    def _widen(self, rows: list[_Row], trees: list[Tree]) -> None:
        """Every row's tree is padded to the widest row's: a drafter that can grow its
        tree (`widen`) fills its padding slots with its next best nodes."""
        width = max(tree.size for tree in trees) - 1
        vocab = self.model.config.vocab_size
        for index, (row, tree) in enumerate(zip(rows, trees)):
            if row.request.drafter is None or tree.size - 1 >= width:
                continue
            watch = Stopwatch()
            context = self.context(row)
            drafter = row.request.drafter
            grown = checked_proposal(drafter, context, vocab, lambda c: drafter.widen(c, width) or tree)
            trees[index] = grown
            row.request.stats.draft_s += watch.stop()
            row.request.stats.add_setup(watch.setup)

    def forward_cost(self, rows: int, length: int) -> ForwardCost:
        """The measured cost of a verification forward over `rows` rows (rounded up to
        a power of two, at most `max_rows`) of about `length` committed tokens, by
        tokens per row. Cached per machine; where a row count or context bucket is not
        measured yet, the conservative default while the measurement waits for a quiet
        moment (`cost_model.batch_forward_cost_at`; a benchmark measures it before its clock)."""
        measured = min(1 << max(rows - 1, 0).bit_length(), self.batch.max_rows)
        return batch_forward_cost_at(self.model, measured, length)

    def _affordable_nodes(self, rows: int, length: int) -> int:
        """Speculative nodes per row within `forward_cost_limit`: the widest forward
        (tokens per row, root included) whose measured cost over these rows is at most
        that many decode steps, less the root. Looked up once per row count and
        context bucket."""
        key = (rows, batch_context_bucket(self.model, length))
        if key not in self._affordable:
            cost = self.forward_cost(rows, length)
            limit = self.batch.forward_cost_limit * cost.seconds_for(1)
            width = 1
            while width <= self.options.max_tree_nodes and cost.seconds_for(width + 1) <= limit:
                width += 1
            if is_default(cost):  # the measurement may arrive later: not kept
                return width - 1
            self._affordable[key] = width - 1
        return self._affordable[key]

    def _drafter_reach(self, row: _Row) -> ReachHistory:
        """The acceptance history of every row (and request) drafted by this kind of drafter."""
        return self._reach_by_drafter.setdefault(type(row.request.drafter), ReachHistory())

    def _cut_jointly(self, rows: list[_Row], trees: list[Tree]) -> list[Tree]:
        cost = self.forward_cost(len(rows), max(row.state.length for row in rows))
        measured_rows = int(cost.key.get("rows", len(rows)))

        def seconds(tokens: float) -> float:  # the same tokens spread over the measured rows
            return cost.seconds_for(max(1.0, tokens / measured_rows))

        levels = [tree_levels(tree) for tree in trees]
        reach = [row.reach.reach(level, self._drafter_reach(row).conditionals(level))
                 for row, level in zip(rows, levels)]
        whole = [row.request.drafter is not None and row.request.drafter.sizes_tree_from_cost for row in rows]
        depths = joint_depths(trees, reach, seconds, whole)
        return [cut_to_depth(tree, depth) for tree, depth in zip(trees, depths)]

    def _round(self) -> None:
        finished = []
        rows = list(self._decoding)
        for row, result in zip(rows, decode_round(rows, self, contain_errors=True)):
            if result.committed is not None:
                committed = result.committed
                if self.batch.joint_budget:
                    self._drafter_reach(row).add(row.reach.record(result.proposed, result.verified.max_depth,
                                                                  committed.accepted.tolist()))
                row.handle._push(committed.tokens)
                if committed.stop_reason:
                    finished.append((row, committed.stop_reason))
            if result.error is not None:
                row.handle.error = result.error
                finished.append((row, "error"))
        for row, reason in finished:
            self._finish(row, reason)

    def shape(self, rows: list[_Row], trees: list[Tree]) -> list[Tree]:
        # A row alone keeps its drafter's tree, as the single-sequence engine does.
        if self.batch.joint_budget and len(rows) > 1 and any(tree.size > 1 for tree in trees):
            trees = self._cut_jointly(rows, trees)
        if self.batch.fill_padding:
            trees = list(trees)
            self._widen(rows, trees)
        return trees

    def forward(self, rows: list[_Row], trees: list[Tree]) -> tuple[list[NodeScores], list[torch.Tensor]]:
        """The decoding rows' trees padded to one width, in one forward over their cache
        rows; then the head, once for the rows that need logits and once (the certified
        head's argmax) for the rows whose verification needs only decisions."""
        view = self.cache.rows(0, len(trees))
        padded = pad_trees(trees, view.lengths)
        self.forward_nodes += padded.ids.numel()
        self.padding_nodes += padded.ids.numel() - sum(tree.size for tree in trees)
        out = self.model(padded.ids, view, tree_mask=padded.masks, positions=padded.positions, with_logits=False,
                         real_tokens=padded.real)
        width = padded.ids.shape[1]
        real = torch.cat([b * width + torch.arange(tree.size, device=HOST) for b, tree in enumerate(trees)])
        hidden = out.hidden.reshape(-1, out.hidden.shape[-1])[real.to(out.hidden.device)]
        sizes = [tree.size for tree in trees]
        self._pending_view = view
        hidden_rows = list(hidden.split(sizes))
        certified = self.model.certified_head is not None
        served = [certified and certified_head_serves(row.request.params, tree) for row, tree in zip(rows, trees)]
        if not any(served):
            return [NodeScores(logits) for logits in self.model.logits(hidden).split(sizes)], hidden_rows
        scores: list[NodeScores | None] = [None] * len(rows)
        deciding = [i for i, row in enumerate(rows) if served[i] and needs_argmax_only(row.request.params)]
        if deciding:  # every greedy row's decisions in one screen
            tokens = self.model.decide(torch.cat([hidden_rows[i] for i in deciding])).split([sizes[i] for i in deciding])
            for i, argmax in zip(deciding, tokens):
                scores[i] = NodeScores(model=self.model, hidden=hidden_rows[i], argmax=argmax)
        drawing = [i for i in range(len(rows)) if served[i] and scores[i] is None]
        if drawing and not self.model.certified_head.draws:  # its draws read the full head, as needed
            for i in drawing:
                scores[i] = NodeScores(model=self.model, hidden=hidden_rows[i])
        elif drawing:  # every sampled row's nodes in one screen
            screen = self.model.certified_head.screen(torch.cat([hidden_rows[i] for i in drawing]))
            start = 0
            for i in drawing:
                scores[i] = NodeScores(model=self.model, hidden=hidden_rows[i], screen=screen, screen_offset=start)
                start += sizes[i]
        others = [i for i in range(len(rows)) if not served[i]]
        if others:
            logits = self.model.logits(torch.cat([hidden_rows[i] for i in others])).split([sizes[i] for i in others])
            for i, row_logits in zip(others, logits):
                scores[i] = NodeScores(row_logits)
        return scores, hidden_rows

    def commit(self, paths: list[torch.Tensor]) -> None:
        self._pending_view.commit(paths)
        self._pending_view = None

    # ------------------------------------------------------------------- leave
    def _finish(self, row: _Row, reason: str) -> None:
        if row in self._waiting:
            self._waiting.remove(row)
        elif row in self._prefilling:
            self._prefilling.remove(row)
            self.cache.release(row.cache_row)
        else:
            # Keep decoding rows in the leading slots: the last decoding row takes the
            # leaving row's slot, then the cache fills the freed slot from the end.
            last = self._decoding[-1]
            if last is not row:
                self.cache.swap(row.cache_row, last.cache_row)
                i, j = self._decoding.index(row), len(self._decoding) - 1
                self._decoding[i], self._decoding[j] = last, row
            self._decoding.pop()
            self.cache.release(row.cache_row)
        row.state.view = None
        if row.handle.stats.stop_reason != "stop":  # a stop string found by the caller's text pipeline stays
            row.handle.stats.stop_reason = reason
        row.handle.stats.record_output(row.state.tokens[row.request.prompt.numel() : row.state.length].tolist())
        row.handle.finished = True


class PaddedTrees(NamedTuple):
    """The rows' trees padded to the widest, as one forward takes them."""

    ids: torch.Tensor  # [B, W] token ids
    positions: torch.Tensor  # [B, W] RoPE positions
    masks: torch.Tensor  # [B, W, W] each node's ancestors (a padding node sees only itself)
    real: torch.Tensor  # [B, W] False at padding


def pad_trees(trees: Sequence[Tree], lengths: torch.Tensor) -> PaddedTrees:
    """Token ids [B, W], positions [B, W], tree masks [B, W, W] and which tokens are
    real [B, W] of trees padded to the widest. A padding node sees only itself (no row
    of a mask is empty) and is never kept; its position is the root's; the forward
    skips its per-token work (`Packing`). Built on the host (trees live there); the
    forward moves ids and masks to the device in one copy each."""
    B, width = len(trees), max(tree.size for tree in trees)
    if width == 1:  # every row a root alone (AR rows, plain rounds): one token each, no padding
        ids = torch.cat([tree.tokens for tree in trees]).reshape(B, 1)
        masks = torch.ones((B, 1, 1), dtype=torch.bool, device=HOST)
        return PaddedTrees(ids, lengths.unsqueeze(1).clone(), masks, masks[:, :, 0].clone())
    ids = torch.zeros((B, width), dtype=torch.long, device=HOST)
    depths = torch.zeros((B, width), dtype=torch.long, device=HOST)
    masks = torch.eye(width, dtype=torch.bool, device=HOST).repeat(B, 1, 1)
    sizes = [tree.size for tree in trees]
    real = torch.arange(width, device=HOST) < torch.tensor(sizes, device=HOST).unsqueeze(1)
    for b, (tree, n) in enumerate(zip(trees, sizes)):
        ids[b, :n] = tree.tokens
        if n > 1:  # a root alone has depth 0, and the identity mask lets it see itself
            depths[b, :n] = tree.depths
            masks[b, :n, :n] = tree.ancestor_mask()
    return PaddedTrees(ids, lengths.unsqueeze(1) + depths.to(lengths.device), masks, real)
