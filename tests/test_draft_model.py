"""Vanilla draft-model speculation: greedy identity with plain decoding (float64, tiny
models of two families), the target as its own draft accepting every token, sampling
losslessness by the chi-square test, the cache growing past its first allocation,
and a draft of another vocabulary refused before any work."""

from __future__ import annotations

import pytest
import torch

import longspec.speculation.drafters.draft_model.drafter as draft_model_module
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.shared.errors import DraftMismatchError
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from sampling_checks import ALPHA, SAMPLING, VOCAB, empirical_counts, exact_distribution, goodness_of_fit
from sampling_checks import model as sampling_model  # noqa: F401 - pytest fixture
from tiny_models import random_ids, tiny_decoder


def generate(model, prompt, drafter=None, max_new_tokens=40, stats=None, params=SamplingParams(), generator=None):
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=6, max_tree_nodes=16, progress=False))
    rounds = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats,
                             generator=generator)
    return torch.cat(list(rounds))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("sample", [False, True])
def test_greedy_output_equals_plain_decoding(family, sample):
    target = tiny_decoder(family, seed=0)
    draft = tiny_decoder(family, seed=1)  # same architecture, other weights: a weak draft
    prompt = torch.cat([random_ids(6, seed=2)[0].repeat(3), random_ids(5, seed=3)[0]])
    reference = generate(target, prompt)
    drafter = DraftModelDrafter(draft, length=4, sample=sample, prefill_chunk=5)
    assert torch.equal(generate(target, prompt, drafter, generator=torch.Generator().manual_seed(0)), reference)


def test_the_target_as_its_own_draft_is_always_accepted():
    target = tiny_decoder("qwen3", seed=4)
    prompt = random_ids(9, seed=5)[0]
    stats = GenerationStats()
    out = generate(target, prompt, DraftModelDrafter(target, length=3), max_new_tokens=24, stats=stats)
    assert torch.equal(out, generate(target, prompt, max_new_tokens=24))
    assert stats.tau == 4.0  # three drafted tokens and the bonus, every round


def test_cache_grows_past_its_first_allocation(monkeypatch):
    monkeypatch.setattr(draft_model_module, "INITIAL_HEADROOM", 3)
    target, draft = tiny_decoder("llama", seed=0), tiny_decoder("llama", seed=6, num_hidden_layers=1)
    prompt = random_ids(7, seed=7)[0]
    drafter = DraftModelDrafter(draft, length=4)
    assert torch.equal(generate(target, prompt, drafter, max_new_tokens=50), generate(target, prompt, max_new_tokens=50))
    assert drafter.cache.capacity >= prompt.numel() + 50


def test_sampled_chain_follows_the_target_distribution(sampling_model):  # noqa: F811
    draft = tiny_decoder("qwen3", dtype=torch.float64, vocab_size=VOCAB, seed=9, initializer_range=0.5, num_hidden_layers=1)
    # The harness reuses one verifier generator for every run; a drafter stream derived
    # from its seed would repeat run after run, so the drafter draws from it directly.
    factory = lambda g: DraftModelDrafter(draft, length=3, sample=True, temperature=0.8, generator=g)  # noqa: E731
    exact = exact_distribution(sampling_model, SAMPLING)
    counts = empirical_counts(sampling_model, SAMPLING, factory)
    assert goodness_of_fit(exact, counts) > ALPHA


def test_a_draft_of_another_tokenizer_is_refused_before_work():
    target = tiny_decoder("llama", seed=0)
    draft = tiny_decoder("llama", seed=1, vocab_size=target.config.vocab_size + 8)
    engine = SpeculativeEngine(target, EngineOptions(progress=False))
    with pytest.raises(DraftMismatchError, match="vocabulary"):
        next(iter(engine.generate(random_ids(5)[0], max_new_tokens=4, drafter=DraftModelDrafter(draft))))


def test_registry_and_option_errors():
    draft = tiny_decoder("llama", seed=1)
    assert isinstance(make_drafter("draft-model", model=draft, length=2), DraftModelDrafter)
    with pytest.raises(ValueError, match="length"):
        make_drafter("draft-model", model=draft, length=0)
    with pytest.raises(ValueError, match="temperature"):
        DraftModelDrafter(draft, temperature=0.0)
    with pytest.raises(FileNotFoundError):
        DraftModelDrafter("/nonexistent/draft-checkpoint")


@pytest.mark.parametrize("processor", ["sampled", "penalized"])
def test_seeded_output_equals_seeded_plain_decoding(processor):
    """Deterministic candidates draw once per emitted token, as plain decoding does: one
    seed, one output."""
    params = {"sampled": SamplingParams(temperature=1.0, top_p=0.9),
              "penalized": SamplingParams(temperature=0.8, penalty=1.3, penalty_window=8)}[processor]
    target = tiny_decoder("llama", seed=0, initializer_range=0.3)
    prompt = random_ids(11, seed=8)[0]
    reference = generate(target, prompt, params=params, generator=torch.Generator().manual_seed(5))
    out = generate(target, prompt, DraftModelDrafter(target, length=3), params=params, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, reference)
