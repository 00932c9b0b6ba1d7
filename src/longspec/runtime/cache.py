"""The target's KV cache, owned by the engine (not hidden in modules).

Full-attention layers share one preallocated tensor [layers, B, Hkv, capacity, D];
sliding-window layers share one ring [layers, B, Hkv, R, D] with R = window +
headroom, where headroom is the most tokens a single forward may add. The committed
token at position p lives in full slot p and in ring slot p % R.

A forward appends T *pending* tokens after the committed length L (full slots
L..L+T-1, ring slots (L+i) % R). Then the caller either commits all of them
(prefill, autoregressive decoding) or commits a subset — the accepted path of a
speculative tree — which is compacted into slots L..L+a-1 for every layer with one
gather/scatter per tensor; the rest are dropped.

Why the ring never loses a needed key: a forward of T <= headroom tokens overwrites
ring slots of positions <= L + T - 1 - R <= L - window, which no query at a
position >= L can see (a query at p sees keys at positions > p - window).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from longspec.runtime.config import DecoderConfig
from longspec.runtime.device import HOST

EMPTY_SLOT = -(2**62)  # position of ring slots holding nothing visible


@dataclass(frozen=True)
class LayerGroups:
    """Full-attention layers and sliding-window (ring) layers, and each layer's index
    within its group: the caches keep one tensor per group."""

    full: list[int]
    ring: list[int]
    index: dict[int, int]


def layer_groups(config: DecoderConfig) -> LayerGroups:
    full = [i for i, s in enumerate(config.layer_is_sliding) if not s]
    ring = [i for i, s in enumerate(config.layer_is_sliding) if s]
    index = {layer: j for j, layer in enumerate(full)}
    index.update({layer: j for j, layer in enumerate(ring)})
    return LayerGroups(full, ring, index)


def ring_slots(config: DecoderConfig, capacity: int, max_forward_tokens: int) -> int:
    """Slots of a sliding layer's ring: the window plus the largest forward (never
    more than the capacity); 0 when the model has no sliding layer."""
    if not any(config.layer_is_sliding):
        return 0
    return min(capacity, (config.sliding_window or 0) + max_forward_tokens)


def ring_prefix_mask(slot_positions: torch.Tensor, length: int, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[T, R] bool: the ring slots (holding `slot_positions` [R]) that each query sees:
    committed (pending tokens sit at positions >= length) and within its window."""
    committed = slot_positions < length
    in_window = slot_positions.unsqueeze(0) > (query_positions.unsqueeze(1) - window)
    return committed.unsqueeze(0) & in_window


# From this size on, a host cache tensor comes from an anonymous mapping, whose pages the OS hands out
# zeroed at their first touch: `torch.zeros` writes every page before the first token (a server's
# 8 rows of 32k tokens, 860 MiB, took seconds at startup), and memory is committed only as slots fill.
_MAPPED_ZEROS_BYTES = 16 << 20


def zeroed(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), from zero pages mapped on demand where it is large and on the host."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


class KVTensors:
    """What every K/V cache here holds (`KVCache`, `BatchKVCache`, the drafters'
    `PartialKVCache`): the layers split into full-attention and sliding (ring) groups,
    one K and one V tensor per group [layers, rows, kv heads, slots, head dim], and the
    position each ring slot holds (EMPTY_SLOT when empty; one ring per row where
    `ring_per_row`)."""

    def __init__(self, config: DecoderConfig, *, rows: int, slots: int, ring_size: int, max_forward_tokens: int,
                 dtype: torch.dtype, device: torch.device | str, ring_per_row: bool = False) -> None:
        if max_forward_tokens < 1:
            raise ValueError(f"max_forward_tokens must be >= 1, got {max_forward_tokens}")
        self.config = config
        self.device = torch.device(device)
        self.max_forward_tokens = max_forward_tokens
        self.window = config.sliding_window
        self.groups = layer_groups(config)
        self.group_index = self.groups.index  # layer index -> index within its group (full or ring)
        tail = (rows, config.num_kv_heads)
        D = config.head_dim
        self.full_k = zeroed((len(self.groups.full), *tail, slots, D), dtype, self.device)
        self.full_v = zeroed(self.full_k.shape, dtype, self.device)
        self.ring_size = ring_size
        self.ring_k = zeroed((len(self.groups.ring), *tail, ring_size, D), dtype, self.device)
        self.ring_v = zeroed(self.ring_k.shape, dtype, self.device)
        shape = (rows, ring_size) if ring_per_row else (ring_size,)
        self.ring_positions = torch.full(shape, EMPTY_SLOT, dtype=torch.long, device=self.device)


