"""Speculative decoding in bfloat16 returns plain decoding's tokens bit for bit.

Where the native kernels serve the target (a CPU with AVX-512 BF16, or AVX2 with FMA),
a token's forward is the same arithmetic whatever else the forward holds: the products
give a row the same bits alone or beside others (`runtime.linear`), and attention
reads keys listed by position (`runtime.ordered_keys`), so a token verified inside a
tree, beside siblings it does not see, gets exactly the bits it gets when decoded alone. Then no near-tie can
be rounded differently, and speculative runs equal AR runs token for token and cache
bit for cache bit, greedy and seeded, single and batched.

Tiny random models in bf16, head dimension 32 (the kernel's register width), runs long
enough to cross several blocks (64 positions) and chunks (128 / 512 positions) of the
kernel; trees of every shape from the adversarial oracle, and prompt lookup.
"""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.native import attention_ops
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from exactness import DIVERSE, Run, assert_same_caches, single_run
from oracles import OracleGarbageDrafter
from tiny_models import random_ids, tiny_decoder

pytestmark = pytest.mark.skipif(attention_ops() is None, reason="native bf16 kernels unavailable here (reason logged)")

# Full and sliding layers; full layers only; sliding layers only.
BF16_FAMILIES = ("gemma3", "llama", "mistral")
TOKENS = 700  # past the first 512-position chunk of full layers
SETTINGS = {"greedy": {}, "seeded": dict(temperature=1.0, top_p=0.9)}


def bf16_model(family: str):
    init, extra = DIVERSE[family]
    model = tiny_decoder(family, dtype=torch.bfloat16, head_dim=32, max_position_embeddings=4096, initializer_range=init)
    return model, extra


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_speculation_returns_plain_decodings_bits(family, setting):
    model, extra = bf16_model(family)
    #  # decode steps and trees take the ordered kernel
    params = SamplingParams(**extra, **SETTINGS[setting])
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False))
    prompt = random_ids(30, seed=BF16_FAMILIES.index(family))[0]
    reference = Run(engine, prompt, params=params, max_new_tokens=TOKENS, seed=3)
    assert reference.tokens.numel() == TOKENS
    assert len(set(reference.tokens.tolist())) > 20  # not a short loop
    drafters = {
        "oracle": OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=5),
        "pld": PromptLookupDrafter(num_tokens=6),
    }
    for name, drafter in drafters.items():
        run = Run(engine, prompt, params=params, max_new_tokens=TOKENS, seed=3, drafter=drafter)
        assert torch.equal(run.tokens, reference.tokens), name
        assert_same_caches(reference.cache, run.cache)  # every K/V value, bit for bit
        assert run.stats.tau > 1.2 or name != "oracle"  # deep trees were accepted


@pytest.mark.parametrize("family", ("gemma3", "llama"))
def test_bf16_batch_rows_equal_their_single_runs(family):
    """Rows of different lengths, drafters and trees share forwards and join as others
    finish; each equals its own single run, which equals AR."""
    model, extra = bf16_model(family)
    params = SamplingParams(**extra)
    drafters = [lambda: None, lambda: PromptLookupDrafter(num_tokens=5), lambda: NgramDrafter(k=3)]
    prompts = [random_ids(5 + 9 * i, seed=i)[0] % 24 for i in range(5)]
    max_new = [60 + 31 * i for i in range(len(prompts))]
    options = EngineOptions(prefill_chunk=16, max_tree_nodes=16, progress=False)
    engine = BatchEngine(model, options, BatchOptions(max_rows=3, row_capacity=320, prefill_tokens_per_step=16))
    handles = [engine.submit(p, params=params, max_new_tokens=n, drafter=drafters[i % len(drafters)]())
               for i, (p, n) in enumerate(zip(prompts, max_new))]
    engine.run()
    for prompt, n, handle in zip(prompts, max_new, handles):
        assert torch.equal(handle.tokens, single_run(model, prompt, params=params, max_new_tokens=n))


def test_prefill_through_the_bulk_products_keeps_speculation_and_batches_exact(monkeypatch):
    """Where prefill's products take oneDNN's copy (AMX CPUs; forced here on any CPU), AR
    and speculation prefill alike, and a batch row prefills in its single run's pieces."""
    from longspec.runtime import linear

    monkeypatch.setattr(linear, "bulk_products_pay", lambda: True)
    model, extra = bf16_model("llama")
    if not any(p.bulk is not None for p in model.layers[0].packed.values()):
        pytest.skip("oneDNN declines bf16 here")
    params = SamplingParams(**extra)
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=16, progress=False))
    prompt = random_ids(40, seed=9)[0]
    reference = Run(engine, prompt, params=params, max_new_tokens=200)
    run = Run(engine, prompt, params=params, max_new_tokens=200,
              drafter=OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=2))
    assert torch.equal(run.tokens, reference.tokens) and run.stats.tau > 1.2
    assert_same_caches(reference.cache, run.cache)
    batch = BatchEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=16, progress=False),
                        BatchOptions(max_rows=2, row_capacity=320, prefill_tokens_per_step=16))
    prompts = [random_ids(20 + 13 * i, seed=i)[0] for i in range(3)]
    handles = [batch.submit(p, params=params, max_new_tokens=50, drafter=PromptLookupDrafter(num_tokens=4))
               for p in prompts]
    batch.run()
    for prompt, handle in zip(prompts, handles):  # single runs prefilled in the same 16-token pieces
        assert torch.equal(handle.tokens, Run(engine, prompt, params=params, max_new_tokens=50).tokens)


def test_a_model_too_large_for_another_copy_keeps_prefill_on_the_native_kernel(monkeypatch):
    from longspec.runtime import linear

    monkeypatch.setattr(linear, "bulk_products_pay", lambda: True)
    monkeypatch.setattr("longspec.runtime.model.os.sysconf", lambda name: 1)  # a machine of one byte
    model, _ = bf16_model("llama")
    assert all(p.bulk is None for layer in model.layers for p in layer.packed.values() if p is not None)
