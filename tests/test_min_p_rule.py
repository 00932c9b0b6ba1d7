"""Min-p's rule is stated once (`processors.min_p_kept`) and every sampler uses it: the
full-head sampler in PyTorch and in the native kernel (float32 scores) and the certified
sampler (which holds its candidates' scores in float64). At a threshold crafted to fall
between float32's and float64's resolution, where the float32 softmax rule and the float64
rule part, all three keep the same set."""

from __future__ import annotations

import math

import pytest
import torch

from longspec.runtime.native import bf16_linear_ops, native_ops
from longspec.speculation.processors import SamplingParams, min_p_kept
from sampler_rules import HeadRow

pytestmark = pytest.mark.skipif(bf16_linear_ops() is None or native_ops() is None,
                                reason="the certified head needs the native bf16 product (reason logged)")


def _crafted_min_p(logits: torch.Tensor, token: int) -> float | None:
    """A min_p at which the float32 softmax rule (p_i < min_p p_max, as transformers'
    MinPLogitsWarper computes it) and the float64 rule on the scores disagree for `token`."""
    probs = torch.softmax(logits, 0)
    gap = float(logits[token]) - float(logits.max())
    for step in range(1, 1 << 14):
        for sign in (1, -1):
            min_p = math.exp(gap) * (1 + sign * step * 2.0**-34)
            by_float32 = not bool(probs[token] < min_p * probs.max())
            if by_float32 != (gap >= math.log(min_p)):
                return min_p
    return None


def test_a_min_p_threshold_between_the_precisions_keeps_the_same_set_in_every_sampler():
    row = HeadRow()
    logits = row.logits  # float32
    second = int(torch.topk(logits, 2).indices[1])
    min_p = _crafted_min_p(logits, second)
    assert min_p is not None, "no threshold between the precisions found for this row"
    rule = min_p_kept(logits, logits.max(), min_p)  # the one rule
    assert int(rule.sum()) in (1, 2)  # the best token, and the second exactly at the threshold or not
    row.assert_every_sampler_keeps(rule, SamplingParams(temperature=1.0, min_p=min_p))


def test_min_p_zero_keeps_every_token():
    scores = torch.tensor([[0.0, -50.0, -float("inf")]])
    assert min_p_kept(scores, scores.max(), 0.0).all()
