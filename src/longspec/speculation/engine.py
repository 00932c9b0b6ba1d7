"""The speculative decoding loop (DESIGN.md §3), with autoregressive decoding as
the drafter-less case.

    prefill(prompt[:-1])            cache holds every token but the root
    loop: tree = drafter.propose()  (AR: the root alone)
          logits = target(tree)     one forward, hybrid tree attention
          verdict = verify(...)     lossless rules, per-node histories
          cache.commit(path)        compacted in place; bonus is the new root
          drafter.observe(...)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from longspec.runtime.cache import KVCache
from longspec.runtime.device import HOST, synchronize
from longspec.runtime.model import Decoder
from longspec.speculation.drafters.base import DraftContext, Drafter, TargetView
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.plain_rounds import PlainRounds
from longspec.speculation.processors import SamplingParams
from longspec.speculation.seeding import drafter_generator
from longspec.speculation.tree import MalformedTreeError, Tree
from longspec.speculation.verification import verify

# Prompts longer than this show a prefill progress bar (when attached to a terminal).
_PROGRESS_MIN_TOKENS = 4096


@dataclass(frozen=True)
class EngineOptions:
    # Tokens per prefill forward: bounds activation memory. 256 prefills 1.05-1.06x as fast as 512 here
    # (BENCHMARKS.md) and equals the batch engine's per-step budget, so a batched row's prompt is cut
    # where a single run cuts it (the same bits in bf16).
    prefill_chunk: int = 256
    max_tree_nodes: int = 64  # speculative nodes per verification forward (root excluded)
    progress: bool = True
    # Call a drafter's `learn()` while each verification forward runs (its statistics
    # then lag a round): None does where the device computes asynchronously (not the
    # CPU, whose forward returns when it is done, so nothing would overlap).
    learn_while_verifying: bool | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_tree_nodes < 0:
            raise ValueError(f"max_tree_nodes must be >= 0, got {self.max_tree_nodes}")
        if self.learn_while_verifying not in (None, True, False):
            raise ValueError(f"learn_while_verifying must be True, False or None, got {self.learn_while_verifying!r}")


class SpeculativeEngine:
    def __init__(self, model: Decoder, options: EngineOptions = EngineOptions()) -> None:
        self.model = model
        self.options = options

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """Fail before any work on requests the model cannot serve."""
        if prompt_length < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.model.config.max_position_embeddings
        if prompt_length + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt_length} tokens + max_new_tokens={max_new_tokens} = "
                f"{prompt_length + max_new_tokens} exceeds the model's context of {limit} tokens; "
                f"shorten the prompt or lower max_new_tokens (at most {max(limit - prompt_length, 0)} here)"
            )

    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        *,
        params: SamplingParams = SamplingParams(),
        max_new_tokens: int = 256,
        drafter: Drafter | None = None,
        eos_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        stats: GenerationStats | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the tokens committed each round (1-D int64), until EOS (included),
        ``max_new_tokens`` or the caller stops iterating. Fills ``stats`` in place.

        ``generator`` is the verifier's random stream; a drafter that samples gets its
        own stream derived from the same seed (see `DraftContext.generator`)."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=HOST).reshape(-1)
        self.check_request(prompt.numel(), max_new_tokens)
        check_target = getattr(drafter, "check_target", None)
        if check_target is not None:
            check_target(self.model.config)  # weights that do not fit fail before prefill
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = prompt.numel()
        opts = self.options
        tree_budget = opts.max_tree_nodes if drafter is not None else 0
        capacity = prompt.numel() + max_new_tokens + tree_budget + 1
        cache = self.model.new_cache(capacity, max_forward_tokens=max(opts.prefill_chunk, tree_budget + 1))
        stats.kv_cache_bytes = cache.nbytes()
        tokens = torch.empty(capacity, dtype=torch.long, device=HOST)
        tokens[: prompt.numel()] = prompt
        length = prompt.numel()  # committed tokens, the root included
        eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=HOST)

        start = time.perf_counter()
        keep_hidden = int(getattr(drafter, "prefill_hidden_rows", 0) or 0)
        prefill_hidden = self._prefill(prompt[:-1], cache, keep_hidden)
        synchronize(self.model.device)  # a GPU queues the prefill: wait, so prefill_s measures it
        stats.prefill_s = time.perf_counter() - start

        view = TargetView(self.model, cache)
        view.prefill_hidden = prefill_hidden
        draft_generator = drafter_generator(generator) if generator is not None else None
        learn = learn_while_verifying(drafter, self.options, self.model.device)
        if drafter is not None:
            drafter.begin(DraftContext(tokens[:length], view, tree_budget, draft_generator,
                                       learns_while_verifying=learn is not None))
        produced = 0
        plain = PlainRounds(drafter)
        while produced < max_new_tokens:
            t0 = time.perf_counter()
            if plain.now():
                tree = Tree.chain(int(tokens[length - 1]), [])
            else:
                tree = self._propose(drafter, DraftContext(tokens[:length], view, tree_budget, draft_generator,
                                                           learns_while_verifying=learn is not None))
            t1 = time.perf_counter()
            verdict, hidden = self._verify_round(tree, tokens, length, cache, params, generator, learn)
            view.last_hidden = verdict.path_rows(hidden)
            t2 = time.perf_counter()
            cache.commit(verdict.path)
            new = torch.cat([tree.tokens[verdict.path[1:]], torch.tensor([verdict.bonus], device=HOST)])
            new, stop_reason = truncate_at_stop(new, eos, max_new_tokens - produced)
            tokens[length : length + new.numel()] = new
            length += new.numel()
            produced += new.numel()
            observed = plain.told(new, stop_reason, view)  # never the last round's tokens
            if observed is not None:
                drafter.observe(observed)
            t3 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.bookkeeping_s += t3 - t2
            stats.new_tokens = produced
            stats.record_round(tree.max_depth, verdict.accepted_tokens, tree.size - 1)
            if observed is not None:
                record_controller(drafter, stats)
            yield new
            if stop_reason:
                stats.stop_reason = stop_reason
                return
        stats.stop_reason = "length"

    # ------------------------------------------------------------------ internals
    def _prefill(self, ids: torch.Tensor, cache: KVCache, keep_hidden: int = 0) -> torch.Tensor | None:
        """Fill the cache. Returns the final hidden states of the last `keep_hidden`
        prompt tokens (for drafters that read the target's features), else None."""
        chunk = self.options.prefill_chunk
        show = self.options.progress and ids.numel() >= _PROGRESS_MIN_TOKENS
        first_kept = max(0, ids.numel() - keep_hidden) if keep_hidden else ids.numel()
        kept = []
        with tqdm(total=ids.numel(), desc="prefill", unit="tok", disable=None if show else True, leave=False) as bar:
            for begin in range(0, ids.numel(), chunk):
                piece = ids[begin : begin + chunk]
                rows = slice(max(0, first_kept - begin), None) if begin + piece.numel() > first_kept else slice(0, 0)
                out = self.model(piece.unsqueeze(0), cache, logits_rows=rows, with_logits=False)
                cache.commit()
                bar.update(piece.numel())
                if out.hidden.shape[1]:
                    kept.append(out.hidden[0])
        return torch.cat(kept) if kept else None

    def _verify_round(self, tree, tokens, length, cache, params, generator, learn=None):
        positions = cache.length + tree.depths
        mask = None if tree.is_chain() else tree.ancestor_mask()
        out = self.model(tree.tokens.unsqueeze(0), cache, tree_mask=mask, positions=positions)
        if learn is not None:
            learn()  # queued on a GPU, the forward runs meanwhile; its result is read below
        histories = None
        if params.uses_history:
            histories = node_histories(tokens[:length], tree, params.penalty_window)
        return verify(tree, out.logits[0], histories, params, generator), out.hidden[0]

    def _propose(self, drafter: Drafter, context: DraftContext) -> Tree:
        return checked_proposal(drafter, context, self.model.config.vocab_size)


def learn_while_verifying(drafter, options: EngineOptions, device: torch.device):
    """The drafter's `learn` where an engine calls it during verification forwards
    (`EngineOptions.learn_while_verifying`), else None."""
    wanted = options.learn_while_verifying
    if wanted is None:
        wanted = device.type != "cpu"
    return getattr(drafter, "learn", None) if wanted else None


def checked_proposal(drafter: Drafter, context: DraftContext, vocab_size: int, propose=None) -> Tree:
    """The drafter's tree (`propose(context)`, by default its `propose`), every
    invariant checked once before the target sees it."""
    name = type(drafter).__name__
    try:
        tree = (propose or drafter.propose)(context)
    except MalformedTreeError as error:  # raised while the drafter built its tree
        raise MalformedTreeError(f"drafter {name} proposed a malformed tree: {error}") from None
    if not isinstance(tree, Tree):
        raise TypeError(f"drafter {name} returned {type(tree).__name__} from propose(), expected a Tree")
    problem = tree.problem(vocab_size)
    if problem is None and int(tree.tokens[0]) != context.root:
        problem = f"node 0 carries token {int(tree.tokens[0])}, but the root (last committed token) is {context.root}"
    if problem is None and tree.size - 1 > context.max_nodes:
        problem = f"{tree.size - 1} speculative nodes, more than max_tree_nodes={context.max_nodes}"
    if problem:
        raise MalformedTreeError(f"drafter {name} proposed a malformed tree: {problem}")
    return tree


def node_histories(committed: torch.Tensor, tree: Tree, window: int) -> torch.Tensor:
    """[n, window + max_depth] token histories, one per tree node: the last `window`
    committed tokens followed by the node's own path below the root (-1 padded)."""
    n, depth = tree.size, tree.max_depth
    recent = committed[-window:]
    shared = torch.full((window,), -1, dtype=torch.long, device=HOST)
    shared[window - recent.numel() :] = recent
    path_tokens = torch.full((n, depth), -1, dtype=torch.long, device=HOST)
    if depth:
        node, ancestor = torch.nonzero(tree.ancestor_mask() & (tree.depths > 0).unsqueeze(0), as_tuple=True)
        path_tokens[node, tree.depths[ancestor] - 1] = tree.tokens[ancestor]
    return torch.cat([shared.expand(n, window), path_tokens], dim=1)


def record_controller(drafter, stats: GenerationStats) -> None:
    telemetry = getattr(drafter, "telemetry", None)
    if telemetry is not None:
        stats.controller = telemetry()


def truncate_at_stop(new: torch.Tensor, eos: torch.Tensor, room: int) -> tuple[torch.Tensor, str]:
    """This round's tokens up to the first EOS (kept) or the room left; the reason, if any."""
    if eos.numel():
        hits = torch.nonzero(torch.isin(new, eos)).flatten()
        if hits.numel() and int(hits[0]) < room:
            return new[: int(hits[0]) + 1], "eos"
    if new.numel() >= room:
        return new[:room], "length"
    return new, ""
