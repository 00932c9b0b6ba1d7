"""Layer weights kept in a GGUF file's quantization (Q8_0, Q5_0, Q4_K, Q6_K) and their
product, the native `gguf_linear` (`kernels/gguf_linear.cpp`).

The product quantizes each row of x on its own (int8 codes, one scale per 32 values) and
sums each output in one fixed order, so a row's result does not depend on the rows beside
it: a token verified in a tree gets the bits of the token decoded alone, as speculation's
exactness needs (docs/design.md#quantized-targets). The quantized model is then the target:
its outputs are plain decoding's of these products, not of a bf16 model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longspec.runtime.native import native_ops

# GGML type id -> (name, values per block, bytes per block)
FORMATS = {6: ("Q5_0", 32, 22), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}


def format_name(kind: int) -> str:
    if kind in FORMATS:
        return FORMATS[kind][0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(kind).name
    except (ImportError, ValueError):
        return f"GGML type {kind}"


@dataclass(frozen=True)
class Segment:
    """Rows of one format: the file's bytes repacked for the kernel (`gguf_repack`)."""

    name: str  # the GGUF tensor these rows come from
    kind: int
    rows: int
    packed: torch.Tensor  # uint8 [ceil(rows / 16), record bytes]


@dataclass(frozen=True)
class QuantizedWeight:
    """An [out, in] weight as segments of rows stacked in order (a fused q/k/v may mix formats)."""

    segments: tuple[Segment, ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.packed.numel() for s in self.segments)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = native_ops().gguf_linear(flat, [s.packed for s in self.segments], [s.kind for s in self.segments],
                                       [s.rows for s in self.segments], bias)
        return out.view(*x.shape[:-1], self.out_features)


def quantized_available() -> bool:
    """Whether this process can run quantized products (the native library built)."""
    return native_ops() is not None


def check_rows(name: str, kind: int, raw: np.ndarray | torch.Tensor, rows: int, in_features: int) -> None:
    """Refuse a tensor the kernel cannot read, naming it and the fix, before any work."""
    if kind not in FORMATS:
        supported = ", ".join(f[0] for f in FORMATS.values())
        raise ValueError(f"tensor {name!r} is {format_name(kind)}, which longspec's quantized path does not run "
                         f"(it runs {supported}, F16, BF16 and F32); load with dtype='bfloat16' to dequantize it")
    fmt, values, block_bytes = FORMATS[kind]
    if in_features % values:
        raise ValueError(f"tensor {name!r}: {fmt} rows hold multiples of {values} values, but the model's metadata "
                         f"gives rows of {in_features}; the file is inconsistent, convert it again")
    expected = (rows, in_features // values * block_bytes)
    if tuple(raw.shape) != expected:
        raise ValueError(f"tensor {name!r}: {fmt} data of shape {tuple(raw.shape)} bytes where the model's metadata "
                         f"needs {rows} rows x {in_features} values ({expected[1]} bytes a row); the file is truncated "
                         "or its shapes disagree with its metadata, convert it again")


def segment(name: str, kind: int, raw: np.ndarray | torch.Tensor, rows: int, in_features: int) -> Segment:
    """The file's [rows, row bytes] uint8 data of one tensor, checked and repacked."""
    check_rows(name, kind, raw, rows, in_features)
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw.contiguous()
    return Segment(name, kind, rows, native_ops().gguf_repack(data, kind, in_features))


def stacked(parts: list[Segment], in_features: int) -> QuantizedWeight:
    """Segments whose rows are stacked (q, k, v; gate, up); neighbours of one format are
    merged so the product runs them as one."""
    merged: list[Segment] = []
    for part in parts:
        last = merged[-1] if merged else None
        if last is not None and last.kind == part.kind and last.rows % 16 == 0:
            merged[-1] = Segment(f"{last.name}+{part.name}", last.kind, last.rows + part.rows,
                                 torch.cat([last.packed, part.packed]))
        else:
            merged.append(part)
    return QuantizedWeight(tuple(merged), in_features)
