"""Linear layers for inference: the weight prepared once per load for the products a
forward asks of it.

- On CPUs with AVX-512 BF16: the native kernel over a copy of the weight packed for its
  dot products (`kernels/bf16_packed_linear.cpp`), for any number of rows. One row (a
  decode step) streams the weight at the core's read bandwidth, faster than oneDNN; a
  few rows (a batch of decode steps, a verified chain) run faster than oneDNN's blocked
  product, hundreds (prefill) level with it
  (docs/lab-notes/native-kernels.md#a-tiled-bf16-product-over-packed-weights-replaces-onednn-issue-batching-runtime-speed).
- On CPUs with AMX: the same packed copy through the bf16 tile instructions, level with
  the vector path at one row and several times faster at a verified tree's rows (4-64)
  (docs/lab-notes/native-kernels.md#amx-bf16-tiles-for-every-product). `LONGSPEC_AMX=0` keeps
  the AVX-512 path.
- On CPUs with AVX2 and FMA but not AVX-512 BF16: the same kernel and packed copy through
  float32 FMAs. There oneDNN's bf16 product has no native instructions: a 4-16 row
  product costs several times a one-row one, which every verified tree pays
  (docs/lab-notes/native-kernels.md#avx2-cpus-the-native-bf16-product-through-float32-fmas-issues-adaptive-speculation-every-drafter).
- Elsewhere: oneDNN with the weight prepacked into its blocked layout, faster than
  PyTorch's default bf16 product
  (docs/lab-notes/native-kernels.md#decode-at-the-bandwidth-floor-native-cpu-kernels-issue-runtime-speed).
- Anything none handles (other dtypes, other devices, builds without them) keeps the
  plain `F.linear`.

Prefill (`bulk=True`, hundreds of rows a product): on CPUs with AMX, oneDNN's product runs
on the tile instructions the native kernel does not use, several times faster at
prefill's row counts; there each layer weight also keeps oneDNN's blocked copy for prefill
(where the copies fit: `Decoder.prepare`). It is used only where a probe finds each row's
result the same however many rows share the product, so a batch row prefilled in other
pieces than its single run gets the same bits
(docs/lab-notes/native-kernels.md#prefill-through-onednn-on-amx-cpus-issue-the-openai-api).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from longspec.runtime.native import bf16_linear_ops
from longspec.runtime.quantized import QuantizedWeight


@dataclass(frozen=True)
class PackedWeight:
    onednn: torch.Tensor | None  # oneDNN's blocked copy, where the native kernel cannot run
    tiles: torch.Tensor | None = None  # the native kernel's packed copy
    bulk: torch.Tensor | None = None  # oneDNN's blocked copy for prefill, beside the tiles (AMX CPUs)
    quantized: QuantizedWeight | None = None  # a GGUF file's own quantization (`runtime.quantized`), for every product


def prepack(weight: torch.Tensor, *, native_kernels: bool = True, bulk: bool | None = False) -> PackedWeight | None:
    """The prepared forms of a [out, in] bf16 CPU weight, or None where none applies.
    bulk: also keep oneDNN's copy for prefill's products (None: where `bulk_products_pay`;
    the decoder's layers ask, the heads, which prefill does not compute, do not)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    ops = bf16_linear_ops() if native_kernels and weight.is_contiguous() else None
    if ops is not None:
        wanted = bulk_products_pay() if bulk is None else bulk
        return PackedWeight(onednn=None, tiles=ops.bf16_pack_weight(weight.detach()),
                            bulk=_onednn_prepack(weight) if wanted else None)
    onednn = _onednn_prepack(weight)
    return None if onednn is None else PackedWeight(onednn=onednn)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None, bias=None,
                  bulk: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) through the prepared forms; `bulk` (a prefill's product) takes
    oneDNN's copy where the weight has one."""
    # The prepared forms have no backward: a product that needs gradients stays on F.linear.
    if packed is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    if packed.quantized is not None:
        return packed.quantized.linear(x, bias)
    if bulk and packed.bulk is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.bulk, bias, "none", [], "")
    if packed.tiles is not None:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = bf16_linear_ops().bf16_packed_linear(flat, packed.tiles, weight.shape[0], bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    if packed.onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_prepack(weight: torch.Tensor) -> torch.Tensor | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype, device=weight.device)
        packed_out = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if not torch.allclose(packed_out.float(), F.linear(probe, weight).float(), rtol=2e-2, atol=2e-2):
            return None
    except (RuntimeError, AttributeError):
        return None
    return packed


@functools.cache
def bulk_products_pay() -> bool:
    """Whether prefill's products go through oneDNN on this CPU: it has AMX (read from
    the kernel's CPU flags, so every process on a machine decides alike), and oneDNN's
    rows come out the same bits whatever number of rows shares a product (probed)."""
    if bf16_linear_ops() is None or not _cpu_flags() >= {"amx_bf16", "amx_tile"}:
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 640, generator=generator).to(torch.bfloat16)
    packed = _onednn_prepack(weight)
    if packed is None:
        return False
    x = torch.randn(300, 640, generator=generator).to(torch.bfloat16)

    def rows(part):
        return torch.ops.mkldnn._linear_pointwise(part.contiguous(), packed, None, "none", [], "")

    whole = rows(x)
    return all(torch.equal(rows(x[begin:end]), whole[begin:end])
               for begin, end in ((0, 1), (7, 12), (3, 40), (40, 73), (100, 256), (256, 300)))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (empty off Linux)."""
    return _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())
