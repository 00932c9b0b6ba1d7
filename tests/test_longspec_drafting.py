"""LongSpec draft: greedy identity through the engine for chain, CAPE, beam and
merged draft + retrieval trees (random drafts, float64 tiny models), sampling
losslessness of sampled-chain trees, bounded draft memory, and checkpoint fit."""

from __future__ import annotations

import pytest
import torch

from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.base import DraftContext, TargetView
from longspec.speculation.drafters.longspec import (
    BeamStrategy,
    CapeStrategy,
    ChainStrategy,
    DraftConfig,
    DraftMismatchError,
    LongSpecDrafter,
    load_draft,
    save_draft,
)
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from exactness import run
from oracles import STRATEGIES, random_draft
from tiny_models import random_ids, tiny_decoder


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_greedy_identity(family, strategy):
    model = tiny_decoder(family, dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=7, max_tree_nodes=20, progress=False))
    for seed in range(2):
        prompt = torch.cat([random_ids(6, seed=seed)[0].repeat(3), random_ids(5, seed=50 + seed)[0]])
        reference = run(engine, prompt)
        drafter = LongSpecDrafter(random_draft(model, seed=seed), STRATEGIES[strategy](), seed=seed)
        assert torch.equal(run(engine, prompt, drafter), reference)


DRAFT_VARIANTS = {
    "recency_bias": {"recency_bias": True},
    "hidden_input": {"hidden_input": True},
    "cross_window": {"cross_window": 4, "cross_sinks": 2},
}


@pytest.mark.parametrize("variant", sorted(DRAFT_VARIANTS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_greedy_identity_of_the_draft_variants(strategy, variant):
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=7, max_tree_nodes=20, progress=False))
    prompt = torch.cat([random_ids(6, seed=4)[0].repeat(3), random_ids(5, seed=54)[0]])
    reference = run(engine, prompt)
    draft = random_draft(model, **DRAFT_VARIANTS[variant])
    plain = random_draft(model)
    assert not torch.equal(_root_logprobs(model, draft, prompt), _root_logprobs(model, plain, prompt))  # the variant acts
    assert torch.equal(run(engine, prompt, LongSpecDrafter(draft, STRATEGIES[strategy]())), reference)
    merged = LongSpecDrafter(draft, STRATEGIES[strategy](), retrieval=PromptLookupDrafter(num_tokens=4)) \
        if strategy != "sampled-chain" else LongSpecDrafter(draft, STRATEGIES[strategy]())
    assert torch.equal(run(engine, prompt, merged), reference)


def _root_logprobs(model, draft, prompt):
    cache = model.new_cache(64)
    prefill = model(prompt[:-1].unsqueeze(0), cache)
    cache.commit()
    drafter = LongSpecDrafter(draft, ChainStrategy(1))
    view = TargetView(model, cache)
    view.prefill_hidden = prefill.hidden[0]
    drafter.begin(DraftContext(prompt, view, 4))
    drafter.propose(DraftContext(prompt, view, 4))
    return drafter._root_logprobs


@pytest.mark.parametrize("retrieval", [lambda: PromptLookupDrafter(num_tokens=5), lambda: NgramDrafter(k=3)], ids=["pld", "ngram"])
@pytest.mark.parametrize("strategy", ["chain", "beam"])
def test_greedy_identity_with_retrieval_merged(retrieval, strategy):
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=5, max_tree_nodes=24, progress=False))
    prompt = torch.cat([random_ids(7, seed=3)[0].repeat(4), random_ids(4, seed=9)[0]])
    reference = run(engine, prompt, max_new_tokens=60)
    drafter = LongSpecDrafter(random_draft(model), STRATEGIES[strategy](), retrieval=retrieval(), retrieval_nodes=8)
    stats = GenerationStats()
    assert torch.equal(run(engine, prompt, drafter, stats=stats, max_new_tokens=60), reference)
    assert stats.tau > 1.0