class KVCache(KVTensors):
    def __init__(
        self,
        config: DecoderConfig,
        capacity: int,
        *,
        batch_size: int = 1,
        max_forward_tokens: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        super().__init__(config, rows=batch_size, slots=capacity, max_forward_tokens=max_forward_tokens,
                         ring_size=ring_slots(config, capacity, max(max_forward_tokens, 1)), dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # committed tokens
        self.pending = 0  # tokens appended by the last forward, not yet committed or dropped
        self.pending_ring_slots = torch.empty(0, dtype=torch.long, device=self.device)

    # ---------------------------------------------------------------- forward side
    def next_positions(self, T: int) -> torch.Tensor:
        """Positions of T consecutive tokens after the committed prefix."""
        return self.length + torch.arange(T, device=self.device)

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Reserve slots for T new tokens at the given RoPE positions."""
        T = positions.numel()
        if self.pending:
            raise RuntimeError("the previous forward's tokens were neither committed nor dropped")
        if T > self.max_forward_tokens:
            raise ValueError(
                f"a forward of {T} tokens exceeds this cache's max_forward_tokens={self.max_forward_tokens}; "
                "split the input into chunks"
            )
        if self.length + T > self.capacity:
            raise ValueError(
                f"cache is full: {self.length} committed + {T} new tokens > capacity {self.capacity}"
            )
        self.pending = T
        if self.ring_size:
            slots = (self.length + torch.arange(T, device=positions.device)) % self.ring_size
            self.pending_ring_slots = slots
            self.ring_positions[slots] = positions

    def shrink_pending(self, count: int) -> None:
        """Keep only the first `count` pending tokens pending; forget the rest as if no
        forward had written them (a static step pads its tokens to a bucket size). Their
        ring slots hold nothing visible afterwards."""
        if not 0 <= count <= self.pending:
            raise ValueError(f"cannot shrink {self.pending} pending tokens to {count}")
        if self.ring_size and count < self.pending:
            self.ring_positions[self.pending_ring_slots[count:]] = EMPTY_SLOT
            self.pending_ring_slots = self.pending_ring_slots[:count]
        self.pending = count

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's K/V [B, Hkv, T, D] for one layer."""
        j = self.group_index[layer]
        if self.config.layer_is_sliding[layer]:
            self.ring_k[j].index_copy_(2, self.pending_ring_slots, k)
            self.ring_v[j].index_copy_(2, self.pending_ring_slots, v)
        else:
            L, T = self.length, self.pending
            self.full_k[j, :, :, L : L + T] = k
            self.full_v[j, :, :, L : L + T] = v

    def prefix(self, layer: int, include_pending: bool = False):
        """K/V views attended by this forward's queries: the committed prefix of a
        full layer (optionally with the pending tokens), or a whole ring."""
        j = self.group_index[layer]
        if self.config.layer_is_sliding[layer]:
            return self.ring_k[j], self.ring_v[j]
        end = self.length + (self.pending if include_pending else 0)
        return self.full_k[j, :, :, :end], self.full_v[j, :, :, :end]

    def ring_prefix_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        """[T, R] bool: ring slot visible to each query = committed and in its window."""
        return ring_prefix_mask(self.ring_positions, self.length, query_positions, self.window)

    # ----------------------------------------------------------------- commit side
    def commit(self, kept: torch.Tensor | None = None) -> None:
        """Keep pending tokens ``kept`` (indices into this forward's T tokens, in
        sequence order) as positions length.. length+a-1; drop the others.
        ``None`` keeps all of them in order."""
        T, L = self.pending, self.length
        if kept is None:
            kept_count = T
            in_place = True
        else:
            # Checked as a list on the host, where the engines keep their paths: on a GPU,
            # checks of a device copy would wait for the device, and a tensor operation per
            # check costs more than the check.
            indices = [int(i) for i in kept.reshape(-1).tolist()]
            kept_count = len(indices)
            if kept_count > T or (indices and (max(indices) >= T or min(indices) < 0)):
                raise ValueError(f"kept indices {indices} out of range for {T} pending tokens")
            in_place = indices == list(range(kept_count))
        if not in_place:
            src = torch.tensor([L + i for i in indices], dtype=torch.long, device=HOST).to(self.device)
            dst = torch.arange(L, L + kept_count, device=HOST).to(self.device)
            if self.full_k.shape[0]:
                self.full_k[:, :, :, dst] = self.full_k[:, :, :, src]
                self.full_v[:, :, :, dst] = self.full_v[:, :, :, src]
            if self.ring_size:
                rsrc, rdst = src % self.ring_size, dst % self.ring_size
                self.ring_k[:, :, :, rdst] = self.ring_k[:, :, :, rsrc]
                self.ring_v[:, :, :, rdst] = self.ring_v[:, :, :, rsrc]
        if self.ring_size and T and not (in_place and kept_count == T):
            # Kept token i now sits in pending slot i, (L + i) % ring (a forward's slots
            # never wrap onto each other); the rest are freed. Every token kept in place
            # (AR's round, a chain accepted whole) already has its label: the forward gave
            # it position L + i, as a committed token must have.
            labels = torch.arange(L, L + T, device=HOST)
            labels[kept_count:] = EMPTY_SLOT
            self.ring_positions[self.pending_ring_slots] = labels.to(self.device)
        self.length = L + kept_count
        self.pending = 0

    def drop_pending(self) -> None:
        self.commit(torch.empty(0, dtype=torch.long, device=self.device))

    def rollback(self, length: int) -> None:
        """Forget committed tokens from ``length`` on."""
        if self.pending:
            raise RuntimeError("commit or drop the pending tokens before rolling back")
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        if self.ring_size:
            headroom = self.ring_size - self.window
            # A ring as large as the capacity never wraps, so it never loses a key.
            wraps = self.ring_size < self.capacity
            if wraps and self.length - length > headroom and length > 0:
                raise ValueError(
                    f"sliding-window layers keep only {headroom} tokens beyond their window; "
                    f"cannot roll back {self.length - length} tokens"
                )
            # Exact check: a forward whose tokens were only partly kept (a tree) also
            # overwrote ring slots, so the headroom rule alone does not suffice.
            needed = torch.arange(max(0, length - self.window + 1), length, device=self.ring_positions.device)
            if bool((self.ring_positions[needed % self.ring_size] != needed).any()):
                raise ValueError(
                    f"cannot roll back to {length}: sliding-window layers no longer hold the keys "
                    f"of positions {needed[0].item()}..{length - 1} (overwritten by a later forward)"
                )
            stale = self.ring_positions >= length
            self.ring_positions[stale] = EMPTY_SLOT
        self.length = length

    def reset(self) -> None:
        self.pending = 0
        self.rollback(0)

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.ring_k, self.ring_v))
