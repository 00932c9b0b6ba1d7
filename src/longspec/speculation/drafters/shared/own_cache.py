"""What the drafters that run a network over the sequence through a KV cache of their
own share (`draft-model`: a smaller model; `magicdec`/`triforce`: the target over a
partial cache): the cache is made by `begin`; a propose first runs the committed tokens
the cache has not seen, so `observe` has nothing to do."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.base import Drafter


class OwnCacheDrafter(Drafter):
    cache = None  # made by `begin`

    def observe(self, committed: torch.Tensor) -> None:
        """Nothing to do: the next propose runs the newly committed tokens."""

    def state_nbytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    def begun_cache(self):
        """The cache `begin` made; refused before it."""
        if self.cache is None:
            raise RuntimeError("call begin() before propose()")
        return self.cache