def test_trees_have_the_strategy_shape_and_respect_the_budget():
    model = tiny_decoder("llama", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=12, progress=False))
    shapes = []

    class Spy(LongSpecDrafter):
        def propose(self, context):
            tree = super().propose(context)
            shapes.append(tree)
            return tree

    prompt = random_ids(10, seed=1)[0]
    run(engine, prompt, Spy(random_draft(model), BeamStrategy((3, 5, 5, 4))), max_new_tokens=10)
    beam = shapes[0]
    assert beam.size - 1 == 12  # widths 3 + 5 + 4 (cut to the budget of 12)
    assert torch.bincount(beam.depths).tolist() == [1, 3, 5, 4]
    shapes.clear()
    cape = CapeStrategy(3, bins=((2.0, 1), (0.0, 3)))  # confidence never >= 2: always 3 candidates
    run(engine, prompt, Spy(random_draft(model), cape), max_new_tokens=5)
    tree = shapes[0]
    assert torch.bincount(tree.depths).tolist() == [1, 3, 3, 3]
    # Only the first candidate of each depth has children (alternatives not extended).
    for depth in (1, 2):
        at_depth = torch.nonzero(tree.depths == depth).flatten()
        with_children = [int(n) for n in at_depth if tree.children(int(n)).numel()]
        assert with_children == [int(at_depth[0])]


def test_draft_state_memory_is_constant_in_context_length():
    model = tiny_decoder("llama", dtype=torch.float32, max_position_embeddings=40000)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=4096, max_tree_nodes=16, progress=False))
    sizes = {}
    for length in (1000, 32000):
        drafter = LongSpecDrafter(random_draft(model, window=64), ChainStrategy(4))
        run(engine, random_ids(length, seed=length)[0], drafter, max_new_tokens=8)
        sizes[length] = (drafter.state.nbytes(), tuple(drafter.state.ring_k.shape))
    assert sizes[1000] == sizes[32000]


def test_checkpoint_round_trip_and_mismatch_names_the_field(tmp_path):
    model = tiny_decoder("llama", dtype=torch.float64)
    draft = random_draft(model, draft_vocab_size=50)
    path = save_draft(draft, tmp_path / "d.safetensors", meta={"note": "test"})
    loaded = load_draft(path, model.config, dtype=torch.float64)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = tiny_decoder("llama", dtype=torch.float64, num_key_value_heads=4)
    with pytest.raises(DraftMismatchError, match="KV heads: draft 2 vs target 4"):
        load_draft(path, other.config)
    wider = tiny_decoder("llama", dtype=torch.float64, hidden_size=96)
    with pytest.raises(DraftMismatchError, match="hidden size: draft 64 vs target 96"):
        load_draft(path, wider.config)
    gemma = tiny_decoder("gemma3", dtype=torch.float64)
    bad = DraftConfig.for_target(gemma.config, target_layers=(2,))
    with pytest.raises(DraftMismatchError, match="layer mapping: target layer 2 is a sliding-window layer"):
        bad.check_fits(gemma.config)


def test_reduced_vocabulary_drafts_only_its_tokens():
    model = tiny_decoder("qwen3", dtype=torch.float64)
    draft = random_draft(model, draft_vocab_size=20)
    draft.vocab_ids.copy_(torch.arange(100, 120))
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=16, progress=False))
    seen = []

    class Spy(LongSpecDrafter):
        def propose(self, context):
            tree = super().propose(context)
            seen.append(tree.tokens[1:])
            return tree

    prompt = random_ids(12, seed=4)[0]
    reference = run(engine, prompt, max_new_tokens=20)
    assert torch.equal(run(engine, prompt, Spy(draft, BeamStrategy((2, 4))), max_new_tokens=20), reference)
    drafted = torch.cat(seen)
    assert drafted.numel() and bool(((drafted >= 100) & (drafted < 120)).all())


