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

from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import distinct_n
from longspec.speculation.processors import SamplingParams
from exactness import PROCESSORS, Run, assert_same_caches, diverse_model, real_drafters
from oracles import OracleGarbageDrafter
from tiny_models import FAMILIES, random_ids, tiny_decoder

MIN_DISTINCT_2 = 0.5


def assert_non_degenerate(tokens: torch.Tensor) -> None:
    d2 = distinct_n(tokens.tolist(), 2)
    assert d2 >= MIN_DISTINCT_2, f"output is degenerate (Distinct-2 {d2:.3f}): the test would prove little"


# ------------------------------------------------------------------- seeded identity
SEEDED_TOKENS = 1000
# The default run covers every family and every processor at least once (a third of the pairs) and
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
