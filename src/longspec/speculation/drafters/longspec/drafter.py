"""`LongSpecDrafter`: the draft network, its bounded state, a tree strategy and,
optionally, retrieval candidates merged into the same tree.

Each round:
  1. catch up: run the draft over the tokens committed since the last round (the
     root last), in order, writing their self-attention K/V into the ring; each
     such token's queries see the target's K/V of the tokens before it, exactly
     the visibility used in training with shift 1;
  2. the strategy grows a tree from the root's distribution, each expansion one
     draft forward over that depth's nodes (tree-masked among themselves; all of
     them see the committed target prefix, never a pending token);
  3. with a retrieval drafter, its chains (prompt lookup / n-grams) are merged
     into the tree (shared prefixes merged, one verification forward for both).

Retrieval first: by default (`retrieval_streak=0`) a round where retrieval has
candidates proposes them alone and the draft does not run at all; the draft's tree
fills the rounds where retrieval has nothing. With `retrieval_streak=n` the draft is
skipped only after a round that accepted at least n tokens of a retrieval chain, and
with None both are merged every round. A skipped round leaves the draft's ring
behind; it catches up on those tokens the next round it runs. Where the text
repeats, the method then costs what prompt lookup costs (measured against the other
settings with the shipped draft in
docs/lab-notes/longspec-draft.md#this-session-retrieval-first-packed-draft-training-evidence).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longspec.runtime.attention import biased_attention
from longspec.runtime.linear import PackedWeight, packed_linear, prepack
from longspec.speculation.drafters.base import DraftContext, Drafter, TargetView
from longspec.speculation.drafters.shared.context_vocab import ContextVocabulary
from longspec.speculation.drafters.longspec.checkpoint import load_draft
from longspec.speculation.drafters.longspec.model import (
    DraftModel,
    PackedProjection,
    RopeRows,
    cross_attention_bias,
    cross_window_keys,
    softcap,
    target_rope,
)
from longspec.speculation.drafters.longspec.state import DraftState, RecentTargetHidden
from longspec.speculation.drafters.longspec.strategies import Proposal, SampledChainStrategy
from longspec.speculation.tree import Tree


class LongSpecDrafter(Drafter):
    runs_model = True  # each proposal runs the draft network (see drafters.base)

    def __init__(
        self,
        draft: DraftModel | str | Path,
        strategy,
        *,
        retrieval=None,
        retrieval_nodes: int = 10,
        retrieval_streak: int | None = 0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        context_vocab: bool = False,
    ) -> None:
        """retrieval_streak: accepted retrieval tokens in a round that let the next
        round skip the draft (0: skip it whenever retrieval has candidates; None:
        the draft runs every round). seed / generator: a fixed random stream for the
        sampled strategy; by default it is the one the engine derives from the
        request's seed (`DraftContext.generator`). context_vocab: score only the tokens
        of the draft's vocabulary that the sequence has used (`ContextVocabulary`: on a
        large-vocabulary target the head is most of a draft step's bytes)."""
        if isinstance(draft, (str, Path)):
            draft = load_draft(draft)
        self.draft = draft.eval().requires_grad_(False)
        self.strategy = strategy
        self.sampled = isinstance(strategy, SampledChainStrategy)
        if retrieval is not None and self.sampled:
            raise ValueError(
                "retrieval chains cannot join a tree of sampled children (their q would no longer be "
                "the distribution they were drawn from); use a deterministic strategy with retrieval"
            )
        self.retrieval = retrieval
        self.retrieval_nodes = retrieval_nodes
        if retrieval_streak is not None and (isinstance(retrieval_streak, bool) or not isinstance(retrieval_streak, int) or retrieval_streak < 0):
            raise ValueError(f"retrieval_streak must be an int >= 0 or None, got {retrieval_streak!r}")
        self.retrieval_streak = retrieval_streak
        if not isinstance(context_vocab, bool):
            raise ValueError(f"context_vocab must be true or false, got {context_vocab!r}")
        self.context_vocab = context_vocab
        self._vocab: ContextVocabulary | None = None  # the scored tokens, with context_vocab
        self._retrieval_chains_proposed: list[list[int]] = []
        self._on_streak = False
        self.skipped_rounds = 0  # rounds proposed by retrieval alone (the draft did not run)
        self.generator = generator if generator is not None else (torch.Generator().manual_seed(seed) if seed is not None else None)
        self._sequence_generator: torch.Generator | None = self.generator  # this sequence's stream, set by begin()
        self.state: DraftState | None = None
        self._target: TargetView | None = None
        self._prepared_for: torch.Tensor | None = None
        self._head_rows: torch.Tensor | None = None
        self._packed_head: PackedWeight | None = None
        self._project: PackedProjection | None = None
        self._root_logprobs: torch.Tensor | None = None
        self._last_token: int | None = None
        self._view = None
        self._length = 0  # committed tokens, as observed
        self._recent_hidden: RecentTargetHidden | None = None  # EAGLE-style drafts only
        self._target_rope: RopeRows | None = None  # the target's RoPE rows at the draft's positions

    # --------------------------------------------------------------- protocol
    def check_target(self, config) -> None:
        """Raise DraftMismatchError naming each field where the draft does not fit
        (and ValueError for a malformed draft vocabulary)."""
        self.draft.config.check_fits(config)
        self.draft.check_vocab_ids()

    def begin(self, context: DraftContext) -> None:
        view = context.target
        if view is None:
            raise ValueError("the LongSpec drafter needs the target view (cross-attention reads the target's K/V)")
        self.check_target(view.config)
        dtype, device = view.dtype, view.device
        if self._prepared_for is not view.embedding or self.state is None or self.state.ring_k.dtype != dtype:
            self.draft.to(device=device, dtype=dtype)
            self._head_rows = self.draft.head_rows(view.head)  # the shared head itself, or its V_d rows once
            # The prepared head (runtime.linear) for bf16 speed: the target's own prepared
            # head when scoring the full vocabulary (no copy), else one of the V_d rows.
            own = view.packed_head
            native = view.native_kernels
            # With the context vocabulary the head rows are prepared by `ContextVocabulary`.
            self._packed_head = (None if self.context_vocab else
                                 own if not self.draft.reduced_vocab else prepack(self._head_rows, native_kernels=native))
            self._project = PackedProjection(self.draft, native_kernels=native)
            self.draft.use_native_kernels(native)
            self._target_rope = RopeRows(lambda positions: target_rope(view, positions, dtype))
        capacity = max(int(context.max_nodes), 1)
        if (self.state is None or self.state.capacity != capacity or self.state.ring_k.dtype != dtype
                or self.state.ring_k.device != device):
            self.state = DraftState(self.draft.config, capacity, dtype, device, view.attention)
        self.state.reset()
        self._length = int(context.tokens.numel())
        self._recent_hidden = None
        if self.draft.config.hidden_input:
            # The catch-up reads the state of up to a window of committed positions.
            self._recent_hidden = RecentTargetHidden(self.draft.config.window + capacity + 1,
                                                     self.draft.config.hidden_size, dtype, device)
            if view.prefill_hidden is not None:
                self._recent_hidden.write(view.committed_length - view.prefill_hidden.shape[0], view.prefill_hidden)
        self._sequence_generator = self.generator if self.generator is not None else context.generator
        self._vocab = None
        if self.context_vocab:
            allowed = self.draft.vocab_ids if self.draft.reduced_vocab else None
            self._vocab = ContextVocabulary(view.head, allowed, native_kernels=view.native_kernels)
            self._vocab.add(context.tokens)
        self._target = view
        self._prepared_for = view.embedding  # the target (its weights) the prepared head and state belong to
        self._view = view
        self._root_logprobs = None
        self._last_token = None
        self._retrieval_chains_proposed = []
        self._on_streak = False
        self.skipped_rounds = 0
        if self.retrieval is not None:
            self.retrieval.begin(context)

    def observe(self, committed: torch.Tensor) -> None:
        view = self._view
        if self._recent_hidden is not None and view is not None and view.last_hidden is not None:
            # The accepted path's states, root first: the root sat at position length - 1.
            self._recent_hidden.write(self._length - 1, view.last_hidden)
        self._length += int(committed.numel())
        if self._vocab is not None:
            self._vocab.add(committed)
        if self.retrieval is not None:
            self.retrieval.observe(committed)
            accepted = committed.tolist()[:-1]  # the bonus token was not proposed
            from_retrieval = max((_common_prefix(chain, accepted) for chain in self._retrieval_chains_proposed), default=0)
            self._on_streak = self.retrieval_streak is not None and from_retrieval >= self.retrieval_streak

    @property
    def prefill_hidden_rows(self) -> int:
        """An EAGLE-style draft's catch-up reads the target's state of up to a window of
        prompt positions before the root."""
        return self.draft.config.window + 1 if self.draft.config.hidden_input else 0

    def state_nbytes(self) -> int:
        """The draft's ring and pending buffer (constant in context length), plus
        the retrieval drafter's index when one is merged in."""
        own = self.state.nbytes() if self.state is not None else 0
        own += self._recent_hidden.nbytes() if self._recent_hidden is not None else 0
        own += self._vocab.nbytes() if self._vocab is not None else 0
        return own + (self.retrieval.state_nbytes() if self.retrieval is not None else 0)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Tree:
        if self.state is None:
            raise RuntimeError("call begin() before propose()")
        view = context.target
        tokens = context.tokens
        budget = int(context.max_nodes)
        root = context.root
        if budget <= 0:
            return Tree.chain(root, [])
        retrieval_chains = self._retrieval_chains(context) if self.retrieval is not None else []
        self._retrieval_chains_proposed = retrieval_chains
        if retrieval_chains and (self._on_streak or self.retrieval_streak == 0):
            self.skipped_rounds += 1
            return Tree.chain(root, []).with_chains(retrieval_chains)
        if self._vocab is not None and not len(self._vocab):  # the sequence used no token the draft scores
            return Tree.chain(root, []).with_chains(retrieval_chains)
        retrieval_size = len({tuple(c[: i + 1]) for c in retrieval_chains for i in range(len(c))})
        self.state.drop_pending()
        root_logprobs = self._catch_up(tokens, view)
        root_position = tokens.numel() - 1
        device = view.device
        slot_of: dict[int, int] = {}  # tree node -> pending slot of the draft state
        depth_of: dict[int, int] = {0: 0}

        def expand(proposal: Proposal, nodes: list[int]) -> torch.Tensor:
            # Tree node i (>= 1) is proposal entry i - 1.
            parents = [proposal.parents[n - 1] for n in nodes]
            for node, parent in zip(nodes, parents):
                depth_of[node] = depth_of[parent] + 1
            start = self.state.pending
            visible = torch.zeros((len(nodes), start + len(nodes)), dtype=torch.bool, device=device)
            for i, (node, parent) in enumerate(zip(nodes, parents)):
                if parent in slot_of:  # the root lives in the ring, not in pending slots
                    visible[i, :start] = self.state.pend_visible[slot_of[parent], :start]
                visible[i, start + i] = True
                slot_of[node] = start + i
            draft_ids = torch.tensor([proposal.tokens[n - 1] for n in nodes], dtype=torch.long, device=device)
            positions = root_position + torch.tensor([depth_of[n] for n in nodes], dtype=torch.long, device=device)
            return self._forward(self._full_ids(draft_ids), positions, visible, view)

        proposal = self.strategy.build(expand, root_logprobs, budget - retrieval_size, self._sequence_generator)
        tree = self._to_tree(root, proposal)
        if retrieval_chains:
            tree = tree.with_chains(retrieval_chains)
        return tree

    # ---------------------------------------------------------------- internals
    def _retrieval_chains(self, context: DraftContext) -> list[list[int]]:
        limited = dataclasses.replace(context, max_nodes=min(self.retrieval_nodes, int(context.max_nodes)))
        tree = self.retrieval.propose(limited)
        leaves = [i for i in range(1, tree.size) if tree.children(i).numel() == 0]
        return [tree.tokens[tree.path_to(leaf)[1:]].tolist() for leaf in leaves]

    def _catch_up(self, tokens: torch.Tensor, view) -> torch.Tensor:
        """Run the committed tokens the ring has not seen (the root last); returns
        the root's next-token log-probs over the draft vocabulary."""
        state = self.state
        length = tokens.numel()
        if state.committed > length or (state.committed and int(tokens[state.committed - 1]) != self._last_token):
            state.reset()  # a different sequence: start over
        start = max(state.committed, length - state.window)
        if start >= length:  # nothing new since the last round (propose called twice)
            return self._root_logprobs
        hidden = None
        for begin in range(start, length, state.capacity):
            piece = tokens[begin : min(begin + state.capacity, length)]
            positions = torch.arange(begin, begin + piece.numel(), device=view.device)
            causal = torch.ones((piece.numel(), piece.numel()), dtype=torch.bool, device=view.device).tril_()
            hidden = self._hidden(piece, positions, causal, view)
            state.commit_pending()
        self._last_token = int(tokens[-1])
        self._root_logprobs = self._logprobs(hidden[-1:])[0]
        return self._root_logprobs

    def _forward(self, full_ids, positions, visible, view) -> torch.Tensor:
        return self._logprobs(self._hidden(full_ids, positions, visible, view))

    def _hidden(self, full_ids, positions, visible, view) -> torch.Tensor:
        self.state.prepare_forward(positions, visible)
        x = view.embed(full_ids.to(view.device).unsqueeze(0)).to(self._head_rows.dtype)
        rope = self._target_rope(positions)
        committed = view.committed_length
        scale = view.config.attention_scale
        cross_kv = [view.layer_kv(layer) for layer in self.draft.config.target_layers]

        config = self.draft.config
        bias = key_index = None
        if config.cross_attention_masked and committed:
            # The recency bias covers every key read, so the prefix needs it too: one
            # biased pass over the keys the draft may read (its window and sinks).
            key_positions = cross_window_keys(config, int(positions.min()), committed, positions.device)
            key_visible = key_positions.unsqueeze(0) < positions.unsqueeze(1)
            bias = cross_attention_bias(config, positions, key_positions, key_visible, torch.float64)
            if key_positions.numel() < committed:
                key_index = key_positions

        def attend_cross(m: int, q: torch.Tensor) -> torch.Tensor:
            k, v = cross_kv[m]
            if bias is not None:
                if key_index is not None:
                    k, v = k.index_select(2, key_index), v.index_select(2, key_index)
                return biased_attention(q, k, v, bias, scale)
            # A query at position p sees target keys at positions < p (the committed
            # prefix holds positions < `committed`): keys before the first query's
            # position are visible to all, the rest by position.
            split = min(int(positions[0]), committed)
            if committed == 0:
                return torch.zeros_like(q)
            if split == committed:
                return view.attention(q, k, v, None, None, None, None, scale)
            key_pos = torch.arange(split, committed, device=positions.device)
            tail_mask = key_pos.unsqueeze(0) < positions.unsqueeze(1)
            return view.attention(q, k[:, :, :split], v[:, :, :split], None, k[:, :, split:], v[:, :, split:], tail_mask, scale)

        target_hidden = None
        if self._recent_hidden is not None:
            # Each query reads the state of the newest target token it may see.
            target_hidden = self._recent_hidden.read(torch.clamp(positions, max=committed) - 1).unsqueeze(0)
        return self.draft(x, positions, rope, self.state.attend, attend_cross, self._project, target_hidden)[0]

    def _scored_ids(self) -> torch.Tensor | None:
        """Full-vocabulary ids of the tokens `_logprobs` scores, in its order (None: all)."""
        if self._vocab is not None:
            return self._vocab.ids
        return self.draft.vocab_ids if self.draft.reduced_vocab else None

    def _full_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        scored = self._scored_ids()
        return draft_ids if scored is None else scored[draft_ids]

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the scored tokens (the draft's vocabulary, or the part
        of it the sequence has used)."""
        scores = self._vocab.scores(hidden) if self._vocab is not None else packed_linear(hidden, self._head_rows, self._packed_head)
        logits = softcap(scores, self._target.config.final_logit_softcapping)
        return torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)

    def _to_tree(self, root: int, proposal: Proposal) -> Tree:
        device = self._target.device
        ids = self._full_ids(torch.tensor(proposal.tokens, dtype=torch.long, device=device))
        tokens = [root] + ids.tolist()
        parents = [-1] + proposal.parents
        if proposal.probs is None:
            return Tree.from_parents(tokens, parents)
        vocab = self._target.config.vocab_size
        q = torch.zeros((len(tokens), vocab), dtype=torch.float64, device=device)
        scored = self._scored_ids()
        for node, row in enumerate(proposal.probs):
            if scored is not None:
                q[node, scored] = row
            else:
                q[node] = row
        return Tree.from_parents(tokens, parents, draft_probs=q, children_sampled=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
