"""TokenSwift's dynamic partial KV cache for the drafting forward.

The drafter runs the target itself over a cache of its own whose full-attention
layers hold at most ``budget`` tokens: ``sinks`` initial tokens plus the others
that matter most, importance being the query·key dot product of the latest query
(summed over the query heads of each group, then over groups: Σ_h q_h·k_g(h) =
(Σ_{h∈g} q_h)·k_g, so K is never replicated for grouped-query attention). Sliding
layers keep a ring exactly as `KVCache` does (already bounded by the window).

Newly drafted-over tokens fill free slots, then replace the least important
selected tokens one by one (ascending importance); when the replacements reach
the sinks (no unreplaced selected token is left), every preceding token is
re-scored against the full K/V (the verifier's cache, read through a ``source``)
and the selection is rebuilt. The verifier always keeps its full cache, so the
partial cache changes only how good the drafts are, never what is generated.

Memory: ``budget + max_forward_tokens`` slots per full layer, a ring of
``window + max_forward_tokens`` per sliding layer — independent of the context.

It exposes what `Decoder.forward` uses of a `KVCache` (begin_forward, store,
prefix, ring_prefix_mask, pending_ring_slots, length, pending, commit,
drop_pending); the only extension is ``commit(source)``, the K/V to rebuild from
when a rebuild is due.
The queries for scoring are captured with ``recording_queries(model, cache)``,
which wraps the model's attention backend for one drafting forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from longspec.runtime.cache import EMPTY_SLOT, KVTensors
from longspec.runtime.config import DecoderConfig

# layer index -> that full-attention layer's K/V [B, Hkv, N, D] of positions 0..N-1
KVSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def grouped_importance(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Importance [N] of N keys [B, Hkv, N, D] for one query per head [B, Hq, D]:
    Σ_batch Σ_heads q_h · k_{g(h)}, computed by summing each group's queries first."""
    B, Hq, D = query.shape
    Hkv = keys.shape[1]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} key/value heads")
    compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
    group_query = query.reshape(B, Hkv, Hq // Hkv, D).to(compute).sum(dim=2)  # [B, Hkv, D]
    return torch.einsum("bhd,bhnd->n", group_query, keys.to(compute))


@dataclass(frozen=True)
class PartialBudget:
    """How large a partial cache is for a prompt: `budget` full-attention slots when
    given, else `budget_fraction` of the prompt and at least `min_budget`; `sinks`
    initial tokens always kept (shrunk so one drafting forward still fits beside them)."""

    budget: int | None = None
    budget_fraction: float = 0.25
    min_budget: int = 256
    sinks: int = 64

    def __post_init__(self) -> None:
        for name, value, minimum in (("budget", self.budget, 1), ("min_budget", self.min_budget, 1), ("sinks", self.sinks, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must lie in (0, 1], got {self.budget_fraction}")

    def for_prompt(self, prompt_length: int, forward_chunk: int) -> tuple[int, int]:
        """(budget, sinks) of the cache for a prompt of this many tokens."""
        budget = self.budget or max(self.min_budget, int(prompt_length * self.budget_fraction))
        sinks = min(self.sinks, max(budget - forward_chunk, 0))
        return max(budget, sinks + forward_chunk), sinks


class PartialKVCache(KVTensors):
    def __init__(
        self,
        config: DecoderConfig,
        budget: int,
        sinks: int,
        *,
        max_forward_tokens: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if sinks < 0 or max_forward_tokens < 1:
            raise ValueError(f"need sinks >= 0 and max_forward_tokens >= 1, got {sinks}, {max_forward_tokens}")
        if budget < sinks + max_forward_tokens:
            raise ValueError(
                f"partial cache budget {budget} is smaller than sinks ({sinks}) + tokens per drafting forward "
                f"({max_forward_tokens}); raise the budget or lower the sinks"
            )
        slots = budget + max_forward_tokens
        ring_size = (config.sliding_window or 0) + max_forward_tokens if any(config.layer_is_sliding) else 0
        super().__init__(config, rows=batch_size, slots=slots, ring_size=ring_size,
                         max_forward_tokens=max_forward_tokens, dtype=dtype, device=device)
        device = self.device
        self.budget = budget
        self.sinks = sinks
        self.full_layers = self.groups.full
        self.slot_positions = torch.full((len(self.full_layers), slots), -1, dtype=torch.long, device=device)
        self.used = 0  # filled slots of every full layer
        self.victims = torch.empty((len(self.full_layers), 0), dtype=torch.long, device=device)  # ascending importance
        self.next_victim = 0
        self.rebuilds = 0
        self.length = 0  # sequence positions forwarded and committed
        self.pending = 0
        self.pending_ring_slots = torch.empty(0, dtype=torch.long, device=device)
        self._pending_positions = torch.empty(0, dtype=torch.long, device=device)
        # Query of the last forwarded token per full layer [B, Hq, D] (None: not seen yet).
        self.last_queries: list[torch.Tensor | None] = [None] * len(self.full_layers)
        self._storing: int | None = None  # full-layer group index of the layer being run

    # ---------------------------------------------------------------- forward side
    def next_positions(self, T: int) -> torch.Tensor:
        return self.length + torch.arange(T, device=self.device)

    def begin_forward(self, positions: torch.Tensor) -> None:
        T = positions.numel()
        if self.pending:
            raise RuntimeError("the previous forward's tokens were not committed")
        if T > self.max_forward_tokens:
            raise ValueError(f"a forward of {T} tokens exceeds max_forward_tokens={self.max_forward_tokens}")
        self.pending = T
        self._pending_positions = positions.to(torch.long)
        if self.ring_size:
            slots = (self.length + torch.arange(T, device=self.device)) % self.ring_size
            self.pending_ring_slots = slots
            self.ring_positions[slots] = positions

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        j = self.group_index[layer]
        if self.config.layer_is_sliding[layer]:
            self._storing = None
            self.ring_k[j].index_copy_(2, self.pending_ring_slots, k)
            self.ring_v[j].index_copy_(2, self.pending_ring_slots, v)
        else:
            self._storing = j
            end = self.used + self.pending
            self.full_k[j, :, :, self.used : end] = k
            self.full_v[j, :, :, self.used : end] = v

    def prefix(self, layer: int, include_pending: bool = False):
        j = self.group_index[layer]
        if self.config.layer_is_sliding[layer]:
            return self.ring_k[j], self.ring_v[j]
        end = self.used + (self.pending if include_pending else 0)
        return self.full_k[j, :, :, :end], self.full_v[j, :, :, :end]

    def ring_prefix_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        slot_pos = self.ring_positions
        committed = slot_pos < self.length
        in_window = slot_pos.unsqueeze(0) > (query_positions.unsqueeze(1) - self.window)
        return committed.unsqueeze(0) & in_window

    def record_query(self, query: torch.Tensor) -> None:
        """Called by the attention wrapper: the query of the layer just stored."""
        if self._storing is not None:
            self.last_queries[self._storing] = query[:, :, -1].detach().clone()

    # ----------------------------------------------------------------- commit side
    def start_at(self, length: int) -> None:
        """Begin a sequence whose first ``length`` positions will come from a source
        (``rebuild``) rather than from drafting forwards."""
        self.length = length
        self.used = 0
        self.pending = 0
        self.ring_positions.fill_(EMPTY_SLOT)
        self.victims = self.victims[:, :0]
        self.next_victim = 0

    def commit(self, source: KVSource | None = None) -> None:
        """Keep every pending token. Beyond the budget they replace the least
        important selected tokens; when none is left, rebuild from ``source``
        (full K/V of at least the positions before this forward)."""
        T, before = self.pending, self.length
        self.slot_positions[:, self.used : self.used + T] = self._pending_positions
        self.length += T
        self.pending = 0
        total = self.used + T
        if total <= self.budget:
            self.used = total
            return
        overflow = total - self.budget
        if self.next_victim + overflow <= self.victims.shape[1]:
            src = torch.arange(self.budget, total, device=self.device)
            for j in range(len(self.full_layers)):
                dst = self.victims[j, self.next_victim : self.next_victim + overflow]
                self.full_k[j][:, :, dst] = self.full_k[j][:, :, src]
                self.full_v[j][:, :, dst] = self.full_v[j][:, :, src]
                self.slot_positions[j, dst] = self.slot_positions[j, src]
            self.next_victim += overflow
            self.used = self.budget
            return
        self.used = total
        if source is None:
            raise ValueError("the partial cache must be rebuilt but no K/V source was given")
        self.rebuild(source, before)

    def warm_up(self, source: KVSource, tokens: torch.Tensor, run: Callable[[torch.Tensor], None]) -> None:
        """Start a sequence of committed `tokens` whose full K/V `source` holds: select by
        recency from the source, `run` the last window's tokens through the drafter's
        forward (filling the sliding layers' rings, and recording queries where the
        drafter does), then select again (by importance once a query is recorded)."""
        window = self.window if self.ring_size else 1
        start = max(0, tokens.numel() - window)
        self.start_at(start)
        self.rebuild(source, start)
        run(tokens[start:])
        self.rebuild(source, tokens.numel() - 1)

    def drop_pending(self) -> None:
        """Forget the last forward's tokens (a drafted chain), keeping everything
        committed: their full-layer slots lie beyond `used`, and the ring slots they
        took held positions older than any later query's window (the ring has
        `max_forward_tokens` slots of headroom)."""
        if self.ring_size and self.pending:
            self.ring_positions[self.pending_ring_slots] = EMPTY_SLOT
        self.pending = 0

    def rebuild(self, source: KVSource, source_length: int) -> None:
        """Re-select every full layer's tokens: keep those at positions >=
        ``source_length`` (already in the slots, not in the source), then the sinks
        and the most important positions < ``source_length`` up to the budget.
        Before any query was recorded, recency stands in for importance."""
        if self.pending:
            raise RuntimeError("commit the pending tokens before rebuilding")
        self.rebuilds += 1
        filled = 0
        for j, layer in enumerate(self.full_layers):
            keys, values = source(layer)
            if keys.shape[2] < source_length:
                raise ValueError(f"source holds {keys.shape[2]} positions, fewer than {source_length}")
            keys, values = keys[:, :, :source_length], values[:, :, :source_length]
            keep = torch.nonzero(self.slot_positions[j, : self.used] >= source_length).flatten()
            keep_k, keep_v = self.full_k[j][:, :, keep].clone(), self.full_v[j][:, :, keep].clone()
            keep_positions = self.slot_positions[j, keep].clone()
            room = self.budget - keep.numel()
            sink_count = min(self.sinks, source_length, room)
            query = self.last_queries[j]
            if query is None:
                scores = torch.arange(source_length, dtype=torch.float64, device=self.device)
            else:
                scores = grouped_importance(query, keys)
            top_count = min(room - sink_count, source_length - sink_count)
            top = sink_count + torch.topk(scores[sink_count:], top_count).indices
            top_positions = top.sort().values
            chosen = torch.cat([torch.arange(sink_count, device=self.device), top_positions])
            selected = chosen.numel()
            self.full_k[j][:, :, :selected] = keys[:, :, chosen]
            self.full_v[j][:, :, :selected] = values[:, :, chosen]
            self.full_k[j][:, :, selected : selected + keep.numel()] = keep_k
            self.full_v[j][:, :, selected : selected + keep.numel()] = keep_v
            self.slot_positions[j, :selected] = chosen
            self.slot_positions[j, selected : selected + keep.numel()] = keep_positions
            victims = sink_count + torch.argsort(scores[top_positions], stable=True)
            if j == 0:
                self.victims = torch.empty((len(self.full_layers), victims.numel()), dtype=torch.long, device=self.device)
            self.victims[j] = victims
            filled = selected + keep.numel()  # the same for every layer
        self.used = filled
        self.next_victim = 0

    def selected_positions(self, layer: int) -> torch.Tensor:
        """Positions held by a full layer's slots (sorted), for inspection and tests."""
        j = self.group_index[layer]
        return self.slot_positions[j, : self.used].sort().values

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_k, self.full_v, self.ring_k, self.ring_v))


@contextmanager
def recording_queries(model, cache: PartialKVCache) -> Iterator[None]:
    """Run forwards of ``model`` over ``cache`` with the attention backend wrapped so
    the cache sees each full-attention layer's queries (for importance scores)."""
    backend = model.attention

    def attend(q, *rest):
        cache.record_query(q)
        return backend(q, *rest)

    model.attention = attend
    try:
        yield
    finally:
        model.attention = backend
