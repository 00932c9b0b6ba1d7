"""Exact losslessness over long runs, no statistics.

* Seeded identity: with deterministic candidates (top-k, beams, n-grams, CAPE,
  retrieval chains) the verifier makes exactly one draw per emitted token, in the
  order autoregressive decoding makes them, so a sampled speculative run with a
  fixed seed must be token-identical to the seeded AR run, for every processor and
  every family.
* Greedy identity over >= 2000 tokens, with sliding-window rings wrapping many
  times and trees of several budgets.

Both compare the target's KV caches afterwards, position by position (full layers
over the whole sequence, rings over the window). Tiny random models in float64,
chosen so their outputs do not fall into a short loop: every run asserts a high
Distinct-2 so a test cannot pass on a degenerate repetition.
"""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.cache import KVCache
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.longspec import BeamStrategy, CapeStrategy, ChainStrategy, LongSpecDrafter
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats, distinct_n
from longspec.speculation.processors import SamplingParams
from test_engine_greedy import OracleGarbageDrafter
from test_longspec_drafting import random_draft
from tiny_models import FAMILIES, random_ids, tiny_decoder

MIN_DISTINCT_2 = 0.5
CONTEXT = 4096

# Per family, an init scale (and for the two that loop under plain greedy decoding, a
# penalty) under which greedy output stays non-degenerate for thousands of tokens.
DIVERSE = {
    "llama": (0.3, {}),
    "llama3_rope": (0.3, {}),
    "mistral": (0.3, {}),
    "qwen2": (0.3, {}),
    "qwen3": (0.15, dict(penalty=3.0, penalty_window=100)),
    "gemma3": (0.05, dict(penalty=2.0, penalty_window=64)),
}

PROCESSORS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.0, top_k=12),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "eta": SamplingParams(temperature=1.0, eta=0.05),
    "penalty": SamplingParams(temperature=1.0, penalty=1.8, penalty_window=48),
}


def diverse_model(family: str) -> tuple[torch.nn.Module, dict]:
    init, extra = DIVERSE[family]
    return tiny_decoder(family, dtype=torch.float64, max_position_embeddings=CONTEXT, initializer_range=init), extra


def real_drafters(model) -> dict:
    """Every shipped drafter with deterministic candidates, with random weights (losslessness
    may not depend on the draft being good). LongSpec cross-attends a full-attention
    layer, which an all-sliding target (Mistral) does not have."""
    drafters = {
        "pld": lambda: PromptLookupDrafter(num_tokens=6),
        "pld-continued": lambda: PromptLookupDrafter(num_tokens=12, continue_copies=True, longest_run=True),  # auto's
        "ngram": lambda: NgramDrafter(k=5),
        "tokenswift": lambda: TokenSwiftDrafter(TokenSwiftHeads.for_target(model.config).randomize(torch.Generator().manual_seed(0)),
                                                budget=24, sinks=2, forward_chunk=8, k=5),
        "longspec-chain": lambda: LongSpecDrafter(random_draft(model), ChainStrategy(4)),
        "longspec-cape": lambda: LongSpecDrafter(random_draft(model), CapeStrategy(4, bins=((0.9, 1), (0.3, 2), (0.0, 3)))),
        "longspec-beam": lambda: LongSpecDrafter(random_draft(model), BeamStrategy((3, 5, 5, 4))),
        "longspec-beam+pld": lambda: LongSpecDrafter(random_draft(model), BeamStrategy((2, 4, 4)),
                                                     retrieval=PromptLookupDrafter(num_tokens=5), retrieval_nodes=8),
        "longspec-chain+ngram": lambda: LongSpecDrafter(random_draft(model), ChainStrategy(3),
                                                        retrieval=NgramDrafter(k=3), retrieval_nodes=8, retrieval_streak=None),
    }
    if all(model.config.layer_is_sliding):
        drafters = {name: make for name, make in drafters.items() if not name.startswith("longspec")}
    return drafters


class Run:
    """One generation with the engine's KV cache kept for inspection."""

    def __init__(self, engine, prompt, *, params, max_new_tokens, drafter=None, seed=None):
        model = engine.model
        caches: list[KVCache] = []
        original = model.new_cache
        model.new_cache = lambda *a, **k: caches.append(original(*a, **k)) or caches[-1]
        try:
            self.stats = GenerationStats()
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            rounds = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                                     generator=generator, stats=self.stats)
            self.tokens = torch.cat(list(rounds))
        finally:
            model.new_cache = original
        self.cache = caches[0]  # the engine's (a self-drafting drafter may make its own later)


