"""The suffix cache across requests (`speculation/drafters/suffix_cache/`): the index
(insert, lookup, eviction under its bound, concurrent use), its drafter, and the
outputs of `suffix` and of `auto` with the cache, which must be plain decoding's
token for token (float64 tiny models), in one sequence and in a batch, greedy and
seeded; the model-level cache fed by `generate` and `generate_batch`."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import longspec
from longspec.api import LongSpecModel
from longspec.runtime.loading import LoadedTarget
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.copied_tree import copied_runs
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.drafters.adaptive import AdaptiveDrafter
from longspec.speculation.drafters.base import DraftContext, container_nbytes
from longspec.speculation.drafters.suffix_cache import SuffixCache, SuffixCacheDrafter
from longspec.speculation.engine import SpeculativeEngine
from longspec.speculation.methods import accepted_options, make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from exactness import OPTIONS, PROCESSORS, diverse_model, single_run
from tiny_models import decoder_from_hf, random_ids, tiny_hf_model


def cheap_trees_cost() -> ForwardCost:
    """A machine where a tree costs little more than one token: auto verifies deep trees."""
    ks = (1, 2, 4, 8, 16, 32, 64)
    return ForwardCost({}, ks, tuple(0.01 * (1 + 0.02 * (k - 1)) for k in ks))


# ------------------------------------------------------------------ the index
def test_lookup_returns_what_followed_the_longest_ngram_with_its_run():
    cache = SuffixCache(1 << 20)
    cache.insert([7, 8], [1, 2, 3, 4, 5, 6])
    cache.insert([9], [3, 4, 20, 21])
    # "2 3 4" (n = 3) was seen once: its continuation wins over the newer "3 4"
    assert cache.lookup([50, 1, 2, 3, 4], limit=2) == [([5, 6], 4)]
    # only "3 4" matches: one vote each, the newer first; both are candidates with their runs
    assert cache.lookup([60, 3, 4], limit=3, max_candidates=2) == [([20, 21], 2), ([5, 6], 2)]
    # one token (min_ngram = 1) still finds what followed it
    assert cache.lookup([99, 4], limit=3) == [([20, 21], 1)]
    assert SuffixCache(1 << 20, min_ngram=2).lookup([99, 4], limit=3) == []
    assert cache.lookup([1, 2], limit=0) == []
    # a prompt's tail predicts the output's start
    assert cache.lookup([7, 8], limit=3) == [([1, 2, 3], 2)]


def test_the_same_sequence_is_kept_once():
    cache = SuffixCache(1 << 20)
    for _ in range(5):
        cache.insert([1, 2], [3, 4, 5])
    assert len(cache) == 1 and cache.stats()["duplicates"] == 4
    assert cache.lookup([1, 2, 3], limit=2) == [([4, 5], 3)]


def test_the_occurrences_vote_token_by_token():
    cache = SuffixCache(1 << 20, max_ngram=2)
    cache.insert([], [1, 5, 6, 7, 8])  # agrees with the suffix 4 tokens back
    cache.insert([], [2, 6, 7, 9, 9])
    cache.insert([], [4, 6, 7, 9, 9, 0])  # the same continuation twice
    cache.insert([], [3, 6, 7, 9, 10])  # the newest
    # "6 7" occurs 4 times: 9 follows in 3 of them (then 9 in 2 of those 3), 8 in 1
    assert cache.lookup([1, 5, 6, 7], limit=2, max_candidates=3) == [([9, 9], 2), ([8], 4)]
    # the chain goes on while the product of the majorities is >= min_probability:
    # 9 (3 of 4), 9 (2 of 3), 0 (1 of 1) keeps 0.5
    assert cache.lookup([0, 6, 7], limit=4) == [([9, 9, 0], 2)]
    strict = SuffixCache(1 << 20, max_ngram=2, min_probability=0.6)
    for tokens in ([1, 5, 6, 7, 8], [2, 6, 7, 9, 9], [4, 6, 7, 9, 9, 0], [3, 6, 7, 9, 10]):
        strict.insert([], tokens)
    assert strict.lookup([0, 6, 7], limit=4) == [([9], 2)]  # 0.75 * 2/3 < 0.6: it stops before the split
    # among equal votes, the newest occurrence's token
    tie = SuffixCache(1 << 20)
    tie.insert([], [1, 2, 3])
    tie.insert([], [1, 2, 4])
    assert tie.lookup([1, 2], limit=2) == [([4], 2)]


def test_a_template_is_copied_to_where_earlier_requests_differ():
    """Records of one shape with other values: the copy runs through the fixed text and
    stops before a value, where the newest record's own value used to be copied."""
    cache = SuffixCache(1 << 20)
    for value in (50, 51, 52):
        cache.insert([], [10, 11, 12, 13, 14, value, 15, 16, 17, 18])
    assert cache.lookup([10, 11], limit=8) == [([12, 13, 14], 2)]
    # past the value: the fixed text again, from the token after it (n = 1)
    assert cache.lookup([60], limit=8) == []
    assert cache.lookup([53, 15], limit=8) == [([16, 17, 18], 1)]


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True])
def test_a_bad_min_probability_fails(bad):
    with pytest.raises(ValueError, match="min_probability"):
        SuffixCache(1 << 20, min_probability=bad)


