"""Sampling losslessness of LongSpec trees, with the engine's chi-square test
against the exact target distribution (tests/test_engine_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.drafters.longspec import BeamStrategy, DraftConfig, DraftModel, LongSpecDrafter, SampledChainStrategy
from test_engine_sampling import ALPHA, SAMPLING, empirical_counts, exact_distribution, goodness_of_fit, model  # noqa: F401


def draft_for(target, **options):
    config = DraftConfig.for_target(target.config, window=8, self_num_heads=2, self_head_dim=8, intermediate_size=16, **options)
    return DraftModel(config).reset_parameters(seed=5, std=0.5).to(torch.float64)


@pytest.mark.parametrize(
    # (A full-vocabulary sampled chain is the reduced case with no zero in q; the
    # reduced one is the harder test: q(1) = 0 while p(1) > 0.)
    "name", ["sampled-chain-reduced-vocab", "beam-with-retrieval"],
)
def test_longspec_sampling_follows_the_target_distribution(model, name):  # noqa: F811
    if name == "sampled-chain-reduced-vocab":
        draft = draft_for(model, draft_vocab_size=3)
        draft.vocab_ids.copy_(torch.tensor([0, 2, 3]))  # q(1) = 0 everywhere
        factory = lambda g: LongSpecDrafter(draft, SampledChainStrategy(3, temperature=0.7), generator=g)  # noqa: E731
    else:
        draft = draft_for(model)
        factory = lambda g: LongSpecDrafter(draft, BeamStrategy((2, 3, 2)), retrieval=PromptLookupDrafter(num_tokens=3), retrieval_nodes=3)  # noqa: E731
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, factory)
    assert goodness_of_fit(exact, counts) > ALPHA
