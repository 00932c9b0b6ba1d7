"""MagicDec (StreamingLLM cache) and TriForce* (importance cache) self-speculation:
lossless through the engine, a cache whose contents are pinned against a brute-force
reference, and drafts that are the target's own when the cache holds everything."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.self_speculation import MagicDecDrafter, TriForceDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from exactness import PROCESSORS, diverse_model
from tiny_models import FAMILIES, random_ids

OPTIONS = EngineOptions(prefill_chunk=16, max_tree_nodes=8, progress=False)
DRAFTERS = {"magicdec": MagicDecDrafter, "triforce": TriForceDrafter}
SMALL = dict(length=4, budget=16, sinks=2, forward_chunk=8)  # evicts and rebuilds within a short run


def run(model, prompt, drafter=None, *, params=SamplingParams(), seed=None, max_new_tokens=80, stats=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    rounds = SpeculativeEngine(model, OPTIONS).generate(prompt, params=params, max_new_tokens=max_new_tokens,
                                                        drafter=drafter, generator=generator, stats=stats)
    return torch.cat(list(rounds))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_identity(family, name):
    model, _ = diverse_model(family)
    prompt = random_ids(60, seed=3)[0] % 40
    assert torch.equal(run(model, prompt, DRAFTERS[name](**SMALL)), run(model, prompt))


@pytest.mark.parametrize("processor", ["temperature", "top_p", "penalty"])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_seeded_sampling_equals_seeded_ar(name, processor):
    """Deterministic candidates, one draw per emitted token: exactly AR's seeded output."""
    model, _ = diverse_model("gemma3")
    prompt = random_ids(50, seed=4)[0] % 40
    params = PROCESSORS[processor]
    expected = run(model, prompt, params=params, seed=11, max_new_tokens=120)
    assert torch.equal(run(model, prompt, DRAFTERS[name](**SMALL), params=params, seed=11, max_new_tokens=120), expected)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_cache_that_holds_everything_drafts_the_targets_own_tokens(name):
    """With the whole context in its cache the draft is the target itself: every
    round accepts its full chain (the last round may be cut by max_new_tokens)."""
    model, _ = diverse_model("qwen3")
    prompt = random_ids(30, seed=5)[0] % 40
    stats = GenerationStats()
    run(model, prompt, DRAFTERS[name](length=4, budget=256, sinks=2), max_new_tokens=50, stats=stats)
    assert stats.accepted_tokens >= 4 * (stats.target_forwards - 1)


def test_streaming_cache_holds_the_sinks_and_the_most_recent_tokens():
    """MagicDec's cache after every round, against a brute-force StreamingLLM selection."""
    model, _ = diverse_model("gemma3")
    prompt = random_ids(40, seed=6)[0] % 40
    drafter = MagicDecDrafter(**SMALL)
    full_layers = [i for i, sliding in enumerate(model.config.layer_is_sliding) if not sliding]
    engine = SpeculativeEngine(model, OPTIONS)
    checked = 0
    for _ in engine.generate(prompt, max_new_tokens=60, drafter=drafter):
        cache = drafter.cache
        if cache is None or cache.length <= cache.budget:
            continue
        recent = cache.budget - cache.sinks
        expected = list(range(cache.sinks)) + list(range(cache.length - recent, cache.length))
        for layer in full_layers:
            assert cache.selected_positions(layer).tolist() == expected
        checked += 1
    assert checked > 10 and drafter.cache.rebuilds > 1


def test_a_drafted_chain_leaves_the_cache_as_it_was():
    model, _ = diverse_model("gemma3")
    prompt = random_ids(40, seed=7)[0] % 40
    drafter = MagicDecDrafter(**SMALL)
    engine = SpeculativeEngine(model, OPTIONS)
    rounds = engine.generate(prompt, max_new_tokens=30, drafter=drafter)
    next(rounds)
    cache = drafter.cache
    before = (cache.length, cache.used, cache.ring_positions.clone(), cache.slot_positions.clone())
    from longspec.speculation.drafters.base import DraftContext

    tokens = torch.cat([prompt, torch.tensor([1])])[: cache.length]
    drafter.propose(DraftContext(tokens, None, 8))
    after = (cache.length, cache.used, cache.ring_positions, cache.slot_positions)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])


def test_options_are_checked():
    with pytest.raises(ValueError, match="forward_chunk"):
        make_drafter("magicdec", length=8, forward_chunk=4)
    with pytest.raises(ValueError, match="length"):
        make_drafter("triforce", length=0)
    with pytest.raises(ValueError, match="has no option"):
        make_drafter("magicdec", widths=[2])
