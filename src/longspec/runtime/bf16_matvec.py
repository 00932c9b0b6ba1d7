"""The native bf16 few-row matrix product (`kernels/bf16_matvec.cpp`).

A decode step is a 1-row product with every weight matrix, bound by how fast the
weights stream from memory; the kernel streams them at about twice oneDNN's rate on
CPUs with AVX-512 BF16 (BENCHMARKS.md, "Decode at the bandwidth floor"). Where it is
unavailable (`native.avx512_bf16_ops`) callers keep oneDNN / `F.linear`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from longspec.runtime.native import avx512_bf16_ops


@dataclass(frozen=True)
class Bf16Matvec:
    """y = x @ weight.T (+ bias) for 1..max_rows rows of bf16 x on the CPU."""

    max_rows: int

    def accepts(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        return 1 <= rows <= self.max_rows and x.dtype == torch.bfloat16 and x.device.type == "cpu"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = avx512_bf16_ops().bf16_linear(flat, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def bf16_matvec() -> Bf16Matvec | None:
    """The kernel, or None (with the reason logged once) where it is unavailable."""
    ops = avx512_bf16_ops()
    return None if ops is None else Bf16Matvec(max_rows=int(ops.bf16_linear_max_rows()))
