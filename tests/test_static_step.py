"""Static-shape decode and verify steps (`runtime.static_step`): the formulation a
compiler turns into one graph per bucket (CUDA graphs on a GPU) gives the eager
forward's logits, and generation through it returns the same tokens, for every
family, drafter and tree shape; a compiler that fails falls back to eager decoding.

The static formulation is tested uncompiled (fast, every case); one test compiles it
with inductor, which is what `gpu_check.py` runs on a GPU as CUDA graphs."""

from __future__ import annotations

import logging

import pytest
import torch

from longspec.runtime.device import available_devices
from longspec.runtime.static_step import CompileOptions
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree
from exactness import PROCESSORS, diverse_model, real_drafters
from tiny_models import FAMILIES, random_ids, tiny_decoder

OPTIONS = EngineOptions(prefill_chunk=8, max_tree_nodes=24, progress=False)
UNCOMPILED = CompileOptions(backend=None, buckets=(1, 4, 16, 25))


def repetitive_prompt(length: int = 60, seed: int = 0) -> torch.Tensor:
    """A prompt that repeats itself, so that lookup drafters propose long chains."""
    head = random_ids(length // 2, seed=seed)[0]
    return torch.cat([head, head[: length // 4], head])


def generate(model, prompt, drafter=None, *, params=SamplingParams(), seed=None, max_new_tokens=48):
    generator = None if seed is None else torch.Generator(device=model.device).manual_seed(seed)
    rounds = SpeculativeEngine(model, OPTIONS).generate(prompt, params=params, max_new_tokens=max_new_tokens,
                                                        drafter=drafter, generator=generator)
    return torch.cat(list(rounds))


def with_and_without_steps(model, run, options=UNCOMPILED):
    """run() eagerly, then through static steps; returns both results and the steps."""
    eager = run()
    model.compile_steps(options)
    try:
        steps = model.static_steps
        static = run()
    finally:
        model.compile_steps(False)
    return eager, static, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_static_forward_equals_eager_logits_for_chains_and_trees(family):
    model = tiny_decoder(family, dtype=torch.float64)
    prompt = random_ids(30, seed=3)[0]
    tree = Tree.from_parents(torch.tensor([5, 9, 11, 12, 9, 40, 41]), torch.tensor([-1, 0, 0, 1, 1, 2, 5]))

    def forwards():
        cache = model.new_cache(64, max_forward_tokens=32)
        model(prompt[:-1].unsqueeze(0), cache)
        cache.commit()
        outs = []
        for tokens, mask in ((prompt[-1:], None), (tree.tokens, tree.ancestor_mask())):
            positions = cache.length + (torch.zeros(1, dtype=torch.long) if mask is None else tree.depths)
            out = model(tokens.unsqueeze(0), cache, tree_mask=mask, positions=positions)
            outs.append(out)
            cache.commit(torch.tensor([0, 1, 3]) if mask is not None else None)
        return outs, cache

    (eager, eager_cache), (static, static_cache), steps = with_and_without_steps(model, forwards)
    assert steps.calls == 2
    for e, s in zip(eager, static):
        torch.testing.assert_close(s.logits, e.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(s.hidden, e.hidden, rtol=0, atol=1e-10)
    # The cache holds the same committed state: the padding tokens left nothing behind.
    assert static_cache.length == eager_cache.length and static_cache.pending == 0
    # Ring slots agree, except those the padding overwrote: forgotten (empty) there,
    # and in the eager cache they hold keys no query at the next position can see.
    differ = static_cache.ring_positions != eager_cache.ring_positions
    assert (static_cache.ring_positions[differ] < 0).all()
    if differ.any():
        assert (eager_cache.ring_positions[differ] <= eager_cache.length - model.config.sliding_window).all()
    end = static_cache.length
    torch.testing.assert_close(static_cache.full_k[..., :end, :], eager_cache.full_k[..., :end, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_through_static_steps_is_token_identical(family):
    model, _ = diverse_model(family)
    prompt = repetitive_prompt()
    for name, make in {"ar": lambda: None, **real_drafters(model)}.items():
        eager, static, steps = with_and_without_steps(model, lambda: generate(model, prompt, make()))
        assert torch.equal(static, eager), name
        assert steps.calls > 0


@pytest.mark.parametrize("processor", sorted(PROCESSORS))
def test_seeded_sampling_through_static_steps_is_identical(processor):
    model, _ = diverse_model("gemma3")
    prompt = repetitive_prompt(seed=1)
    params = PROCESSORS[processor]
    for drafter in (lambda: None, lambda: PromptLookupDrafter(num_tokens=5)):
        eager, static, _ = with_and_without_steps(
            model, lambda: generate(model, prompt, drafter(), params=params, seed=7))
        assert torch.equal(static, eager)


def test_bucket_choice_pads_up_and_leaves_uncovered_forwards_eager():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    model.compile_steps(CompileOptions(backend=None, buckets=(1, 4, 16)))
    steps = model.static_steps
    cache = model.new_cache(40, max_forward_tokens=8)
    assert steps.bucket(1, cache) == 1
    assert steps.bucket(3, cache) == 4
    assert steps.bucket(5, cache) is None  # 16 exceeds what one forward may add to this cache's rings
    cache.length = 38
    assert steps.bucket(2, cache) is None  # a bucket of 4 would overrun the capacity: eager
    assert steps.bucket(1, cache) == 1
    batch_cache = model.new_cache(40, batch_size=2)
    assert steps.bucket(1, batch_cache) is None  # batched rows run eagerly


def test_shrink_pending_forgets_the_padding():
    model = tiny_decoder("gemma3", dtype=torch.float64)
    cache = model.new_cache(64, max_forward_tokens=8)
    cache.begin_forward(torch.arange(6))
    cache.shrink_pending(2)
    assert cache.pending == 2 and cache.pending_ring_slots.tolist() == [0, 1]
    assert (cache.ring_positions[2:6] < 0).all()
    cache.commit()
    assert cache.length == 2 and cache.ring_positions[:2].tolist() == [0, 1]
    with pytest.raises(ValueError, match="shrink"):
        cache.shrink_pending(1)


def test_invalid_buckets_are_refused():
    for buckets in ((), (0, 4), (4, 1), (2, 2)):
        with pytest.raises(ValueError, match="buckets"):
            CompileOptions(buckets=buckets)


def failing_backend(graph, example_inputs):
    raise RuntimeError("this backend builds nothing")


def test_a_failing_compiler_falls_back_to_eager_with_a_logged_reason(caplog):
    model = tiny_decoder("gemma3", dtype=torch.float64)
    prompt = repetitive_prompt()
    with caplog.at_level(logging.WARNING, logger="longspec.runtime.static_step"):
        eager, static, steps = with_and_without_steps(
            model, lambda: generate(model, prompt, PromptLookupDrafter(num_tokens=5)),
            CompileOptions(backend=failing_backend, buckets=(1, 25)))
    assert torch.equal(static, eager)
    assert steps.calls == 0 and "builds nothing" in steps.failure
    assert "decoding continues eagerly" in caplog.text


@pytest.mark.parametrize("device", available_devices())
def test_compiled_steps_are_token_identical(device):
    """One real compile (inductor on the CPU; CUDA graphs on a GPU), reused by a
    second request of another length without compiling again."""
    torch._dynamo.reset()
    model = tiny_decoder("gemma3", dtype=torch.float32).place(torch.device(device))
    prompt = repetitive_prompt()
    options = CompileOptions.for_device(model.device, buckets=(25,))

    def two_requests():
        return [generate(model, prompt, PromptLookupDrafter(num_tokens=5)),
                generate(model, prompt[:50], PromptLookupDrafter(num_tokens=5), max_new_tokens=30)]

    # The counters are process-wide and `reset` leaves them: count this test's graphs only
    # (an earlier test in the same worker may have traced its own).
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager, static, steps = with_and_without_steps(model, two_requests, options)
    assert steps.failure is None and steps.calls > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # the other capacity reused it
    for e, s in zip(eager, static):
        assert torch.equal(s.cpu(), e.cpu())
