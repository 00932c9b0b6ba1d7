"""argmax over the last axis with torch.argmax's rule (the first index of the maximum),
fast where logits are bf16 on the CPU.

PyTorch's CPU argmax over bfloat16 is not vectorised: bf16 rows go to the native
kernel (`kernels/row_argmax.cpp`), else to `max(dim)`, which has argmax's first-index
rule and is faster on such rows (numbers: docs/lab-notes/batching.md#batched-throughput-after-huge-pages-and-the-native-argmax-issue-batching)."""

from __future__ import annotations

import torch

from longspec.runtime.native import native_ops


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16):
        return logits.argmax(dim=-1)
    ops = native_ops() if logits.dtype == torch.bfloat16 else None
    if ops is not None:
        return ops.row_argmax(logits.contiguous())
    return logits.max(dim=-1).indices
