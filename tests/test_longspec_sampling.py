"""Sampling losslessness of LongSpec trees, with the engine's chi-square test
against the exact target distribution (tests/test_engine_sampling.py)."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.longspec import DraftConfig, DraftModel, LongSpecDrafter, SampledChainStrategy
from sampling_checks import ALPHA, SAMPLING, empirical_counts, exact_distribution, goodness_of_fit, model  # noqa: F401 - `model` is a pytest fixture


def draft_for(target, **options):
    config = DraftConfig.for_target(target.config, window=8, self_num_heads=2, self_head_dim=8, intermediate_size=16, **options)
    return DraftModel(config).reset_parameters(seed=5, std=0.5).to(torch.float64)


def test_longspec_sampled_chain_follows_the_target_distribution(model):  # noqa: F811
    """A reduced draft vocabulary makes q(1) = 0 while p(1) > 0: the residual
    distribution must put that mass back; the draft has the recency bias and the
    EAGLE-style hidden input (the plain one meets the same verifier). (Deterministic LongSpec trees, beams and
    merged retrieval chains, go through the same verifier as the engine's
    deterministic-tree test and are proven greedy-identical in test_longspec_drafting.)"""
    draft = draft_for(model, draft_vocab_size=3, recency_bias=True, hidden_input=True)
    draft.vocab_ids.copy_(torch.tensor([0, 2, 3]))
    factory = lambda g: LongSpecDrafter(draft, SampledChainStrategy(3, temperature=0.7), generator=g)  # noqa: E731
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, factory)
    assert goodness_of_fit(exact, counts) > ALPHA
