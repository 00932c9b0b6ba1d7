"""A certified head's row and the check that every sampler keeps a rule's set: the
full-head sampler in PyTorch and in the native kernel, and the certified draw (used by
the tests of the min-p and top-p rules)."""

from __future__ import annotations

import torch

from longspec.runtime.certified_head import CertifiedHead
from longspec.runtime.linear import prepack
from longspec.runtime.native import bf16_linear_ops
from longspec.speculation.certified_sampling import certified_draw
from longspec.speculation.processors import SamplingParams, processed_logits, processed_probs

V, H, DRAWS = 600, 64, 1500


class HeadRow:
    """A random bf16 head of V rows and one hidden state; `logits` is its float32 product."""

    def __init__(self, seed: int = 21) -> None:
        g = torch.Generator().manual_seed(seed)
        weight = (torch.randn(V, H, generator=g) * 0.08).bfloat16()
        self.hidden = (torch.randn(H, generator=g) * 2).bfloat16()
        self.head = CertifiedHead(weight)
        self.tiles = prepack(weight).tiles
        self.logits = self.full()

    def full(self) -> torch.Tensor:
        return bf16_linear_ops().bf16_packed_linear(self.hidden.unsqueeze(0), self.tiles, V, None)[0]

    def assert_every_sampler_keeps(self, rule: torch.Tensor, params: SamplingParams) -> None:
        by_torch = processed_logits(self.logits.unsqueeze(0), None, params)[0].isfinite()
        by_native = processed_probs(self.logits.unsqueeze(0), None, params)[0] > 0
        assert torch.equal(by_torch, rule) and torch.equal(by_native, rule)
        screen = self.head.screen(self.hidden.unsqueeze(0))
        generator = torch.Generator().manual_seed(0)
        drawn = {certified_draw(screen, 0, self.hidden, params, generator, self.full) for _ in range(DRAWS)}
        assert drawn == set(torch.nonzero(rule).flatten().tolist())