def assert_same_caches(reference: KVCache, other: KVCache) -> None:
    """Full layers over every committed position; rings over the last window."""
    length = min(reference.length, other.length)
    assert length > 0
    for name in ("full_k", "full_v"):
        torch.testing.assert_close(getattr(other, name)[..., :length, :], getattr(reference, name)[..., :length, :],
                                   rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    if reference.ring_size:
        positions = torch.arange(max(0, length - reference.window), length)
        slots = {}
        for label, cache in (("reference", reference), ("speculative", other)):
            slot = positions % cache.ring_size
            assert torch.equal(cache.ring_positions[slot], positions), f"{label} ring lost positions of the window"
            slots[label] = slot
        for name in ("ring_k", "ring_v"):
            torch.testing.assert_close(getattr(other, name)[..., slots["speculative"], :],
                                       getattr(reference, name)[..., slots["reference"], :],
                                       rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


def assert_non_degenerate(tokens: torch.Tensor) -> None:
    d2 = distinct_n(tokens.tolist(), 2)
    assert d2 >= MIN_DISTINCT_2, f"output is degenerate (Distinct-2 {d2:.3f}): the test would prove little"


# ------------------------------------------------------------------- seeded identity
SEEDED_TOKENS = 1000
# The default run covers every family and every processor twice each (12 of the 36 pairs) and
# every shipped drafter at least once; the whole matrix is marked `exhaustive` (README: Tests).
_PAIRS = [(f, p) for f in FAMILIES for p in PROCESSORS]
_DEFAULT = [(f, p) for f, p in _PAIRS if (FAMILIES.index(f) + list(PROCESSORS).index(p)) % 3 == 0]
CASES = _DEFAULT + [pair for pair in _PAIRS if pair not in _DEFAULT]  # drafters rotate in this order


@pytest.mark.parametrize(
    "family,processor",
    [pytest.param(*case, marks=() if case in _DEFAULT else pytest.mark.exhaustive) for case in CASES],
)
def test_seeded_sampling_is_token_identical_to_seeded_ar(family, processor):
    model, _ = diverse_model(family)
    params = PROCESSORS[processor]
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False))
    prompt = random_ids(24, seed=CASES.index((family, processor)))[0]
    seed = 1234
    reference = Run(engine, prompt, params=params, max_new_tokens=SEEDED_TOKENS, seed=seed)
    assert reference.tokens.numel() == SEEDED_TOKENS
    assert_non_degenerate(reference.tokens)
    # The oracle puts the seeded AR continuation into random trees among garbage: deep
    # paths are accepted only if every draw happens in AR's order.
    oracle = Run(engine, prompt, params=params, max_new_tokens=SEEDED_TOKENS, seed=seed,
                 drafter=OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=7))
    assert torch.equal(oracle.tokens, reference.tokens)
    assert oracle.stats.tau > 1.5
    assert_same_caches(reference.cache, oracle.cache)
    # One shipped drafter per case, rotating so every drafter meets several families and processors.
    drafters = real_drafters(model)
    name = sorted(drafters)[CASES.index((family, processor)) % len(drafters)]
    real = Run(engine, prompt, params=params, max_new_tokens=SEEDED_TOKENS, seed=seed, drafter=drafters[name]())
    assert torch.equal(real.tokens, reference.tokens), name
    assert_same_caches(reference.cache, real.cache)


def test_every_drafter_meets_seeded_cases():
    names = sorted(real_drafters(tiny_decoder("llama")))
    for cases, least in ((_DEFAULT, 1), (CASES, 4)):  # the default run, the exhaustive one
        met = {name: 0 for name in names}
        for index in range(len(cases)):
            met[names[index % len(names)]] += 1
        assert min(met.values()) >= least
    assert {f for f, _ in _DEFAULT} == set(FAMILIES) and {p for _, p in _DEFAULT} == set(PROCESSORS)


# ------------------------------------------------------------ long greedy identity
GREEDY_TOKENS = 2000


@pytest.mark.parametrize("family", FAMILIES)
def test_long_greedy_identity_with_wrapping_rings_and_several_budgets(family):
    model, extra = diverse_model(family)
    params = SamplingParams(**extra)
    prompt = random_ids(30, seed=FAMILIES.index(family))[0]
    reference = None
    for budget in (4, 16, 48):
        engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=8, max_tree_nodes=budget, progress=False))
        if reference is None:
            reference = Run(engine, prompt, params=params, max_new_tokens=GREEDY_TOKENS)
            assert reference.tokens.numel() == GREEDY_TOKENS
            assert_non_degenerate(reference.tokens)
            if model.config.sliding_window:
                assert GREEDY_TOKENS > 100 * model.config.sliding_window  # the rings wrap many times
        oracle = Run(engine, prompt, params=params, max_new_tokens=GREEDY_TOKENS,
                     drafter=OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=budget, max_nodes=budget))
        assert torch.equal(oracle.tokens, reference.tokens), budget
        assert oracle.stats.tau > 1.5
        assert_same_caches(reference.cache, oracle.cache)
    drafters = real_drafters(model)
    drafter = drafters.get("longspec-beam+pld", drafters["pld"])()
    real = Run(engine, prompt, params=params, max_new_tokens=GREEDY_TOKENS, drafter=drafter)
    assert torch.equal(real.tokens, reference.tokens)
    assert_same_caches(reference.cache, real.cache)
