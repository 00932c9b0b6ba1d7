"""A forward-cost curve to decide with before this machine's is measured.

Measuring the cost of k-token forwards takes tens of seconds on a small CPU; done
before the first token it was most of a first run's wait, and done on a server's
generation thread it stalled every stream. Until the measurement exists (`longspec
doctor` makes it, a quiet process makes it in the background: `cost_model`), `auto`
and the batched engine price trees with this curve instead:

- the level: one decode forward reads every layer weight and the head once (the
  certified head's int8 copy where there is one), at `_BANDWIDTH` bytes a second. It
  only sets where `auto`'s own correction (`RealisedCostScale`, the realised / priced
  time of its rounds) starts: a few rounds bring it to the machine's.
- the shape: 1 + slope (k - 1) decode forwards for k tokens, with a slope per kind of
  CPU, steeper with the context (each tree token attends to it all), at or above every
  curve recorded on that kind (benchmarks/results; tests/test_instant_start.py). Pricing
  trees too dear only makes `auto` speculate less, towards plain decoding; too cheap
  would make it verify nodes that do not pay, which can fall below plain decoding. The
  correction scales the level, never the shape, so the shape must err dear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longspec.runtime.linear import cpu_flags
from longspec.runtime.native import bf16_linear_ops

# Extra decode forwards per extra token at a short context, by CPU kind, times
# (1 + context / CONTEXT_SCALE). AVX-512 BF16: the 2-core EPYC's recorded curves reach 0.134
# per token at 1-4k and 0.233 at 16k; AMX computes trees faster still. AVX2 runs the bf16
# product through float32 FMAs: 0.41 per token at 2k in one run, where 7 tokens fill a
# second register tile (docs/lab-notes/forward-cost.md). Without the native kernels a
# tree's tokens are priced as separate forwards: speculation never looks cheaper than it is.
SLOPES = {"amx": 0.135, "avx512-bf16": 0.135, "avx2": 0.45, "plain": 1.0}
CONTEXT_SCALE = 16384
_BANDWIDTH = 25e9  # bytes a second a decode forward streams its weights at (a 2-core server's order)


def cpu_kind(model=None) -> str:
    """The kind of CPU the bf16 products run on: "amx", "avx512-bf16", "avx2", or
    "plain" (no native kernel: other dtypes or devices, or none built)."""
    if model is not None and (model.device.type != "cpu" or model.dtype != torch.bfloat16 or not model.native_kernels):
        return "plain"
    if bf16_linear_ops() is None:
        return "plain"
    flags = cpu_flags()
    if {"amx_bf16", "amx_tile"} <= flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    return "avx2"


def decode_bytes(model) -> int:
    """Bytes one decode forward reads: every layer weight (a GGUF file's quantized products
    at their own size) and the head (its int8 copy where the certified head decides, the
    file's rows for a quantized target)."""
    layers = 0
    for layer in model.layers:
        for name, p in layer.named_parameters():
            packed = layer.packed.get(name)
            quantized = packed.quantized if packed is not None else None
            layers += quantized.nbytes if quantized is not None else p.numel() * p.element_size()
    head = model._certified_head
    packed_head = model.packed_head
    if head not in (None, False):
        head_bytes = head.nbytes
    elif packed_head is not None and packed_head.quantized is not None:
        head_bytes = packed_head.quantized.nbytes
    else:
        head_bytes = model.head_weight.numel() * model.head_weight.element_size()
    return layers + head_bytes


def slope(kind: str, context: int) -> float:
    """Decode forwards one more token adds, on this kind of CPU over `context` committed tokens."""
    return 1.0 if kind == "plain" else SLOPES[kind] * (1 + context / CONTEXT_SCALE)


def default_seconds(model, ks: Sequence[int], context: int, rows: int = 1) -> tuple[float, ...]:
    """Seconds of a forward of k tokens per row for each k, over `rows` rows of `context` tokens."""
    base = max(decode_bytes(model) / _BANDWIDTH, 1e-6)
    per_token = slope(cpu_kind(model), context)
    return tuple(base * (1 + per_token * (rows * k - 1)) for k in ks)
