"""Top-p's rule is stated once (`processors.top_p_cut`) and every sampler uses it: the
full-head sampler in PyTorch and in the native kernel (whose vectorised normaliser is a
float sum, so it decides a near cut with the double one) and the certified sampler. At a
threshold crafted to fall between float32's and float64's resolution, where transformers'
float32 rule (softmax, then a float32 cumulative sum) and the float64 rule part, all three
keep the same set."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.native import bf16_linear_ops, native_ops
from longspec.speculation.processors import SamplingParams, processed_logits, processed_probs, top_p_cut
from sampler_rules import HeadRow

pytestmark = pytest.mark.skipif(bf16_linear_ops() is None or native_ops() is None,
                                reason="the certified head needs the native bf16 product (reason logged)")


def _crafted_top_p(logits: torch.Tensor) -> float | None:
    """A top_p at which the float32 rule (the best token's float32 probability against
    top_p) and the float64 rule (its weight, 1, against top_p times the float64 total) part
    on whether the second token stays, at least 1e-13 from the float64 cut so the order of
    float64 sums cannot decide it."""
    p_best = float(torch.softmax(logits, 0).max())  # float32, as TopPLogitsWarper computes it
    total = float(torch.exp(logits.double() - float(logits.max())).sum())
    for step in range(1, 1 << 14):
        for sign in (1, -1):
            top_p = (1 / total) * (1 + sign * step * 2.0**-34)
            by_float32 = p_best < top_p
            by_float64 = 1.0 < top_p * total
            if by_float32 != by_float64 and abs(top_p * total - 1) > 1e-13:
                return top_p
    return None


def _rule(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    ranked = torch.sort(logits, descending=True).values.unsqueeze(0)
    total = torch.exp(logits.double() - float(logits.max())).sum().reshape(1, 1)
    return logits >= top_p_cut(ranked, total, top_p)[0, 0]


def test_a_top_p_threshold_between_the_precisions_keeps_the_same_set_in_every_sampler():
    row = HeadRow()
    logits = row.logits  # float32
    top_p = _crafted_top_p(logits)
    assert top_p is not None, "no threshold between the precisions found for this row"
    rule = _rule(logits, top_p)
    assert int(rule.sum()) == 2 if 1.0 < top_p * float(torch.exp(logits.double() - float(logits.max())).sum()) \
        else int(rule.sum()) == 1
    row.assert_every_sampler_keeps(rule, SamplingParams(temperature=1.0, top_p=top_p))


@pytest.mark.parametrize("top_k", [0, 50])
def test_the_native_kernel_keeps_the_rules_set_across_thresholds(top_k):
    """Over many thresholds a hair (1e-12, far below float32's resolution) on either side
    of a rank's cut, the native kernel (its float normaliser checked against the double
    one near a cut) keeps the rule's set. Exactly at a cut the decision is float64
    rounding's, which the samplers' different sum orders may split."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4096, generator=g) * 3
    if top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    weights = torch.exp(logits.double() - float(logits.max()))
    total = float(weights.sum())
    ranked = torch.sort(weights, descending=True).values
    cuts = (torch.cumsum(ranked, 0)[:40] / total).tolist()  # top_p at a rank's mass
    for top_p in [p * (1 + d) for p in cuts for d in (-1e-12, 1e-12)] + [0.3, 0.9, 0.95]:
        if not 0 < top_p < 1:
            continue
        params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k or None)
        kept = processed_probs(logits.unsqueeze(0), None, params)[0] > 0
        expected = _rule(logits, top_p)
        assert torch.equal(kept, expected), f"top_p={top_p!r}"
        assert torch.equal(processed_logits(logits.unsqueeze(0), None, params)[0].isfinite(), expected)


def test_the_best_token_always_stays():
    ranked = torch.tensor([[2.0, 2.0, -1.0]])
    total = torch.exp(ranked.double() - 2.0).sum(dim=-1, keepdim=True)
    assert float(top_p_cut(ranked, total, 1e-9)) == 2.0  # ties with the best survive too
