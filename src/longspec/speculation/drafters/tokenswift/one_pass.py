"""TokenSwift's heads on the verification pass (Medusa-style self-drafting): one
target forward per round instead of two.

The verification forward already computes the final hidden state of every tree
node; the engine hands the accepted path's to drafters (`TargetView.last_hidden`).
At the last accepted node that state predicts the bonus token through the LM head,
and TokenSwift's head i predicts the token i + 1 after the bonus — so the next
round's tree, rooted at the bonus, is the Cartesian tree of the heads' top
candidates ([w1, w2, w3] for heads 1..3) plus the n-gram continuations of the bonus.

Where a forward is dominated by weight reads (small targets, CPU), the paper's
drafting forward over a partial KV cache costs nearly a whole second forward; this
mode drops it and pays only the heads. Scoring the heads through the whole LM head
would still read it once more per round (on Gemma 3 270M, 262k x 640: about half a
forward's bytes), so by default the heads score only the tokens the sequence has
used so far (`context_vocab`): their candidates may be approximate — verification
stays exact over the full vocabulary.
Where K/V reads dominate (a large target at 100k tokens), the partial cache's
cheaper forward and its LM-head depth-1 candidate can win instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.shared.context_vocab import ContextVocabulary
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.drafters.shared.ngram_table import NgramTable
from longspec.speculation.drafters.tokenswift.drafter import heads_for_target
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.tree import add_chains_within, cartesian_within
from longspec.speculation.tree import Tree


class OnePassTokenSwiftDrafter(Drafter):
    """Options:
    heads: `TokenSwiftHeads`, a heads file, or None for the heads shipped for the
        embedded Gemma 3 270M.
    widths: candidates per depth, from heads 1, 2, ... (at most one per head).
    k: n-gram continuations of the bonus token joined to the tree (0 disables).
    context_vocab: the heads score only the distinct tokens of the sequence so far
        (False: the whole vocabulary).
    """

    # Small trees by default: on a CPU a forward turns compute-bound after a few tokens
    # (docs/lab-notes/forward-cost.md#forward-cost-against-its-floor-where-trees-stop-being-free-issue-runtime-cost-model);
    # (2, 1, 1) + 2 chains stays near that knee.
    def __init__(self, heads: TokenSwiftHeads | str | Path | None = None, *, widths: tuple[int, ...] = (2, 1, 1),
                 k: int = 2, ngram: int = 4, context_vocab: bool = True) -> None:
        self.heads_source = heads
        self.heads: TokenSwiftHeads | None = heads if isinstance(heads, TokenSwiftHeads) else None
        self.widths = tuple(check_positive_int("widths", int(w), 1) for w in widths)
        if not self.widths:
            raise ValueError("widths needs at least one depth")
        self.k = k if k == 0 else check_positive_int("k", k, 0)
        self.ngram = check_positive_int("ngram", ngram, 2)
        self.table = NgramTable(ngram)
        if not isinstance(context_vocab, bool):
            raise ValueError(f"context_vocab must be true or false, got {context_vocab!r}")
        self.context_vocab = context_vocab
        self._vocab: ContextVocabulary | None = None  # the tokens the heads score, with context_vocab
        self._view = None
        self.hidden_used: torch.Tensor | None = None  # the state the last tree was drafted from (for tests)

    def check_target(self, config) -> None:
        """Load the heads (once) and raise if they do not fit `config` or the widths."""
        self.heads = heads_for_target(self.heads, self.heads_source, config)
        if len(self.widths) > self.heads.config.num_heads:
            raise ValueError(f"widths {self.widths} need {len(self.widths)} heads; these have {self.heads.config.num_heads}")

    def begin(self, context: DraftContext) -> None:
        view = context.target
        if view is None:
            raise ValueError("the one-pass TokenSwift drafter reads the verification's hidden states: it needs a TargetView")
        self.check_target(view.config)
        wide = torch.float64 if view.dtype == torch.float64 else torch.float32
        self.heads = self.heads.to(device=view.device, dtype=wide)
        self._view = view
        tokens = torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1)
        self.table = NgramTable(self.ngram)
        self.table.update(tokens)
        self._vocab = None
        if self.context_vocab:
            self._vocab = ContextVocabulary(view.head, native_kernels=view.native_kernels)
            self._vocab.add(tokens)
        self.hidden_used = None

    def observe(self, committed: torch.Tensor) -> None:
        self.table.update(committed)
        if self._vocab is not None:
            self._vocab.add(committed)

    def state_nbytes(self) -> int:
        return self.table.nbytes() + (self._vocab.nbytes() if self._vocab is not None else 0)

    def _candidates(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Top `widths[i]` tokens of head i + 1 at the last accepted node's state."""
        model = self._view.decoder_for_self_drafting
        count = len(self.widths)
        if self._vocab is None:
            logits = self.heads.logits(model, hidden)[:count]
            return [torch.topk(row, width).indices for width, row in zip(self.widths, logits)]
        states = model.final_norm(self.heads.hidden_states(model, hidden)[:count].to(model.dtype))
        scores = self._vocab.scores(states)  # the final soft-cap is monotonic: top-k unchanged
        return [self._vocab.ids[torch.topk(row, min(width, row.numel())).indices] for width, row in zip(self.widths, scores)]

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Tree:
        if self._view is None:
            raise RuntimeError("call begin() before propose()")
        root = context.root
        if self.table.length != context.tokens.numel():
            self.table = NgramTable(self.ngram)
            self.table.update(torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1))
        hidden = self._view.last_hidden
        if hidden is None:  # the first round: no verification has run yet
            tree = Tree.chain(root, [])
        else:
            self.hidden_used = hidden[-1]
            candidates = self._candidates(hidden[-1])
            tree = cartesian_within(root, candidates, context.max_nodes)
        if self.k:
            chains = [c.tolist() for c in self.table.top_continuations(root, self.k)]
            tree = add_chains_within(tree, chains, context.max_nodes)
        return tree
