"""TokenSwift heads on the verification pass: lossless (greedy identity, exact
sampling distribution) and drafting from exactly the hidden state of the last
accepted node, which a fresh forward over the committed sequence reproduces."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from sampling_checks import ALPHA, SAMPLING, empirical_counts, exact_distribution, goodness_of_fit, model  # noqa: F401 - `model` is a pytest fixture
from tiny_models import random_ids, tiny_decoder


def heads_for(target, seed=0):
    return TokenSwiftHeads.for_target(target.config).randomize(torch.Generator().manual_seed(seed))


def run(engine, prompt, drafter=None, params=SamplingParams(), max_new_tokens=60, stats=None):
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats)))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "mistral"])
@pytest.mark.parametrize("widths,k,context_vocab", [((4, 2, 1), 8, True), ((2, 2, 2), 0, False), ((3,), 4, True)])
def test_greedy_output_equals_autoregressive(family, widths, k, context_vocab):
    target = tiny_decoder(family, dtype=torch.float64)
    engine = SpeculativeEngine(target, EngineOptions(prefill_chunk=7, max_tree_nodes=24, progress=False))
    prompt = torch.cat([random_ids(6, seed=1)[0].repeat(4), random_ids(5, seed=9)[0]])
    reference = run(engine, prompt)
    stats = GenerationStats()
    drafter = OnePassTokenSwiftDrafter(heads_for(target), widths=widths, k=k, context_vocab=context_vocab)
    out = run(engine, prompt, drafter, stats=stats)
    assert torch.equal(out, reference)
    assert stats.draft_tokens > 0


def test_heads_read_the_hidden_state_of_the_last_accepted_node():
    target = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(target, EngineOptions(max_tree_nodes=24, progress=False))
    prompt = torch.cat([random_ids(6, seed=2)[0].repeat(4), random_ids(3, seed=5)[0]])
    checked = []

    class Checking(OnePassTokenSwiftDrafter):
        def propose(self, context):
            tree = super().propose(context)
            if self.hidden_used is not None:
                # The state that predicted the root (the bonus) in a fresh forward over
                # the committed sequence: row -2 of its hidden states.
                ids = context.tokens
                cache = target.new_cache(ids.numel())
                fresh = target(ids.unsqueeze(0), cache).hidden[0, -2]
                torch.testing.assert_close(self.hidden_used, fresh, rtol=1e-9, atol=1e-9)
                checked.append(1)
            return tree

    reference = run(engine, prompt, max_new_tokens=30)
    assert torch.equal(run(engine, prompt, Checking(heads_for(target)), max_new_tokens=30), reference)
    assert len(checked) > 5


def test_sampled_sequences_follow_the_target_distribution(model):  # noqa: F811
    factory = lambda g: OnePassTokenSwiftDrafter(heads_for(model), widths=(2, 2), k=2)  # noqa: E731
    exact = exact_distribution(model, SAMPLING)
    counts = empirical_counts(model, SAMPLING, factory)
    assert goodness_of_fit(exact, counts) > ALPHA


def test_options_are_validated():
    with pytest.raises(ValueError, match="widths"):
        OnePassTokenSwiftDrafter(widths=())
    with pytest.raises(ValueError, match="context_vocab must be true or false"):
        OnePassTokenSwiftDrafter(context_vocab="no")
    target = tiny_decoder("llama", dtype=torch.float64)
    with pytest.raises(ValueError, match="need 4 heads; these have 3"):
        OnePassTokenSwiftDrafter(heads_for(target), widths=(1, 1, 1, 1)).check_target(target.config)