@pytest.mark.parametrize("bad", [-1, -0.5, "8", True, float("nan")])
def test_a_bad_size_fails_naming_the_fix(bad):
    with pytest.raises(ValueError, match="0 turns"):
        SuffixCache.of_megabytes(bad)
    if not isinstance(bad, float):
        with pytest.raises(ValueError, match="0 turns"):
            SuffixCache(bad)
    assert SuffixCache.of_megabytes(0) is None


def test_load_refuses_a_negative_size_before_loading_anything(tmp_path):
    with pytest.raises(ValueError, match="suffix cache size"):
        longspec.load(tmp_path / "does-not-exist", suffix_cache_mb=-1)


def measured_bytes(cache: SuffixCache) -> int:
    return container_nbytes((cache._sequences, cache._digests, cache._index)) + sum(
        t.buffer_info()[1] * t.itemsize for t in cache._sequences.values())


def test_memory_stays_under_the_bound_evicting_the_oldest():
    budget = 200_000
    cache = SuffixCache(budget)
    rng = random.Random(0)
    sequences = [[rng.randrange(50_000) for _ in range(rng.randrange(20, 200))] for _ in range(200)]
    for tokens in sequences:
        cache.insert([], tokens)
        assert cache.nbytes() <= budget
        assert measured_bytes(cache) <= budget  # the estimate bounds the structures' real size
    assert cache.stats()["evicted"] > 100
    assert cache.lookup(sequences[0][:4], limit=4) == []  # the oldest is gone
    assert cache.lookup(sequences[-1][:4], limit=4) == [(sequences[-1][4:8], 4)]
    total = sum(len(o) for o in cache._index.values())
    assert total == cache._occurrences  # the count the bound is computed from


def test_a_sequence_larger_than_the_cache_keeps_its_tail():
    cache = SuffixCache(20_000)
    tokens = list(range(1000, 3000))
    cache.insert([], tokens)
    assert 0 < cache.stats()["tokens"] < len(tokens) and cache.nbytes() <= 20_000
    assert cache.lookup(tokens[-10:-6], limit=2) == [(tokens[-6:-4], 4)]


