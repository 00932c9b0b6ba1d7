"""The draft's inference state: a fixed-size ring of its own K/V for committed
tokens, and a small fixed buffer for the speculative nodes of the current round.

Sizes depend only on the draft config and the engine's tree budget, never on the
context length (docs/design.md#promises, bounded draft memory): the ring holds `window` slots (token at position
p lives in slot p % window), the pending buffer `capacity` slots. Pending tokens
are either committed into the ring (catching up on committed text) or dropped
(speculative nodes, at the start of the next round).
"""

from __future__ import annotations

import torch

from longspec.runtime.attention import AttentionBackend, fused_attention
from longspec.runtime.device import HOST
from longspec.speculation.drafters.longspec.config import DraftConfig

_EMPTY = -(2**62)


class DraftState:
    def __init__(self, config: DraftConfig, capacity: int, dtype: torch.dtype,
                 device: torch.device = HOST, attention: AttentionBackend = fused_attention) -> None:
        if capacity < 1:
            raise ValueError(f"pending capacity must be >= 1, got {capacity}")
        c = config
        self.window = c.window
        self.capacity = capacity
        self.scale = c.self_head_dim ** -0.5
        self.attention = attention
        shape = (c.num_layers, 1, c.self_num_heads)
        self.ring_k = torch.zeros((*shape, c.window, c.self_head_dim), dtype=dtype, device=device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.ring_positions = torch.full((c.window,), _EMPTY, dtype=torch.long, device=device)
        self.pend_k = torch.zeros((*shape, capacity, c.self_head_dim), dtype=dtype, device=device)
        self.pend_v = torch.zeros_like(self.pend_k)
        self.pend_positions = torch.zeros(capacity, dtype=torch.long, device=device)
        # visible[i, j]: pending token i sees pending token j (itself and its ancestors)
        self.pend_visible = torch.zeros((capacity, capacity), dtype=torch.bool, device=device)
        self.pending = 0
        self.committed = 0  # committed tokens whose K/V went through the ring
        # Per-forward inputs, set by `prepare_forward`.
        self._new_slots = slice(0, 0)
        self._ring_mask: torch.Tensor | None = None

    def reset(self) -> None:
        self.ring_positions.fill_(_EMPTY)
        self.pending = 0
        self.committed = 0

    def nbytes(self) -> int:
        tensors = (self.ring_k, self.ring_v, self.ring_positions, self.pend_k, self.pend_v, self.pend_positions, self.pend_visible)
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------- one forward
    def prepare_forward(self, positions: torch.Tensor, visible_pending: torch.Tensor) -> None:
        """Reserve pending slots for T new tokens at `positions`; `visible_pending`
        [T, pending + T] says which pending tokens (earlier ones, then these) each sees."""
        T = positions.numel()
        start = self.pending
        if start + T > self.capacity:
            raise ValueError(f"draft pending buffer holds {self.capacity} tokens; {start} + {T} requested")
        self.pend_positions[start : start + T] = positions
        self.pend_visible[start : start + T, : start + T] = visible_pending
        self.pend_visible[start : start + T, start + T :] = False
        self._new_slots = slice(start, start + T)
        in_window = self.ring_positions.unsqueeze(0) > positions.unsqueeze(1) - self.window
        self._ring_mask = in_window & (self.ring_positions.unsqueeze(0) >= 0)
        self.pending = start + T

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Self-attention of this forward's queries over the ring and the pending tokens."""
        slots = self._new_slots
        self.pend_k[layer, :, :, slots] = k
        self.pend_v[layer, :, :, slots] = v
        end = slots.stop
        distance = self.pend_positions[slots].unsqueeze(1) - self.pend_positions[:end].unsqueeze(0)
        pend_mask = self.pend_visible[slots, :end] & (distance < self.window)
        return self.attention(
            q, self.ring_k[layer], self.ring_v[layer], self._ring_mask,
            self.pend_k[layer, :, :, :end], self.pend_v[layer, :, :, :end], pend_mask, self.scale,
        )

    # ---------------------------------------------------------- commit / drop
    def commit_pending(self) -> None:
        """Move every pending token (committed text, in order) into the ring."""
        n = self.pending
        if n > self.window:
            raise ValueError(f"cannot commit {n} tokens at once into a ring of {self.window}")
        positions = self.pend_positions[:n]
        slots = positions % self.window
        self.ring_k[:, :, :, slots] = self.pend_k[:, :, :, :n]
        self.ring_v[:, :, :, slots] = self.pend_v[:, :, :, :n]
        self.ring_positions[slots] = positions
        self.committed = int(positions[-1]) + 1 if n else self.committed
        self.pending = 0

    def drop_pending(self) -> None:
        self.pending = 0


class RecentTargetHidden:
    """The target's final hidden states of the most recent positions, in a ring of
    fixed size (what an EAGLE-style draft fuses into its input): position p lives in
    slot p % size. Reading a position that was never written, or was overwritten,
    gives zeros — the same input training gives a query that sees no target token."""

    def __init__(self, size: int, hidden_size: int, dtype: torch.dtype, device: torch.device = HOST) -> None:
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.values = torch.zeros((size, hidden_size), dtype=dtype, device=device)
        self.positions = torch.full((size,), _EMPTY, dtype=torch.long, device=device)

    def write(self, first_position: int, rows: torch.Tensor) -> None:
        """rows [n, H]: the states of positions first_position .. first_position + n - 1."""
        size = self.values.shape[0]
        if rows.shape[0] > size:  # only the last `size` can be kept
            first_position += rows.shape[0] - size
            rows = rows[-size:]
        positions = first_position + torch.arange(rows.shape[0], device=self.positions.device)
        slots = positions % self.values.shape[0]
        self.values[slots] = rows.to(self.values.dtype)
        self.positions[slots] = positions

    def read(self, positions: torch.Tensor) -> torch.Tensor:
        slots = positions.clamp(min=0) % self.values.shape[0]
        known = (self.positions[slots] == positions) & (positions >= 0)
        return self.values[slots].masked_fill(~known.unsqueeze(1), 0.0)

    def reset(self) -> None:
        self.positions.fill_(_EMPTY)

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.positions.numel() * 8
