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
from collections.abc import Callable
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


def prepack(weight: torch.Tensor, *, native_kernels: bool = True, bulk: bool | None = False,
            tiles: torch.Tensor | None = None) -> PackedWeight | None:
    """The prepared forms of a [out, in] bf16 CPU weight, or None where none applies.
    bulk: also keep oneDNN's copy for prefill's products (None: where `bulk_products_pay`;
    the decoder's layers ask, the heads, which prefill does not compute, do not).
    tiles: the native kernel's packed copy, already made (`pack_tiles`)."""
    if not takes_tiles(weight, native_kernels):
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None
        onednn = _onednn_prepack(weight)
        return None if onednn is None else PackedWeight(onednn=onednn)
    wanted = bulk_products_pay() if bulk is None else bulk
    return PackedWeight(onednn=None, tiles=pack_tiles([weight])[0] if tiles is None else tiles,
                        bulk=_onednn_prepack(weight) if wanted else None)


def takes_tiles(weight: torch.Tensor, native_kernels: bool = True) -> bool:
    """Whether `prepack` gives this weight the native kernel's packed copy."""
    return (native_kernels and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and bf16_linear_ops() is not None)


_COLUMNS = 16  # output rows per block of the packed layout (`kColumns` in bf16_packed_linear.cpp)


def tiles_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    """The packed copy's shape: [blocks of 16 rows, pairs of columns, 16, 2]."""
    N, K = weight.shape
    return (-(-N // _COLUMNS), -(-K // 2), _COLUMNS, 2)


def tiles_nbytes(weight: torch.Tensor) -> int:
    blocks, pairs, columns, two = tiles_shape(weight)
    return blocks * pairs * columns * two * 2


def pack_tiles(weights: list[torch.Tensor], outs: list[torch.Tensor | None] | None = None,
               before_copy: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """`bf16_pack_weight` of each weight, written into `outs` (byte buffers of at least
    `tiles_nbytes`, e.g. on huge pages) where given. Without padding (rows a multiple of 16,
    an even number of columns) the packed copy is a permutation of the weight's 4-byte column
    pairs: all of those are made by one strided copy (one call that releases the GIL and
    runs on every thread, as fast as a plain copy), checked once per process against the
    kernel's own packing; the others by the kernel. `before_copy()` is called right before
    that call (a load starts its tokenizer's GIL-holding parse there, so the two overlap)."""
    ops = bf16_linear_ops()
    outs = outs or [None] * len(weights)
    tiles, targets, sources = [], [], []
    for weight, out in zip(weights, outs):
        shape = tiles_shape(weight)
        packed = (torch.empty(shape, dtype=torch.bfloat16) if out is None else
                  out[: tiles_nbytes(weight)].view(torch.bfloat16).view(shape))
        N, K = weight.shape
        if N % _COLUMNS == 0 and K % 2 == 0 and N * K > 0 and weight.data_ptr() % 4 == 0 and _pairs_layout():
            blocks, pairs = shape[0], shape[1]
            targets.append(packed.view(torch.int32).view(blocks, pairs, _COLUMNS))
            sources.append(weight.detach().view(torch.int32).view(blocks, _COLUMNS, pairs).transpose(1, 2))
        else:
            packed.copy_(ops.bf16_pack_weight(weight.detach()))
        tiles.append(packed)
    if before_copy is not None:
        before_copy()
    if targets:
        torch._foreach_copy_(targets, sources)
    return tiles


@functools.cache
def _pairs_layout() -> bool:
    """Whether the kernel's packed layout is the permutation `pack_tiles` copies (probed
    on a small weight, so a change of the kernel's layout falls back to the kernel)."""
    weight = torch.arange(48 * 10, dtype=torch.int16).view(torch.bfloat16).view(48, 10)  # every value's bits distinct
    blocks, pairs = 48 // _COLUMNS, 10 // 2
    permuted = weight.view(torch.int32).view(blocks, _COLUMNS, pairs).transpose(1, 2).contiguous()
    return torch.equal(bf16_linear_ops().bf16_pack_weight(weight).view(torch.int32).reshape(-1), permuted.reshape(-1))
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
