"""Speculation on a quantized target (layer products in GGUF's formats, `runtime.quantized`)
returns plain decoding's tokens of that quantized model bit for bit: AR against prompt
lookup, n-grams, `auto` and adversarial trees, greedy and seeded, in one sequence and in a
batch. The quantized product gives a row the same bits whatever rows share its call, which
with the ordered attention makes a token verified in a tree the token decoded alone.

Tiny bf16 models whose layer weights are quantized: all Q8_0, and a Q4_K_M-like mix (Q5_0
and Q8_0 q/k/v, Q4_K output and gate/up, Q6_K down)."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.native import attention_ops, native_ops
from longspec.runtime.quantized import segment, stacked
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from exactness import DIVERSE, Run, assert_same_caches, single_run
from oracles import OracleGarbageDrafter
from quantized_blocks import Q4_K, Q5_0, Q6_K, Q8_0, quantize
from tiny_models import random_ids, tiny_decoder

pytestmark = pytest.mark.skipif(native_ops() is None or attention_ops() is None,
                                reason="native kernels unavailable here (reason logged)")

TOKENS = 300
SETTINGS = {"greedy": {}, "seeded": dict(temperature=1.0, top_p=0.9)}
# Weight scales at which these 256-wide models' greedy runs do not fall into a short loop.
WIDE_INIT = {"gemma3": 0.02, "llama": 0.1}
# Per product, the formats of its parts (q, k, v; gate, up).
MIXES = {
    "Q8_0": {"qkv_weight": (Q8_0, Q8_0, Q8_0), "o_weight": (Q8_0,), "gate_up_weight": (Q8_0, Q8_0), "down_weight": (Q8_0,)},
    "Q4_K_M": {"qkv_weight": (Q5_0, Q5_0, Q8_0), "o_weight": (Q4_K,), "gate_up_weight": (Q4_K, Q4_K),
               "down_weight": (Q6_K,)},
}


def quantized_model(family: str, mix: str):
    """A tiny bf16 decoder whose layer products run its own weights quantized (256 wide:
    K formats need rows of 256 values)."""
    init, extra = WIDE_INIT[family], DIVERSE[family][1]
    model = tiny_decoder(family, dtype=torch.bfloat16, head_dim=32, hidden_size=256, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=init)
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    splits = {"qkv_weight": (q, kv, kv), "o_weight": (c.hidden_size,),
              "gate_up_weight": (c.intermediate_size, c.intermediate_size), "down_weight": (c.hidden_size,)}
    for index, layer in enumerate(model.layers):
        for name, kinds in MIXES[mix].items():
            weight = getattr(layer, name).float()
            parts, begin = [], 0
            for part, (kind, rows) in enumerate(zip(kinds, splits[name])):
                rows_of = weight[begin : begin + rows].numpy()
                begin += rows
                cols = rows_of.shape[1]
                raw = quantize(kind, rows_of)
                parts.append(segment(f"blk.{index}.{name}.{part}", kind, raw, rows, cols))
            layer.quantized[name] = stacked(parts, weight.shape[1])
    model.prepare()
    assert all(p.quantized is not None for layer in model.layers for p in layer.packed.values())
    return model, extra


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("family", ("gemma3", "llama"))
def test_speculation_on_a_quantized_target_returns_plain_decodings_tokens(family, mix, setting):
    model, extra = quantized_model(family, mix)
    params = SamplingParams(**extra, **SETTINGS[setting])
    engine = SpeculativeEngine(model, EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False))
    prompt = random_ids(30, seed=len(family))[0] % 40  # a small alphabet: copies for the lookup drafters
    reference = Run(engine, prompt, params=params, max_new_tokens=TOKENS, seed=3)
    assert len(set(reference.tokens.tolist())) > 10  # not a short loop
    drafters = {
        "oracle": OracleGarbageDrafter(reference.tokens, prompt.numel(), seed=5),
        "pld": PromptLookupDrafter(num_tokens=6),
        "ngram": NgramDrafter(k=3),
        "auto": make_drafter("auto"),
    }
    for name, drafter in drafters.items():
        run = Run(engine, prompt, params=params, max_new_tokens=TOKENS, seed=3, drafter=drafter)
        assert torch.equal(run.tokens, reference.tokens), name
        assert_same_caches(reference.cache, run.cache)  # every K/V value, bit for bit
        assert run.stats.tau > 1.2 or name != "oracle"  # deep trees were accepted


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_batch_rows_on_a_quantized_target_equal_their_single_runs(mix):
    model, extra = quantized_model("gemma3", mix)
    for setting in SETTINGS.values():
        params = SamplingParams(**extra, **setting)
        drafters = [lambda: None, lambda: PromptLookupDrafter(num_tokens=5), lambda: NgramDrafter(k=3),
                    lambda: make_drafter("auto")]
        prompts = [random_ids(5 + 9 * i, seed=i)[0] % 24 for i in range(5)]
        max_new = [60 + 31 * i for i in range(len(prompts))]
        options = EngineOptions(prefill_chunk=16, max_tree_nodes=24, progress=False)  # single_run's
        engine = BatchEngine(model, options, BatchOptions(max_rows=3, row_capacity=320, prefill_tokens_per_step=16))
        handles = [engine.submit(p, params=params, max_new_tokens=n, generator=torch.Generator().manual_seed(7),
                                 drafter=drafters[i % len(drafters)]())
                   for i, (p, n) in enumerate(zip(prompts, max_new))]
        engine.run()
        for prompt, n, handle in zip(prompts, max_new, handles):
            assert torch.equal(handle.tokens, single_run(model, prompt, params=params, max_new_tokens=n, seed=7))


def test_the_quantized_target_is_not_the_dequantized_one():
    """The quantized products are the target: the bf16 parameters beside them (the
    dequantized copies) are not what a forward reads."""
    model, _ = quantized_model("llama", "Q4_K_M")
    cache = model.new_cache(64)
    ids = random_ids(12, seed=1)
    ours = model(ids, cache).logits
    for layer in model.layers:
        layer.quantized = {}
    model.prepare()
    assert not torch.equal(ours, model(ids, model.new_cache(64)).logits)
