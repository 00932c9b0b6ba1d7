"""The distinct tokens a sequence has used, with their rows of an output head: what a
drafter scores when reading the whole head would cost as much as its network.

On a large-vocabulary target (Gemma 3: 262k tokens) the head dominates a small
drafter's bytes: the LongSpec draft's 32k-row head is three quarters of a draft
step's weights. A sequence of a few thousand tokens uses a few thousand distinct
ones, and drafts mostly repeat them. Scoring only those makes the candidates
approximate — a token the sequence has not used yet is never proposed — while
verification stays exact over the full vocabulary.

The rows are kept in scoring order (first use). Most are in one prepared block for
the runtime's fast product (`runtime.linear`); rows added since it was prepared are
scored apart, and the block is rebuilt once they exceed a share of it, so a sequence
pays a handful of rebuilds, not one per new token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longspec.runtime.linear import PackedWeight, packed_linear, prepack

# Rows added since the last rebuild may reach this share of the prepared block (or
# `_MIN_TAIL` rows) before it is rebuilt: the tail's plain product costs a few
# microseconds per hundred rows, a rebuild a few milliseconds per thousand.
_TAIL_SHARE = 0.25
_MIN_TAIL = 256


class ContextVocabulary:
    """head: [V, H] output head (its rows are gathered, never copied whole);
    allowed: optional 1-D ids the scoring is limited to (a drafter trained on a reduced
    vocabulary scores only its own tokens); native_kernels: prepare the block for the
    runtime's native product where it applies (bf16 on CPU)."""

    def __init__(self, head: torch.Tensor, allowed: torch.Tensor | None = None, *, native_kernels: bool = True) -> None:
        self.head = head
        self.native_kernels = native_kernels
        self._allowed: torch.Tensor | None = None
        if allowed is not None:
            self._allowed = torch.zeros(head.shape[0], dtype=torch.bool, device=head.device)
            self._allowed[allowed.to(head.device)] = True
        self._seen = torch.zeros(head.shape[0], dtype=torch.bool, device=head.device)
        self._ids = torch.empty(0, dtype=torch.long, device=head.device)  # in scoring order: the block's, then the tail's
        self._block_rows = self._tail_rows = head.new_empty((0, head.shape[1]))
        self._packed: PackedWeight | None = None

    def add(self, tokens: torch.Tensor) -> None:
        """Admit the tokens not yet seen (and allowed), in order of first use."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(self.head.device)
        if not tokens.numel():
            return
        unique, first = _first_uses(tokens)
        keep = ~self._seen[unique]
        if self._allowed is not None:
            keep &= self._allowed[unique]
        if not bool(keep.any()):
            return
        new = unique[keep][torch.argsort(first[keep])]
        self._seen[new] = True
        self._ids = torch.cat([self._ids, new])
        self._tail_rows = torch.cat([self._tail_rows, self.head.index_select(0, new)])
        if self._tail_rows.shape[0] > max(_MIN_TAIL, _TAIL_SHARE * self._block_rows.shape[0]):
            self._block_rows = torch.cat([self._block_rows, self._tail_rows]).contiguous()
            self._packed = prepack(self._block_rows, native_kernels=self.native_kernels)
            self._tail_rows = self._tail_rows[:0]

    @property
    def ids(self) -> torch.Tensor:
        """The scored tokens' ids, in the order of `scores`' last dimension."""
        return self._ids

    def __len__(self) -> int:
        return self._ids.numel()

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> the head's scores of the admitted tokens [..., len(self)]."""
        hidden = hidden.to(self.head.dtype)
        if not self._block_rows.shape[0]:  # nothing prepared yet (an empty vocabulary gives [..., 0])
            return F.linear(hidden, self._tail_rows)
        block = packed_linear(hidden, self._block_rows, self._packed)
        if not self._tail_rows.shape[0]:
            return block
        return torch.cat([block, F.linear(hidden, self._tail_rows)], dim=-1)

    def nbytes(self) -> int:
        rows = self._block_rows.numel() + self._tail_rows.numel()
        flags = self._seen.numel() + (self._allowed.numel() if self._allowed is not None else 0)
        return rows * self.head.element_size() + self._ids.numel() * self._ids.element_size() + flags


def _first_uses(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens and, per distinct token, the index of its first use."""
    unique, inverse = torch.unique(tokens, return_inverse=True)
    first = torch.full((unique.numel(),), tokens.numel(), dtype=torch.long, device=tokens.device)
    first.scatter_reduce_(0, inverse, torch.arange(tokens.numel(), device=tokens.device), "amin")
    return unique, first
