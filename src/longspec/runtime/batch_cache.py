"""A KV cache for many sequences at once (ragged rows), owned by a batching engine.

Storage is `KVCache`'s layout with a row axis of fixed size (``max_rows``): full
layers [layers, rows, Hkv, row_capacity, D], sliding layers a ring [layers, rows,
Hkv, R, D] per row, R = window + headroom. Every row has its own committed length
and its own ring bookkeeping, so rows of different lengths share one forward.

Occupied rows are kept in the leading slots 0..n-1: a forward over the occupied
rows is a slice (a view, never a copy), and a row that leaves is replaced by the
last occupied row (one row's K/V moved), so rows come and go without reallocating
the cache. Callers hold a `CacheRow`, whose slot follows those moves.

A forward over rows [a, b) goes through `RowsView`, which implements what
`Decoder.forward` needs of a cache with per-row positions [B, T]: pending tokens
sit after each row's own length; `commit` keeps a different path per row, all
rows and layers compacted with one gather/scatter per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longspec.runtime.cache import EMPTY_SLOT, KVTensors, layer_groups, ring_prefix_mask, ring_slots
from longspec.runtime.config import DecoderConfig
from longspec.runtime.device import HOST


class CacheRow:
    """One sequence's place in a `BatchKVCache`; its slot moves when rows leave."""

    def __init__(self, cache: "BatchKVCache", slot: int) -> None:
        self._cache = cache
        self.slot = slot
        self.released = False

    @property
    def length(self) -> int:
        return int(self._cache.host_lengths[self.slot])

    def prefix(self, layer: int, include_pending: bool = False):
        """This row's committed K/V [1, Hkv, length, D] of a full layer (a view), or its ring."""
        return self._cache.rows(self.slot, self.slot + 1).prefix(layer, include_pending)

    def view(self) -> "RowsView":
        return self._cache.rows(self.slot, self.slot + 1)