def test_registered_methods_load_a_checkpoint_and_fail_clearly(tmp_path):
    from longspec.speculation.methods import make_drafter

    model = tiny_decoder("gemma3", dtype=torch.float64)
    path = save_draft(random_draft(model), tmp_path / "draft.safetensors")
    engine = SpeculativeEngine(model, EngineOptions(max_tree_nodes=24, progress=False))
    prompt = torch.cat([random_ids(5, seed=2)[0].repeat(3), random_ids(3, seed=4)[0]])
    reference = run(engine, prompt)
    for method in ("longspec", "longspec-chain", "longspec-cape", "longspec-ngram"):
        assert torch.equal(run(engine, prompt, make_drafter(method, checkpoint=path)), reference), method
    with pytest.raises(FileNotFoundError, match="draft weights not found at .*missing.safetensors"):
        make_drafter("longspec", checkpoint=tmp_path / "missing.safetensors")
    other = tiny_decoder("llama", dtype=torch.float64, hidden_size=96)

    class NoPrefill(SpeculativeEngine):
        def _prefill(self, ids, cache):
            raise AssertionError("prefill ran before the draft was checked against the target")

    with pytest.raises(DraftMismatchError, match="hidden size: draft 64 vs target 96"):
        run(NoPrefill(other, EngineOptions(progress=False)), prompt, make_drafter("longspec", checkpoint=path))


def test_retrieval_first_skips_the_draft_on_a_streak_and_stays_lossless():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=5, max_tree_nodes=24, progress=False))
    prompt = torch.cat([random_ids(7, seed=3)[0].repeat(4), random_ids(4, seed=9)[0]])
    reference = run(engine, prompt, max_new_tokens=60)

    class Counting(LongSpecDrafter):
        forwards = 0

        def _hidden(self, *args):
            self.forwards += 1
            return super()._hidden(*args)

    drafters = {}
    for streak in (None, 1, 0):
        drafter = Counting(random_draft(model), ChainStrategy(4), retrieval=PromptLookupDrafter(num_tokens=5),
                           retrieval_nodes=8, retrieval_streak=streak)
        assert torch.equal(run(engine, prompt, drafter, max_new_tokens=60), reference)
        drafters[streak] = drafter
    assert drafters[None].skipped_rounds == 0
    assert drafters[1].skipped_rounds > 0 and drafters[1].forwards < drafters[None].forwards
    # 0: the draft runs only in rounds where retrieval finds nothing.
    assert drafters[0].skipped_rounds >= drafters[1].skipped_rounds and drafters[0].forwards <= drafters[1].forwards


def test_retrieval_streak_is_validated():
    model = tiny_decoder("llama", dtype=torch.float64)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="retrieval_streak"):
            LongSpecDrafter(random_draft(model), ChainStrategy(2), retrieval=PromptLookupDrafter(), retrieval_streak=bad)


def test_cross_window_reads_only_the_sinks_and_the_newest_keys():
    """Target K/V outside the window and the sinks do not reach the draft; inside they do."""
    model = tiny_decoder("gemma3", dtype=torch.float64)
    draft = random_draft(model, cross_window=4, cross_sinks=2, recency_bias=True)
    prompt = random_ids(30, seed=5)[0]

    def root_logprobs(edit_position):
        cache = model.new_cache(64)
        model(prompt[:-1].unsqueeze(0), cache)
        cache.commit()
        if edit_position is not None:
            for layer in draft.config.target_layers:
                k, v = cache.prefix(layer)
                k[..., edit_position, :] += 1.0
                v[..., edit_position, :] -= 1.0
        drafter = LongSpecDrafter(draft, ChainStrategy(1))
        view = TargetView(model, cache)
        drafter.begin(DraftContext(prompt, view, 4))
        drafter.propose(DraftContext(prompt, view, 4))
        return drafter._root_logprobs

    untouched = root_logprobs(None)
    root = prompt.numel() - 1
    assert torch.equal(root_logprobs(10), untouched)  # between the sinks and the window
    for position in (0, 1, root - 4, root - 1):  # the sinks and the window's ends
        assert not torch.equal(root_logprobs(position), untouched)
