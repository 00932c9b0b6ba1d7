"""Exactness helpers: models and sampling processors under which long runs stay
non-degenerate, every shipped drafter with random weights, runs that keep the
engine's KV cache and the comparison of two caches position by position, and plain
single-sequence runs to compare batched or speculative output with."""

from __future__ import annotations

import torch

from longspec.runtime.cache import KVCache
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.longspec import BeamStrategy, CapeStrategy, ChainStrategy, LongSpecDrafter
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams
from oracles import random_draft
from tiny_models import tiny_decoder

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
    "typical_p": SamplingParams(temperature=1.0, typical_p=0.7),
    "penalty": SamplingParams(temperature=1.0, penalty=1.8, penalty_window=48),
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=0.9, frequency_penalty=1.2, presence_penalty=-0.5),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={3: 4.0, 7: -100.0, 40: 2.5}),
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


# The engine options of `single_run` (tests/test_batch_engine.py's batches use the same).
OPTIONS = EngineOptions(progress=False, max_tree_nodes=24, prefill_chunk=16)


def single_run(model, prompt, *, drafter=None, params=SamplingParams(), max_new_tokens, seed=None, eos=()):
    engine = SpeculativeEngine(model, OPTIONS)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    rounds = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter,
                             generator=generator, eos_token_ids=eos)
    return torch.cat(list(rounds))


def run(engine, prompt, drafter=None, params=SamplingParams(), max_new_tokens=40, stats=None, generator=None):
    rounds = engine.generate(prompt, params=params, max_new_tokens=max_new_tokens, drafter=drafter, stats=stats, generator=generator)
    return torch.cat(list(rounds))
