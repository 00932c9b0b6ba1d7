"""The native layer steps (`kernels/layer_steps.cpp`) with GGUF quantized products: a layer's
`project` and `finish` as one native call each give the bits of the unfused quantized layer
(the same products, norms, RoPE and activations as separate calls), for 1-64 rows, one or
two sequences, a layer mixing quantized and bf16 products, and whole forwards (decode steps,
a verified tree, prefill pieces) down to every K/V value."""

from __future__ import annotations

import pytest
import torch

from longspec.runtime.native import attention_ops, native_ops
from longspec.runtime.quantized import segment, stacked
from quantized_blocks import Q4_K, Q5_0, Q6_K, Q8_0, quantize
from tiny_models import random_ids, tiny_decoder

pytestmark = pytest.mark.skipif(native_ops() is None or attention_ops() is None,
                                reason="native kernels unavailable here (reason logged)")

# Per product, the formats of its parts (q, k, v; gate, up): Gemma 3 270M Q4_K_M's mix.
Q4_K_M = {"qkv_weight": (Q5_0, Q5_0, Q8_0), "o_weight": (Q4_K,), "gate_up_weight": (Q5_0, Q5_0),
          "down_weight": (Q6_K,)}
ROWS = (1, 2, 5, 16, 33, 64)


def quantized_decoder(family: str, keep_bf16: tuple[str, ...] = ()):
    """A tiny bf16 decoder (256 wide: K formats need rows of 256 values) whose layer products
    run its own weights quantized, but for the products named in keep_bf16."""
    model = tiny_decoder(family, dtype=torch.bfloat16, head_dim=32, hidden_size=256, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.05)
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    splits = {"qkv_weight": (q, kv, kv), "o_weight": (c.hidden_size,),
              "gate_up_weight": (c.intermediate_size, c.intermediate_size), "down_weight": (c.hidden_size,)}
    for index, layer in enumerate(model.layers):
        for name, kinds in Q4_K_M.items():
            if name in keep_bf16:
                continue
            weight = getattr(layer, name).float().numpy()
            parts, begin = [], 0
            for part, (kind, rows) in enumerate(zip(kinds, splits[name])):
                parts.append(segment(f"blk.{index}.{name}.{part}", kind, quantize(kind, weight[begin : begin + rows]),
                                     rows, weight.shape[1]))
                begin += rows
            layer.quantized[name] = stacked(parts, weight.shape[1])
    return model.prepare()


def unfused(decoder, run):
    """run() with every layer's native steps off: the unfused path, product by product."""
    steps = [layer.native_steps for layer in decoder.layers]
    for layer in decoder.layers:
        layer.native_steps = None
    try:
        with torch.inference_mode():
            return run()
    finally:
        for layer, ops in zip(decoder.layers, steps):
            layer.native_steps = ops


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2"])  # Gemma's norms and q/k norm; plain; q/k/v bias
@pytest.mark.parametrize("keep_bf16", [(), ("o_weight",)])
def test_the_fused_quantized_layer_is_the_unfused_layers_bits(family, keep_bf16):
    decoder = quantized_decoder(family, keep_bf16)
    c = decoder.config
    generator = torch.Generator().manual_seed(len(family) + len(keep_bf16))
    for layer in decoder.layers:
        assert layer.native_steps is not None
        for name, (_, kinds, _) in layer.step_weights.items():  # the bf16 tiles' kind is -1
            assert (kinds == [-1]) == (name in keep_bf16) and (name in keep_bf16 or -1 not in kinds)
        for batch, rows in [(1, n) for n in ROWS] + [(2, 7)]:
            x = torch.randn(batch, rows, c.hidden_size, generator=generator).bfloat16()
            attn = torch.randn(batch, c.num_heads, rows, c.head_dim, generator=generator).bfloat16()
            rope = decoder._rope(torch.arange(11, 11 + rows), layer.sliding)
            with torch.inference_mode():
                fused = layer.project(x, rope)
            for ours, theirs in zip(fused, unfused(decoder, lambda layer=layer, x=x, rope=rope: layer.project(x, rope))):
                assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
                assert torch.equal(ours, theirs), (batch, rows)
            with torch.inference_mode():
                fused = layer.finish(x, attn)
            theirs = unfused(decoder, lambda layer=layer, x=x, attn=attn: layer.finish(x, attn))
            assert fused.shape == (batch, rows, c.hidden_size) and torch.equal(fused, theirs), (batch, rows)
            # A prefill's products are a step's for a quantized weight: the fused call runs them too.
            with torch.inference_mode():
                assert torch.equal(layer.finish(x, attn, bulk=True), theirs)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_whole_forwards_leave_the_unfused_caches_and_logits(family):
    """A prefill in pieces, decode steps and a verified tree: logits and every K/V value equal."""
    decoder = quantized_decoder(family)
    assert all(layer.native_steps is not None and layer.native_prefill for layer in decoder.layers)
    prompt = random_ids(40, seed=2)
    tree = torch.tensor([[True, False, False, False], [True, True, False, False], [True, False, True, False],
                         [True, True, False, True]])

    def run():
        cache = decoder.new_cache(128, max_forward_tokens=64)
        outputs = []
        for begin in range(0, 40, 16):
            outputs.append(decoder(prompt[:, begin : begin + 16], cache, prefill=True).logits)
            cache.commit()
        for token in (5, 9, 17):
            outputs.append(decoder(torch.tensor([[token]]), cache).logits)
            cache.commit()
        outputs.append(decoder(torch.tensor([[3, 8, 21, 4]]), cache, tree_mask=tree).logits)
        cache.commit(torch.tensor([0, 1, 3]))
        return outputs, cache

    with torch.inference_mode():
        fused, fused_cache = run()
    plain, plain_cache = unfused(decoder, run)
    for ours, theirs in zip(fused, plain):
        assert torch.equal(ours, theirs)
    assert fused_cache.length == plain_cache.length == 46
    for buffer in ("full_k", "full_v", "ring_k", "ring_v"):
        assert torch.equal(getattr(fused_cache, buffer), getattr(plain_cache, buffer)), buffer


def test_a_malformed_step_weight_is_refused_before_work():
    decoder = quantized_decoder("llama")
    layer = decoder.layers[0]
    c = decoder.config
    parts, kinds, rows = layer.step_weights["qkv_weight"]
    x = torch.randn(1, c.hidden_size).bfloat16()
    rope = decoder._rope(torch.arange(1), layer.sliding)
    args = (x, 1, layer._norm_scale(layer.input_norm))
    tail = (None, None, c.num_heads, c.num_kv_heads, c.head_dim, *rope, 1e-6, False)
    with pytest.raises(RuntimeError, match="one kind and one row count per part"):
        native_ops().layer_head(*args, parts, kinds[:-1], rows, *tail)
    with pytest.raises(RuntimeError, match="output rows where the heads need"):
        native_ops().layer_head(*args, parts[:1], kinds[:1], rows[:1], *tail)


def test_a_quantized_model_runs_its_steps_eagerly_under_compiled_steps():
    """The compiled step is PyTorch operations only: a quantized model keeps the fused native
    steps (eager), the same logits as without compiled steps."""
    from longspec.runtime.static_step import CompileOptions

    decoder = quantized_decoder("gemma3")
    ids = random_ids(5, seed=4)
    with torch.inference_mode():
        eager = decoder(ids, decoder.new_cache(64)).logits
        decoder.compile_steps(CompileOptions(backend=None))
        assert torch.equal(decoder(ids, decoder.new_cache(64)).logits, eager)
    assert decoder.static_steps.calls == 0
