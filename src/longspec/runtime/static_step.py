"""Decode and verify steps with static shapes, compiled once per size bucket.

The eager forward (`Decoder.forward`) cuts K/V views to the committed length and
picks an attention kernel per call: right for the CPU, but on a GPU a small target's
step is then bound by kernel launches, and a compiler (`torch.compile`, CUDA graphs)
needs shapes that do not change from one step to the next. A static step, as the
minimal GPU engines build it:

* pads the T new tokens to a bucket size (1, 4, 16, ...): a padding token sees only
  itself, no real token sees it, and the cache forgets it right after the forward;
* writes K/V at slot indices computed from the committed length (a tensor), never
  at Python slices;
* attends each layer's whole buffer (the full layers' capacity, the rings' slots)
  under one visibility mask built inside the step from the committed length, the
  tree mask and the ring's slot positions.

So between two calls of a bucket only tensor *values* change: one compiled graph per
bucket serves every length (the cache's capacity is marked dynamic, so requests of
other lengths reuse it too). On a GPU, `mode="reduce-overhead"` replays the step as a
CUDA graph. Everything here is plain PyTorch: the native CPU kernels and the Triton
tree kernel stay on the eager path. A forward the buckets do not cover (prefill
chunks, batched rows, a bucket that would overrun the cache) runs eagerly.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longspec.runtime.cache import KVCache, layer_groups

logger = logging.getLogger(__name__)

# Decode steps (1) and trees up to the engine's default budget of 64 nodes + the root.
DEFAULT_BUCKETS = (1, 4, 16, 65)


@dataclass(frozen=True)
class CompileOptions:
    """How static steps are compiled. backend=None runs them uncompiled (what the
    tests of the static formulation use); mode="reduce-overhead" uses CUDA graphs."""

    backend: object = "inductor"  # a torch.compile backend (name or callable)
    mode: str | None = None
    buckets: tuple[int, ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        if not self.buckets or any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be increasing sizes >= 1, got {self.buckets}")

    @staticmethod
    def for_device(device: torch.device, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> "CompileOptions":
        """CUDA graphs on a GPU (launch overhead is what a small target's step is
        bound by there); inductor's C++ code on the CPU."""
        return CompileOptions(mode="reduce-overhead" if device.type == "cuda" else None, buckets=buckets)


def padded_mask(tree_mask: torch.Tensor | None, tokens: int, size: int, device: torch.device) -> torch.Tensor:
    """[size, size] visibility among a step's tokens: the `tokens` real ones' tree mask
    (causal where None) and padding tokens that see only themselves."""
    if tree_mask is None:
        tree_mask = torch.ones((tokens, tokens), dtype=torch.bool, device=device).tril_()
    mask = torch.eye(size, dtype=torch.bool, device=device)
    mask[:tokens, :tokens] = tree_mask
    return mask


class StaticSteps:
    """The compiled step of one `Decoder`. One function serves every bucket: the
    compiler keeps a graph per shape it meets."""

    def __init__(self, decoder, options: CompileOptions) -> None:
        self.decoder = decoder
        self.options = options
        step = functools.partial(static_forward, decoder)
        self._step = step if options.backend is None else torch.compile(
            step, backend=options.backend, mode=options.mode, fullgraph=True, dynamic=None)
        self.failure: str | None = None  # why compiling failed: every later forward runs eagerly
        self.calls = 0  # forwards served by a static step (tests and reports read it)
        self._chain_masks: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, tokens) -> padded causal mask

    def bucket(self, tokens: int, cache) -> int | None:
        """The smallest bucket that holds `tokens` new tokens and fits the cache, or
        None when this forward must run eagerly."""
        if self.failure is not None or type(cache) is not KVCache or cache.full_k.shape[1] != 1:
            return None
        room = min(cache.capacity - cache.length, cache.max_forward_tokens)
        return next((b for b in self.options.buckets if tokens <= b <= room), None)

    def forward(self, input_ids, cache: KVCache, tree_mask, positions, size: int):
        """Logits and final hidden states [1, T, .] of T new tokens padded to `size`;
        None when the step could not be compiled (the caller runs eagerly)."""
        T = input_ids.shape[1]
        device = self.decoder.device
        pad = size - T
        if tree_mask is None:  # a chain: the same mask at every step of this shape, made once
            mask = self._chain_masks.get((size, T))
            if mask is None:
                mask = self._chain_masks[size, T] = padded_mask(None, T, size, device)
        else:
            mask = padded_mask(tree_mask, T, size, device)
        # Padding tokens repeat the last real one at the root's position: harmless
        # values, invisible to real tokens, forgotten after the step. (Copies even
        # without padding: the compiled step then always sees tensors made here.)
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(1, pad)], dim=1)
        positions = torch.cat([positions, positions[:1].expand(pad)])
        cache.begin_forward(positions)
        length = torch.tensor(cache.length, dtype=torch.long, device=device)
        buffers = (cache.full_k, cache.full_v, cache.ring_k, cache.ring_v, cache.ring_positions)
        self._mark(buffers)
        try:
            logits, hidden = self._step(input_ids, positions, mask, length, cache.pending_ring_slots, *buffers)
        except Exception as error:  # a compiler or backend that cannot build this step
            cache.drop_pending()  # its slots are past the committed length, or outside every window
            self.failure = f"{type(error).__name__}: {error}"
            logger.warning("compiled steps are off for this model (%s); decoding continues eagerly", self.failure)
            return None
        cache.shrink_pending(T)
        self.calls += 1
        # CUDA graphs reuse their output buffers at the next replay: hand out copies.
        return logits[:, :T].clone(), hidden[:, :T].clone()

    def warm_up(self, max_forward_tokens: int) -> None:
        """Compile every bucket now, on a scratch cache shaped like the engine's
        (`max_forward_tokens` sets the rings' size), so that no request pays for it."""
        if self.options.backend is None:
            return
        largest = self.options.buckets[-1]
        window = self.decoder.config.sliding_window or 0
        cache = self.decoder.new_cache(window + max_forward_tokens + largest + 1,
                                       max_forward_tokens=max(max_forward_tokens, largest))
        logger.info("compiling static steps for %s new tokens (once; PyTorch caches the result on disk)",
                    ", ".join(map(str, self.options.buckets)))
        for size in self.options.buckets:
            ids = torch.zeros((1, size), dtype=torch.long, device=self.decoder.device)
            self.decoder(ids, cache)
            cache.drop_pending()
            if self.failure is not None:
                return

    def _mark(self, buffers) -> None:
        """Tell the compiler about the cache: its capacity, and with it the rings' size
        for short requests, varies between requests (one graph serves all), and under
        CUDA graphs its buffers are updated in place at fixed addresses rather than
        copied in and out at every replay."""
        if self.options.backend is None:
            return
        full_k, full_v, ring_k, ring_v, ring_positions = buffers
        for slots in (full_k, full_v, ring_k, ring_v):
            torch._dynamo.maybe_mark_dynamic(slots, 3)
        torch._dynamo.maybe_mark_dynamic(ring_positions, 0)
        if self.options.mode == "reduce-overhead":
            for buffer in buffers:
                torch._dynamo.mark_static_address(buffer, guard=False)