def test_concurrent_inserts_and_lookups():
    cache = SuffixCache(300_000)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                cache.insert([rng.randrange(100)], [rng.randrange(100) for _ in range(rng.randrange(5, 60))])
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                for chain, run in cache.lookup([rng.randrange(100) for _ in range(6)], limit=8, max_candidates=3):
                    assert 1 <= len(chain) <= 8 and run >= cache.min_ngram
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=reader, args=(10 + i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sum(len(o) for o in cache._index.values()) == cache._occurrences
    assert cache.nbytes() <= 300_000 and measured_bytes(cache) <= 300_000
    for occurrences in cache._index.values():  # every occurrence points at a kept sequence, oldest first
        ids = [packed >> 32 for packed in occurrences]
        assert ids == sorted(ids) and all(i in cache._sequences for i in ids)


# ---------------------------------------------------------------- the drafter
def test_the_drafter_proposes_copied_chains_within_the_budget():
    cache = SuffixCache(1 << 20)
    cache.insert([], [1, 2, 3, 4, 5, 6, 7, 8])
    cache.insert([], [2, 3, 9, 9])
    drafter = SuffixCacheDrafter(cache, num_tokens=4, max_candidates=2)
    # "1 2 3" occurs once: what followed it alone
    context = DraftContext(torch.tensor([40, 1, 2, 3]), max_nodes=3)
    drafter.begin(context)
    tree = drafter.propose(context)
    assert tree.tokens.tolist() == [3, 4, 5, 6] and tree.size - 1 <= 3
    assert copied_runs(tree).tolist() == [0, 3, 4, 5]
    # "2 3" occurs twice: both continuations, the newest first
    tree = drafter.propose(DraftContext(torch.tensor([40, 2, 3]), max_nodes=5))
    assert tree.tokens.tolist() == [3, 9, 9, 4, 5, 6] and tree.size - 1 <= 5
    assert copied_runs(tree).tolist() == [0, 2, 3, 2, 3, 4]
    assert SuffixCacheDrafter(None).propose(context).size == 1  # the model's cache off: nothing
    with pytest.raises(ValueError, match="SuffixCache"):
        SuffixCacheDrafter("cache")


def test_methods_take_the_models_cache_never_a_users_option():
    cache = SuffixCache(1 << 20)
    assert "cache" not in accepted_options("suffix") and "suffix_cache" not in accepted_options("auto")
    assert make_drafter("suffix", suffix_cache=cache).cache is cache
    assert [c.name for c in make_drafter("auto", suffix_cache=cache).components] == ["pld", "suffix"]
    assert [c.name for c in make_drafter("auto").components] == ["pld"]  # no cache: as before
    alone = make_drafter("auto", components="pld,suffix")
    assert [c.name for c in alone.components] == ["pld"] and "suffix" in alone.telemetry_state.unavailable
    with pytest.raises(ValueError, match="no option cache"):
        make_drafter("suffix", cache=cache)


# ---------------------------------------------------------------- exactness
def cache_of(*runs: tuple[torch.Tensor, torch.Tensor]) -> SuffixCache:
    cache = SuffixCache(1 << 22)
    for prompt, output in runs:
        cache.insert(prompt.tolist(), output.tolist())
    return cache


def auto_with(cache: SuffixCache) -> AdaptiveDrafter:
    return AdaptiveDrafter([("pld", PromptLookupDrafter(num_tokens=12, continue_copies=True, longest_run=True)),
                            ("suffix", SuffixCacheDrafter(cache, num_tokens=16, max_candidates=2))],
                           forward_cost=cheap_trees_cost())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_suffix_and_auto_with_the_cache_equal_plain_decoding(family):
    model, extra = diverse_model(family)
    params = SamplingParams(**extra)
    prompts = [random_ids(24, seed=s)[0] for s in (1, 2)]
    references = [single_run(model, p, params=params, max_new_tokens=60) for p in prompts]
    # The cache holds the first prompt's output and a corrupted copy of it (drafts that
    # break off), and a second request repeats the first prompt: drafts are accepted.
    corrupted = references[0].clone()
    corrupted[20:] = (corrupted[20:] + 1) % model.config.vocab_size
    cache = cache_of((prompts[0], corrupted), (prompts[0], references[0]))
    for prompt, reference in zip(prompts, references):
        for name, drafter in (("suffix", SuffixCacheDrafter(cache, num_tokens=8, max_candidates=2)),
                              ("auto", auto_with(cache)), ("auto-default", make_drafter("auto", suffix_cache=cache))):
            out = single_run(model, prompt, drafter=drafter, params=params, max_new_tokens=60)
            assert torch.equal(out, reference), f"{name} on {family}"
    stats = GenerationStats()
    rounds = SpeculativeEngine(model, OPTIONS).generate(prompts[0], params=params, max_new_tokens=60,
                                                        drafter=SuffixCacheDrafter(cache), stats=stats)
    assert torch.equal(torch.cat(list(rounds)), references[0])
    assert stats.accepted_tokens > 30  # the repeated request was drafted from the cache


def test_batched_rows_with_the_cache_equal_their_single_runs():
    model, extra = diverse_model("qwen2")
    params = SamplingParams(**extra)
    prompts = [random_ids(20, seed=s)[0] for s in (3, 4, 5)]
    references = [single_run(model, p, params=params, max_new_tokens=50) for p in prompts]
    cache = cache_of((prompts[0], references[0]), (prompts[1], references[1][:25]))
    batch = BatchEngine(model, OPTIONS, BatchOptions(max_rows=3, row_capacity=128))
    handles = [batch.submit(p, params=params, max_new_tokens=50, drafter=d)
               for p, d in zip(prompts, (SuffixCacheDrafter(cache, max_candidates=2), auto_with(cache),
                                         auto_with(cache)))]
    batch.run()
    for handle, reference in zip(handles, references):
        assert torch.equal(handle.tokens, reference)


@pytest.mark.parametrize("processor", ["temperature", "top_p"])
def test_seeded_sampling_with_the_cache_equals_seeded_plain_decoding(processor):
    model, _ = diverse_model("llama")
    params = PROCESSORS[processor]
    prompt = random_ids(24, seed=6)[0]
    reference = single_run(model, prompt, params=params, max_new_tokens=80, seed=11)
    other_seed = single_run(model, prompt, params=params, max_new_tokens=80, seed=12)
    cache = cache_of((prompt, reference), (prompt, other_seed))
    for drafter in (SuffixCacheDrafter(cache, max_candidates=2), auto_with(cache)):
        assert torch.equal(single_run(model, prompt, drafter=drafter, params=params, max_new_tokens=80, seed=11),
                           reference)


# ---------------------------------------------------------------- the model's cache
def tiny_model(**keywords) -> LongSpecModel:
    hf = tiny_hf_model("llama", dtype=torch.float64)
    return LongSpecModel(LoadedTarget(decoder_from_hf(hf, torch.float64), None, hf.config, "tiny"), OPTIONS,
                         **keywords)


def test_generate_and_generate_batch_feed_the_models_cache():
    model = tiny_model()
    prompt = random_ids(16, seed=7)[0].tolist()
    plain = model.generate(prompt, method="ar", max_new_tokens=40, ignore_eos=True)
    assert len(model.suffix_cache) == 1  # every finished request feeds it, whatever its method
    again = model.generate(prompt, method="auto", max_new_tokens=40, ignore_eos=True)
    assert again.token_ids == plain.token_ids
    assert again.stats.controller["calls"].get("suffix", 0) > 0
    batch = model.generate_batch([prompt, random_ids(16, seed=8)[0].tolist()], method="suffix", max_new_tokens=40,
                                 ignore_eos=True)
    assert batch[0].token_ids == plain.token_ids
    assert batch[0].stats.accepted_tokens > 20
    assert len(model.suffix_cache) == 2  # the repeated output is kept once, the new one added
    off = tiny_model(suffix_cache=None)
    assert off.generate(prompt, method="auto", max_new_tokens=40, ignore_eos=True).token_ids == plain.token_ids
    assert off.suffix_cache is None