class BatchKVCache(KVTensors):
    def __init__(
        self,
        config: DecoderConfig,
        row_capacity: int,
        max_rows: int,
        *,
        max_forward_tokens: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if row_capacity < 1:
            raise ValueError(f"row_capacity must be >= 1, got {row_capacity}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        super().__init__(config, rows=max_rows, slots=row_capacity, max_forward_tokens=max_forward_tokens,
                         ring_size=ring_slots(config, row_capacity, max(max_forward_tokens, 1)), dtype=dtype,
                         device=device, ring_per_row=True)
        self.row_capacity = row_capacity
        self.max_rows = max_rows
        self.lengths = torch.zeros(max_rows, dtype=torch.long, device=device)
        # The same on the host: what the host reads (the longest row, a row's length) it
        # reads here, so that no forward on a GPU waits for the device to answer.
        self.host_lengths = torch.zeros(max_rows, dtype=torch.long, device=HOST)
        self._rows: list[CacheRow] = []  # occupied, in slot order
        self.pending_view: RowsView | None = None  # the view whose forward awaits commit

    # ------------------------------------------------------------------ rows
    @property
    def occupied(self) -> int:
        return len(self._rows)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self._rows)

    def acquire(self) -> CacheRow:
        """An empty row (length 0) in the first free slot."""
        if not self.free_rows:
            raise RuntimeError(f"all {self.max_rows} rows of the cache are occupied")
        row = CacheRow(self, len(self._rows))
        self._clear(row.slot)
        self._rows.append(row)
        return row

    def release(self, row: CacheRow) -> None:
        """Free a row; the last occupied row moves into its slot (K/V copied once)."""
        if row.released or row._cache is not self:
            raise ValueError("this row is not held by this cache")
        last = self._rows[-1]
        if last is not row:
            self._move(last.slot, row.slot)
            self._rows[row.slot] = last
            last.slot = row.slot
        self._rows.pop()
        row.released = True
        self._clear(len(self._rows))

    def row_at(self, slot: int) -> CacheRow:
        return self._rows[slot]

    def swap(self, a: CacheRow, b: CacheRow) -> None:
        """Exchange the slots of two held rows (their K/V move with them)."""
        for row in (a, b):
            if row.released or row._cache is not self:
                raise ValueError("this row is not held by this cache")
        if a is b:
            return
        spare = self._rows[-1].slot + 1 if self.free_rows else None
        if spare is not None:  # through a free slot: three one-row moves
            self._move(a.slot, spare)
            self._move(b.slot, a.slot)
            self._move(spare, b.slot)
            self._clear(spare)
        else:
            self._exchange(a.slot, b.slot)
        self._rows[a.slot], self._rows[b.slot] = b, a
        a.slot, b.slot = b.slot, a.slot

    def rows(self, begin: int = 0, end: int | None = None) -> "RowsView":
        end = len(self._rows) if end is None else end
        if not 0 <= begin < end <= len(self._rows):
            raise ValueError(f"rows {begin}..{end} are not occupied ({len(self._rows)} rows are)")
        return RowsView(self, begin, end)

    # ------------------------------------------------------------ accounting
    @staticmethod
    def planned_nbytes(config: DecoderConfig, row_capacity: int, max_rows: int, *, max_forward_tokens: int,
                       dtype: torch.dtype) -> int:
        """What a cache of this shape allocates, before allocating it."""
        groups = layer_groups(config)
        ring_size = ring_slots(config, row_capacity, max_forward_tokens)
        per_slot = 2 * max_rows * config.num_kv_heads * config.head_dim * dtype.itemsize
        return per_slot * (len(groups.full) * row_capacity + len(groups.ring) * ring_size)

    def bytes_per_row(self) -> int:
        return self.nbytes() // self.max_rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.ring_k, self.ring_v))

    def bytes_in_use(self) -> int:
        """Bytes of the rows now held by sequences (a free row costs nothing to reuse)."""
        return self.occupied * self.bytes_per_row()

    def copy_row(self, source: CacheRow, target: CacheRow) -> None:
        """Give `target` the committed K/V of `source` (rows of one context, e.g. to
        time a batch without prefilling every row)."""
        self._move(source.slot, target.slot)

    # ------------------------------------------------------------- internals
    def _clear(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0
        if self.ring_size:
            self.ring_positions[slot] = EMPTY_SLOT

    def _exchange(self, a: int, b: int) -> None:
        for t in (self.full_k, self.full_v, self.ring_k, self.ring_v):
            t[:, [a, b]] = t[:, [b, a]]
        self.ring_positions[[a, b]] = self.ring_positions[[b, a]]
        self.lengths[[a, b]] = self.lengths[[b, a]]
        self.host_lengths[[a, b]] = self.host_lengths[[b, a]]

    def _move(self, src: int, dst: int) -> None:
        length = int(self.host_lengths[src])
        self.full_k[:, dst, :, :length] = self.full_k[:, src, :, :length]
        self.full_v[:, dst, :, :length] = self.full_v[:, src, :, :length]
        if self.ring_size:
            self.ring_k[:, dst] = self.ring_k[:, src]
            self.ring_v[:, dst] = self.ring_v[:, src]
            self.ring_positions[dst] = self.ring_positions[src]
        self.lengths[dst] = length
        self.host_lengths[dst] = length


class RowsView:
    """The cache as `Decoder.forward` sees it for a forward over rows [begin, end):
    positions are per row [B, T], and the masks of every layer come from here."""

    def __init__(self, cache: BatchKVCache, begin: int, end: int) -> None:
        self.cache = cache
        self.begin, self.end = begin, end
        self.config = cache.config
        self.window = cache.window
        self.ring_size = cache.ring_size

    @property
    def batch_size(self) -> int:
        return self.end - self.begin

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths[self.begin : self.end]

    @property
    def host_lengths(self) -> torch.Tensor:
        """`lengths` on the host (reading them waits for no device)."""
        return self.cache.host_lengths[self.begin : self.end]

    @property
    def length(self) -> int:
        """A single row's committed length (what a drafter's view reads)."""
        if self.batch_size != 1:
            raise ValueError("length is per row: read `lengths` for a view of several rows")
        return int(self.host_lengths[0])

    @property
    def pending(self) -> int:
        return getattr(self, "_pending", 0)

    def next_positions(self, T: int) -> torch.Tensor:
        """[B, T] positions of T consecutive tokens after each row's prefix."""
        return self.lengths.unsqueeze(1) + torch.arange(T, device=self.cache.device)

    # ---------------------------------------------------------------- forward
    def begin_forward(self, positions: torch.Tensor) -> None:
        if positions.dim() != 2 or positions.shape[0] != self.batch_size:
            raise ValueError(f"positions must be [{self.batch_size}, T] (one row per sequence), got {tuple(positions.shape)}")
        T = positions.shape[1]
        if self.cache.pending_view is not None:
            raise RuntimeError("the previous forward's tokens were neither committed nor dropped")
        if T > self.cache.max_forward_tokens:
            raise ValueError(f"a forward of {T} tokens per row exceeds max_forward_tokens={self.cache.max_forward_tokens}")
        longest = int(self.host_lengths.max())
        if longest + T > self.cache.row_capacity:
            raise ValueError(f"a row is full: {longest} committed + {T} new tokens > row capacity {self.cache.row_capacity}")
        self._pending = T
        self.cache.pending_view = self
        device = self.cache.device
        self._batch_index = torch.arange(self.begin, self.end, device=device).unsqueeze(1)  # [B, 1]
        self.pending_slots = self.lengths.unsqueeze(1) + torch.arange(T, device=device)  # [B, T] full-layer slots
        if self.ring_size:
            self.pending_ring_slots = self.pending_slots % self.ring_size
            self.cache.ring_positions[self._batch_index, self.pending_ring_slots] = positions

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's K/V [B, Hkv, T, D] of one layer at each row's slots."""
        c = self.cache
        j = c.group_index[layer]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, Hkv, D], the indexed layout
        if self.config.layer_is_sliding[layer]:
            c.ring_k[j][self._batch_index, :, self.pending_ring_slots] = k
            c.ring_v[j][self._batch_index, :, self.pending_ring_slots] = v
        else:
            c.full_k[j][self._batch_index, :, self.pending_slots] = k
            c.full_v[j][self._batch_index, :, self.pending_slots] = v

    def prefix(self, layer: int, include_pending: bool = False):
        """Full layer: slots 0..max(length)(+T) of every row (rows mask their own
        ends); sliding layer: the rings."""
        c = self.cache
        j = c.group_index[layer]
        rows = slice(self.begin, self.end)
        if self.config.layer_is_sliding[layer]:
            return c.ring_k[j, rows], c.ring_v[j, rows]
        end = int(self.host_lengths.max()) + (self.pending if include_pending else 0)
        return c.full_k[j, rows, :, :end], c.full_v[j, rows, :, :end]

    def as_sequence(self) -> "OneRowPlan":
        """A one-row view as the forward's planning sees a single sequence's cache."""
        if self.batch_size != 1:
            raise ValueError(f"only a one-row view plans as a single sequence, this one has {self.batch_size} rows")
        return OneRowPlan(self)

    @property
    def ring_positions(self) -> torch.Tensor:
        """[B, R] the position each ring slot of these rows holds (EMPTY_SLOT: none)."""
        return self.cache.ring_positions[self.begin : self.end]

    def full_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, S] visibility of full-layer slots 0..S-1 (S = longest row + T):
        a row's committed prefix, then its own pending tokens under its tree mask."""
        T = self.pending
        S = int(self.host_lengths.max()) + T
        visible = torch.arange(S, device=self.cache.device).view(1, 1, S) < self.lengths.view(-1, 1, 1)
        visible = visible.expand(-1, T, -1).clone()
        visible.scatter_(2, self.pending_slots.unsqueeze(1).expand(-1, T, -1), tree_mask)
        return visible

    def ring_mask(self, positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, R] visibility of each row's ring: committed keys within the window,
        and the row's pending tokens under its tree mask and the window."""
        T = self.pending
        slot_pos = self.cache.ring_positions[self.begin : self.end]  # [B, R]
        committed = slot_pos < self.lengths.unsqueeze(1)
        in_window = slot_pos.unsqueeze(1) > (positions.unsqueeze(2) - self.window)
        visible = committed.unsqueeze(1) & in_window
        distance = positions.unsqueeze(2) - positions.unsqueeze(1)  # [B, T, T]
        visible.scatter_(2, self.pending_ring_slots.unsqueeze(1).expand(-1, T, -1), tree_mask & (distance < self.window))
        return visible

    # ----------------------------------------------------------------- commit
    def commit(self, kept: Sequence[torch.Tensor] | None = None) -> None:
        """Keep, per row, pending tokens ``kept[b]`` (indices into this forward's T
        tokens, in sequence order) as that row's next positions; drop the rest.
        ``None`` keeps every pending token of every row."""
        c = self.cache
        T, B = self.pending, self.batch_size
        if c.pending_view is not self:
            raise RuntimeError("this view has no pending forward to commit")
        device = c.device
        lengths = self.host_lengths.tolist()
        moves = []  # rows whose kept tokens move (not the first ones, in order)
        if kept is None:
            counts = [T] * B
        else:
            if len(kept) != B:
                raise ValueError(f"commit needs one kept-index tensor per row ({B}), got {len(kept)}")
            # Paths are host bookkeeping: check and index them there as lists (a tensor
            # operation per check costs more than the check), move the indexes once.
            kept = [[int(i) for i in k.reshape(-1).tolist()] for k in kept]
            for b, k in enumerate(kept):
                if len(k) > T or (k and (max(k) >= T or min(k) < 0)):
                    raise ValueError(f"row {b}: kept indices {k} out of range for {T} pending tokens")
            counts = [len(k) for k in kept]
            moves = [(b, k) for b, k in enumerate(kept) if k != list(range(len(k)))]
            if moves:
                def indexes(values: list[int]) -> torch.Tensor:
                    return torch.tensor(values, dtype=torch.long, device=HOST).to(device)

                rows = indexes([self.begin + b for b, k in moves for _ in k])
                src = indexes([lengths[b] + i for b, k in moves for i in k])
                dst = indexes([lengths[b] + i for b, k in moves for i in range(len(k))])
                if c.full_k.shape[0]:
                    c.full_k[:, rows, :, dst] = c.full_k[:, rows, :, src]
                    c.full_v[:, rows, :, dst] = c.full_v[:, rows, :, src]
                if c.ring_size:
                    rsrc, rdst = src % c.ring_size, dst % c.ring_size
                    c.ring_k[:, rows, :, rdst] = c.ring_k[:, rows, :, rsrc]
                    c.ring_v[:, rows, :, rdst] = c.ring_v[:, rows, :, rsrc]
        if c.ring_size and T and (moves or min(counts) < T):
            # Row b's kept token i now sits in its pending slot i, (length + i) % ring; the
            # rest are freed. Labels built on the host, written in one operation; rows that
            # keep every token in place (AR's rounds) already have theirs (`KVCache.commit`).
            labels = self.host_lengths.unsqueeze(1) + torch.arange(T, device=HOST)
            labels[torch.arange(T, device=HOST) >= torch.tensor(counts, device=HOST).unsqueeze(1)] = EMPTY_SLOT
            c.ring_positions[self._batch_index, self.pending_ring_slots] = labels.to(device)
        new_lengths = torch.tensor([length + count for length, count in zip(lengths, counts)], dtype=torch.long,
                                   device=HOST)
        c.host_lengths[self.begin : self.end] = new_lengths
        c.lengths[self.begin : self.end] = new_lengths.to(device)
        self._pending = 0
        c.pending_view = None

    def drop_pending(self) -> None:
        self.commit([torch.empty(0, dtype=torch.long, device=HOST)] * self.batch_size)


class OneRowPlan:
    """What `Decoder` plans a single sequence's forward from (`KVCache`'s length, ring
    positions, pending ring slots and ring mask), read from a one-row `RowsView` during
    its forward. A row's prefill, or a row decoding alone, then makes exactly the calls
    a single run makes, so its cache gets a single run's bits."""

    def __init__(self, view: RowsView) -> None:
        self.length = view.length
        self.window = view.window
        self.ring_positions = view.ring_positions[0] if view.ring_size else None
        self.pending_ring_slots = view.pending_ring_slots[0] if view.ring_size else None

    def ring_prefix_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        return ring_prefix_mask(self.ring_positions, self.length, query_positions, self.window)
