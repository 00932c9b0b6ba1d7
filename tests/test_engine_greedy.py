"""Greedy identity: speculative output == autoregressive output, token for token,
for every drafter and tree shape (float64, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from oracles import OracleGarbageDrafter
from tiny_models import FAMILIES, random_ids, tiny_decoder


def run(engine, prompt, drafter=None, params=SamplingParams(), max_new_tokens=40, stats=None):
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats)))


@pytest.mark.parametrize("family", FAMILIES)
def test_all_drafters_match_autoregressive(family):
    model = tiny_decoder(family, dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=7, max_tree_nodes=24, progress=False))
    for seed in range(3):
        # Repetitive prompts so lookups hit; random tail so they also miss.
        base = random_ids(6, seed=seed)[0]
        prompt = torch.cat([base.repeat(4), random_ids(5, seed=100 + seed)[0]])
        reference = run(engine, prompt)
        assert reference.numel() == 40
        for drafter in (PromptLookupDrafter(num_tokens=6), PromptLookupDrafter(max_candidates=3),
                        PromptLookupDrafter(num_tokens=16, continue_copies=True), NgramDrafter(k=5)):
            assert torch.equal(run(engine, prompt, drafter), reference), type(drafter).__name__
        stats = GenerationStats()
        out = run(engine, prompt, OracleGarbageDrafter(reference, prompt.numel(), seed), stats=stats)
        assert torch.equal(out, reference)
        assert stats.tau > 1.2  # the oracle nodes were really accepted at depth


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_penalty_greedy_matches_autoregressive(family):
    model = tiny_decoder(family, dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=5, max_tree_nodes=24, progress=False))
    params = SamplingParams(penalty=1.8, penalty_window=6)
    prompt = random_ids(12, seed=3)[0].repeat(2)
    reference = run(engine, prompt, params=params)
    for seed in range(3):
        drafter = OracleGarbageDrafter(reference, prompt.numel(), seed)
        assert torch.equal(run(engine, prompt, drafter, params=params), reference)


def test_greedy_equals_transformers_generate():
    from tiny_models import tiny_pair

    hf_model, model = tiny_pair("gemma3", dtype=torch.float32)
    prompt = random_ids(20, seed=5)[0]
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=6, progress=False))
    ours = run(engine, prompt, PromptLookupDrafter(), max_new_tokens=30)
    theirs = hf_model.generate(prompt.unsqueeze(0), do_sample=False, max_new_tokens=30, min_new_tokens=30)[0, 20:]
    assert torch.equal(ours, theirs)


def test_eos_and_max_tokens_truncate_rounds():
    model = tiny_decoder("llama", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    prompt = random_ids(8, seed=1)[0].repeat(3)
    reference = run(engine, prompt, max_new_tokens=30)
    eos = int(reference[10])
    first = int((reference == eos).nonzero()[0])
    stats = GenerationStats()
    out = torch.cat(list(engine.generate(prompt, max_new_tokens=30, drafter=PromptLookupDrafter(), eos_token_ids=[eos], stats=stats)))
    assert torch.equal(out, reference[: first + 1]) and stats.stop_reason == "eos"
    for n in (1, 7, 13):
        assert torch.equal(run(engine, prompt, PromptLookupDrafter(), max_new_tokens=n), reference[:n])


def test_bad_requests_fail_before_work():
    model = tiny_decoder("llama", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        next(engine.generate(torch.zeros(limit - 5, dtype=torch.long), max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        next(engine.generate(torch.zeros(0, dtype=torch.long)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(engine.generate(torch.zeros(3, dtype=torch.long), max_new_tokens=0))


def test_sliding_ring_stays_bounded_over_many_rounds():
    model = tiny_decoder("gemma3", dtype=torch.float32, max_position_embeddings=4096)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=8, progress=False))
    caches = []
    original_new_cache = model.new_cache
    model.new_cache = lambda *a, **k: caches.append(original_new_cache(*a, **k)) or caches[-1]
    footprints = set()

    class Spy(PromptLookupDrafter):
        def observe(self, committed):
            footprints.add((tuple(caches[0].ring_k.shape), caches[0].nbytes()))
            super().observe(committed)

    out = run(engine, random_ids(10, seed=2)[0], Spy(num_tokens=4), max_new_tokens=3000)
    assert out.numel() == 3000
    assert len(footprints) == 1  # ring shape and cache bytes never changed over the rounds
    assert caches[0].ring_k.shape[-2] == model.config.sliding_window + 16
