"""A CPU-only proof that longspec places every tensor it creates deliberately.

On a GPU, a tensor made by `torch.zeros(n)` without `device=` lands on the CPU while
the model, its cache and its logits live on the GPU, and the next op that mixes
them fails (or, worse, copies every round). Tests run on CPU machines, where such a
tensor happens to be on the right device. `stray_allocations_on_meta()` makes the
mistake visible there too: while it is active, a factory call made by longspec's
own code without a `device` argument creates a tensor on the "meta" device (no
data), so using it with real tensors raises, naming the line.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import longspec

_PACKAGE_DIR = str(Path(longspec.__file__).resolve().parent)
_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.randn, torch.rand,
    torch.randint, torch.eye, torch.linspace, torch.randperm,
}


class _StrayToMeta(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.strays: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(_PACKAGE_DIR):
                self.strays.add(f"{caller.f_code.co_filename}:{caller.f_lineno}")
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def stray_allocations_on_meta():
    """Yields the set of source lines that allocated without a device (filled as they run)."""
    mode = _StrayToMeta()
    with mode:
        yield mode.strays
