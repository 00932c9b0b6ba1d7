"""The native bf16 few-row matrix product (`kernels/bf16_matvec.cpp`): built once per
machine on first use, then loaded from PyTorch's extension cache.

A decode step is a 1-row product with every weight matrix, bound by how fast the
weights stream from memory; the kernel streams them at about twice oneDNN's rate on
CPUs with AVX-512 BF16 (BENCHMARKS.md, "Decode at the bandwidth floor"). Where it
cannot be had (no C++ compiler or ninja, a CPU without AVX-512 BF16, a build error,
or LONGSPEC_NATIVE_KERNELS=0) the caller keeps oneDNN / `F.linear`, and the reason is
logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "bf16_matvec.cpp"
LIBRARY = "longspec_bf16_matvec"
DISABLE_VARIABLE = "LONGSPEC_NATIVE_KERNELS"


@dataclass(frozen=True)
class Bf16Matvec:
    """y = x @ weight.T (+ bias) for 1..max_rows rows of bf16 x on the CPU."""

    max_rows: int

    def accepts(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        return (
            1 <= rows <= self.max_rows
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and not x.requires_grad
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.longspec_bf16_matvec.linear(flat, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def bf16_matvec() -> Bf16Matvec | None:
    """The kernel, or None (with the reason logged once) where it is unavailable."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        log.info("native bf16 kernels off (%s=0): linear layers use oneDNN", DISABLE_VARIABLE)
        return None
    if not _is_x86_64():
        log.warning("native bf16 kernels need an x86-64 CPU with AVX-512 BF16; using oneDNN")
        return None
    try:
        from torch.utils.cpp_extension import load

        load(
            name=LIBRARY,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("native bf16 kernel could not be built (%s); linear layers use oneDNN, decode is slower", first_line)
        return None
    ops = torch.ops.longspec_bf16_matvec
    if not ops.supported():
        log.warning("this CPU lacks AVX-512 BF16: native bf16 kernel off, linear layers use oneDNN")
        return None
    return Bf16Matvec(max_rows=int(ops.max_rows()))


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")