def static_forward(decoder, ids, positions, mask, length, ring_slots, full_k, full_v, ring_k, ring_v, ring_positions):
    """One forward of S new tokens [1, S] (S fixed: a bucket) in PyTorch operations
    only, writing their K/V into the cache's buffers in place.

    mask [S, S]: visibility among the new tokens; length: committed tokens (0-d
    tensor); ring_slots [S]: the rings' slots of the new tokens (set by
    `KVCache.begin_forward`, which also recorded their positions in ring_positions).
    Returns logits [1, S, V] and final hidden states [1, S, H]."""
    config = decoder.config
    S = ids.shape[1]
    full_slots = length + torch.arange(S, device=ids.device)
    full_visible = None
    if full_k.shape[0]:
        # Committed slots are visible to every query; this step's slots by the mask.
        slot = torch.arange(full_k.shape[3], device=ids.device)
        offset = slot - length
        ours = (offset >= 0) & (offset < S)
        full_visible = (slot < length).unsqueeze(0) | (ours.unsqueeze(0) & mask[:, offset.clamp(0, S - 1)])
    ring_visible = None
    if ring_k.shape[0]:
        distance = positions.unsqueeze(1) - positions.unsqueeze(0)
        committed = ring_positions < length
        in_window = ring_positions.unsqueeze(0) > (positions.unsqueeze(1) - config.sliding_window)
        ring_visible = committed.unsqueeze(0) & in_window
        ring_visible = ring_visible.index_put((torch.arange(S, device=ids.device).unsqueeze(1), ring_slots.unsqueeze(0)),
                                              mask & (distance < config.sliding_window))
    rope = {s: decoder._rope(positions, s) for s in set(config.layer_is_sliding)}
    group_index = layer_groups(config).index
    x = decoder.embed(ids)
    for layer in decoder.layers:
        j = group_index[layer.index]
        if layer.sliding:
            buffers = ring_k[j], ring_v[j], ring_slots, ring_visible
        else:
            buffers = full_k[j], full_v[j], full_slots, full_visible
        x = _layer(layer, x, rope[layer.sliding], *buffers)
    hidden = decoder.final_norm.plain(x)
    if decoder.file_head is not None:  # a quantized GGUF target's logits: the kernel's product of its file rows
        return decoder.logits(hidden), hidden
    logits = F.linear(hidden, decoder.head_weight)
    cap = config.final_logit_softcapping
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits, hidden


def _layer(layer, x, rope, keys, values, slots, visible):
    """`DecoderLayer.forward` over whole buffers: this step's K/V are written at
    `slots` of keys/values [1, Hkv, slots, D], then every query attends the buffer
    under `visible` [S, slots]."""
    c = layer.config
    q, k, v = layer.project(x, rope, plain=True)
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v)
    # Each K/V head's query heads stacked along the query axis, as the eager path
    # does: with `enable_gqa` and a mask, SDPA may take its math path, which copies
    # K/V once per query head (the whole cache, every layer, every step).
    B, Hq, S, D = q.shape
    group = Hq // keys.shape[1]
    stacked = q.reshape(B, keys.shape[1], group * S, D)
    attn = F.scaled_dot_product_attention(stacked, keys, values, attn_mask=visible.repeat(group, 1),
                                          scale=c.attention_scale).reshape(B, Hq, S, D)
    return layer.finish(x, attn, plain=True)
