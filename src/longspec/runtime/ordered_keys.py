"""A forward's keys listed in the order of their sequence positions, for the native
kernel's `ordered_attention` (`kernels/few_query_attention.cpp`).

The cache keeps keys where it can: a ring slot is position mod R, and a tree's pending
tokens sit in tree order, siblings at one position. Attention that walks the slots in
that order rounds differently from one that walks a plain sequence, so in bf16 a token
verified inside a tree would not get the bits it gets when decoded alone, and
speculative decoding would drift from plain decoding after a near-tie. Listed by
position instead, every step of the kernel's arithmetic is fixed by the positions a
query sees (blocks of 64 positions, chunks of `chunk` positions, chunks merged in
order), and a query's result is the same bits whatever else the forward holds. Chunk
sizes are fixed per kind of layer, never by the forward's size or the thread count,
for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longspec.runtime.attention import NATIVE_ATTENTION_MAX_QUERIES
from longspec.runtime.native import attention_ops

# Positions per parallel task. Full layers: 512 (the chunks' partial sums stay a few MB
# for a 65-node tree at 16k keys). Sliding layers read at most a window (512 here) plus a
# tree: 128 keeps 4-5 tasks for the two threads of a decode step.
FULL_CHUNK_POSITIONS = 512
RING_CHUNK_POSITIONS = 128

_PAST_THE_END = torch.iinfo(torch.int64).max  # sorts after every real position


@dataclass(frozen=True)
class OrderedKeys:
    """Per row: the slots to read, sorted by position, and who sees them."""

    slots: torch.Tensor  # [B, N] int64, slot of each entry
    positions: torch.Tensor  # [B, N] int64, non-decreasing over a row's first `counts` entries
    counts: torch.Tensor  # [B] int64, entries in use per row
    shared: torch.Tensor  # [B] int64, leading entries every query of the row sees
    visible: torch.Tensor | None  # [1 or B, T, M] bool: column j is entry shared + j
    chunk: int


def prefix_then_pending(length: int, positions: torch.Tensor, new_mask: torch.Tensor, chunk: int) -> OrderedKeys:
    """One sequence's full-attention layer: committed slots 0..length-1 hold positions
    0..length-1, seen by every query; the T pending tokens (slots length..) sit at
    `positions` [T] under `new_mask` [T, T]."""
    device = positions.device
    order = torch.argsort(positions, stable=True)
    committed = torch.arange(length, device=device)
    return OrderedKeys(
        slots=torch.cat([committed, order + length]).unsqueeze(0),
        positions=torch.cat([committed, positions[order].to(torch.int64)]).unsqueeze(0),
        counts=torch.tensor([length + positions.numel()], dtype=torch.int64),
        shared=torch.tensor([length], dtype=torch.int64),
        visible=new_mask[:, order].unsqueeze(0).contiguous(),
        chunk=chunk,
    )


def sorted_by_position(slot_positions: torch.Tensor, visible: torch.Tensor, chunk: int) -> OrderedKeys:
    """Any layout: `slot_positions` [B, S] (the position each slot holds) and `visible`
    [B, T, S]; slots no query sees are left out."""
    B, T, S = visible.shape
    seen = visible.any(dim=1)  # [B, S]
    keys = torch.where(seen, slot_positions.expand(B, S), _PAST_THE_END)
    sorted_positions, order = torch.sort(keys, dim=1, stable=True)
    counts = seen.sum(dim=1)
    N = max(int(counts.max()), 1)
    order = order[:, :N].contiguous()
    return OrderedKeys(
        slots=order,
        positions=sorted_positions[:, :N].contiguous(),
        counts=counts.to(torch.int64),
        shared=torch.zeros(B, dtype=torch.int64),
        visible=torch.gather(visible, 2, order.unsqueeze(1).expand(B, T, N)).contiguous(),
        chunk=chunk,
    )


def ordered_attention_fits(q_dtype: torch.dtype, device: torch.device, tokens: int, head_dim: int) -> bool:
    """Where the native kernel serves a forward: bf16 on a CPU with AVX-512 BF16 or AVX2, a head
    dimension of whole registers, a decode step or a tree (prompt chunks go to flash)."""
    return (
        device.type == "cpu"
        and q_dtype == torch.bfloat16
        and tokens <= NATIVE_ATTENTION_MAX_QUERIES
        and head_dim % 32 == 0
        and attention_ops() is not None
    )


def ordered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: OrderedKeys, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] over the listed slots of k/v [B, Hkv, S, D]."""
    out, _ = attention_ops().ordered_attention(
        q.contiguous(), k, v, keys.slots, keys.positions, keys.counts, keys.shared, keys.visible, keys.chunk, scale
    )
    return out
