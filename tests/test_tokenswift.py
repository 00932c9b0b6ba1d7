"""TokenSwift through the engine: greedy identity with AR and exact sampling
distributions, with randomly initialised heads (losslessness may not depend on
the heads being any good), tiny partial caches (so evictions and rebuilds happen)
and n-gram chains that overlap the Cartesian tree."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from sampling_checks import ALPHA, SAMPLING, VOCAB, empirical_counts, exact_distribution, goodness_of_fit
from tiny_models import random_ids, tiny_decoder


def random_heads(model, seed=0) -> TokenSwiftHeads:
    return TokenSwiftHeads.for_target(model.config).randomize(torch.Generator().manual_seed(seed))


def run(engine, prompt, drafter, params=SamplingParams(), max_new_tokens=40, stats=None):
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats)))


VARIANTS = {
    "tokenswift": dict(budget=10, sinks=2, forward_chunk=4, k=5),
    "no-reutilization": dict(budget=10, sinks=2, forward_chunk=4, k=0),
    "no-dynamic-cache": dict(dynamic_cache=False, forward_chunk=4, k=5),
}


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "mistral"])
def test_greedy_output_equals_autoregressive(family):
    model = tiny_decoder(family, dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=7, max_tree_nodes=48, progress=False))
    for seed in range(2):
        base = random_ids(6, seed=seed)[0]
        prompt = torch.cat([base.repeat(4), random_ids(7, seed=100 + seed)[0]])
        reference = run(engine, prompt, None)
        for name, options in VARIANTS.items():
            drafter = TokenSwiftDrafter(random_heads(model, seed), **options)
            stats = GenerationStats()
            out = run(engine, prompt, drafter, stats=stats)
            assert torch.equal(out, reference), (family, name, seed)
            assert stats.target_forwards < 40  # drafts were accepted
            if name != "no-dynamic-cache" and any(not s for s in model.config.layer_is_sliding):
                assert drafter.cache.rebuilds > 2  # budget 10 over ~70 tokens: replacements and rebuilds ran
                assert drafter.cache.used <= 10


def test_greedy_with_penalty_equals_autoregressive():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=64, progress=False))
    params = SamplingParams(penalty=1.2, penalty_window=16)
    prompt = torch.cat([random_ids(5, seed=3)[0].repeat(5), random_ids(4, seed=4)[0]])
    reference = run(engine, prompt, None, params=params)
    out = run(engine, prompt, TokenSwiftDrafter(random_heads(model), budget=12, sinks=2, forward_chunk=4), params=params)
    assert torch.equal(out, reference)


def test_trees_have_unique_siblings_and_fit_the_budget():
    model = tiny_decoder("llama", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(progress=False))
    prompt = random_ids(4, seed=1)[0].repeat(8)
    drafter = TokenSwiftDrafter(random_heads(model), budget=12, sinks=2, forward_chunk=4, k=20)
    list(engine.generate(prompt, max_new_tokens=4, drafter=drafter))
    for max_nodes in (64, 45, 13, 2, 0):
        tree = drafter.propose(DraftContext(torch.cat([prompt, prompt[:3]]), drafter._view, max_nodes))
        pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))[1:]
        assert len(pairs) == len(set(pairs)) and tree.size - 1 <= max_nodes


def test_registered_and_validated():
    assert isinstance(make_drafter("tokenswift", k=3, budget=64), TokenSwiftDrafter)
    with pytest.raises(ValueError, match="first width"):
        TokenSwiftDrafter(widths=(2, 3))
    model = tiny_decoder("llama", dtype=torch.float64)

    class NoPrefill(SpeculativeEngine):
        def _prefill(self, ids, cache):
            raise AssertionError("prefill ran before the heads were checked against the target")

    engine = NoPrefill(model, EngineOptions(progress=False))
    wrong = TokenSwiftHeads.for_target(tiny_decoder("llama", dtype=torch.float64, vocab_size=64).config)
    with pytest.raises(ValueError, match="do not fit this target"):
        list(engine.generate(random_ids(8)[0], max_new_tokens=2, drafter=TokenSwiftDrafter(wrong)))
    with pytest.raises(ValueError, match="need 4 heads"):
        list(engine.generate(random_ids(8)[0], max_new_tokens=2, drafter=TokenSwiftDrafter(
            TokenSwiftHeads.for_target(model.config), widths=(1, 2, 2, 2, 2))))


# --------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def small_vocab_model():
    # The model of test_engine_sampling (4-token vocabulary, exact enumeration).
    return tiny_decoder("qwen3", dtype=torch.float64, vocab_size=VOCAB, seed=7, initializer_range=0.5)


MIN_P_PENALTY = SamplingParams(temperature=1.0, min_p=0.1, penalty=1.8, penalty_window=3)


@pytest.mark.parametrize("params", [SAMPLING, MIN_P_PENALTY], ids=["top-p", "min-p+penalty"])
def test_sampled_sequences_follow_the_target_distribution(small_vocab_model, params):
    heads = random_heads(small_vocab_model, seed=2)

    def factory(generator):
        # Width 2 per head and 3 n-gram chains over a 4-token vocabulary: chains
        # overlap the Cartesian tree, so merging is exercised every round.
        return TokenSwiftDrafter(heads, budget=4, sinks=1, forward_chunk=2, k=3, widths=(1, 2, 2, 2))

    exact = exact_distribution(small_vocab_model, params)
    counts = empirical_counts(small_vocab_model, params, factory)
    assert goodness_of_fit(exact, counts) > ALPHA


class DuplicateSiblingsDrafter(Drafter):
    """A tree whose siblings repeat tokens (as an unmerged Cartesian + n-gram tree
    would): several equally long accepted paths spell the same tokens."""

    def __init__(self, generator=None):
        pass

    def begin(self, context):
        pass

    def observe(self, committed):
        pass

    def propose(self, context: DraftContext) -> Tree:
        tokens = [context.root, 0, 1, 0, 1, 0, 2, 0, 1]
        parents = [-1, 0, 0, 0, 1, 1, 3, 3, 6]
        return Tree.from_parents(torch.tensor(tokens), torch.tensor(parents))


def test_equally_long_accepted_paths_do_not_bias_the_output(small_vocab_model):
    exact = exact_distribution(small_vocab_model, SAMPLING)
    counts = empirical_counts(small_vocab_model, SAMPLING, DuplicateSiblingsDrafter)
    assert goodness_of_fit(exact, counts) > ALPHA


@pytest.mark.slow
def test_shipped_heads_fit_the_embedded_gemma():
    from longspec.runtime.default_model import default_model_available
    from longspec.speculation.drafters.tokenswift.drafter import default_heads_path

    if not default_model_available():
        pytest.skip("the embedded Gemma 3 270M package is not installed")
    import longspec

    from longspec.runtime.native import bf16_speculation_is_exact

    # bf16 (fast) where the native kernels make it exact; elsewhere bf16 near-ties may differ.
    model = longspec.load(None, dtype="bfloat16" if bf16_speculation_is_exact() else "float32")
    heads = TokenSwiftHeads.load(default_heads_path(), model.config)
    assert heads.config.num_heads == 3
    prompt = model.encode("The quick brown fox jumps over the lazy dog. " * 8)
    greedy = model.generate(prompt, max_new_tokens=24, ignore_eos=True)
    swift = model.generate(prompt, max_new_tokens=24, ignore_eos=True, method="tokenswift")
    assert swift.token_ids == greedy.token_ids
