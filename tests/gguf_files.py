"""Whole tiny models written as GGUF files with the `gguf` package (every tensor a model
needs, in chosen formats), for the quantized target read from the file directly
(`runtime.gguf_reading`). Weights are random; the file stores them as llama.cpp does
(Gemma's norms as 1 + w; Llama's q/k rows as they are, the reader reorders them)."""

from __future__ import annotations

import numpy as np
from quantized_blocks import Q4_K, Q5_0, Q6_K, Q8_0, quantize
from tiny_models import tiny_config

F32 = 0
SHAPE = {"head_dim": 32, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}
# Per layer tensor, its format: a Q4_K_M-like mix.
LAYER_KINDS = {"attn_q": Q5_0, "attn_k": Q5_0, "attn_v": Q8_0, "attn_output": Q4_K, "ffn_gate": Q4_K, "ffn_up": Q4_K,
               "ffn_down": Q6_K}
INIT = {"gemma3": 0.02, "llama": 0.1}  # weight scales whose greedy runs do not fall into a short loop


def hf_config(family: str, vocab: int = 300):
    return tiny_config(family, vocab_size=vocab, initializer_range=INIT[family],
                       tie_word_embeddings=family == "gemma3", **SHAPE)


def write_model(path, family: str, *, embed_kind: int = Q8_0, head_kind: int = Q6_K, vocab: int = 300,
                change: dict | None = None, seed: int = 0, head_rows: np.ndarray | None = None):
    """Write a tiny `family` model to `path`; returns its `transformers` config. Gemma ties
    its head to token_embd (in `embed_kind`); Llama has an `output` tensor in `head_kind`.
    change: tensor name -> (kind, float32 values) replacing that tensor (any shape).
    head_rows: float32 [vocab, hidden] values for the head (token_embd when tied)."""
    import gguf

    config = hf_config(family, vocab)
    c, rng = config, np.random.default_rng(seed)
    H, I, scale = c.hidden_size, c.intermediate_size, INIT[family]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    gemma = family == "gemma3"
    tensors: dict[str, tuple[int, np.ndarray]] = {}
    normal = lambda *shape: (rng.standard_normal(shape) * scale).astype(np.float32)
    norm = lambda n: (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)
    embedding = normal(vocab, H) if head_rows is None or not gemma else head_rows
    tensors["token_embd.weight"] = (embed_kind, embedding)
    if not gemma:
        tensors["output.weight"] = (head_kind, normal(vocab, H) if head_rows is None else head_rows)
    tensors["output_norm.weight"] = (F32, norm(H))
    shapes = {"attn_q": (q, H), "attn_k": (kv, H), "attn_v": (kv, H), "attn_output": (H, q), "ffn_gate": (I, H),
              "ffn_up": (I, H), "ffn_down": (H, I)}
    for i in range(c.num_hidden_layers):
        for part, shape in shapes.items():
            tensors[f"blk.{i}.{part}.weight"] = (LAYER_KINDS[part], normal(*shape))
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else [])
        for name in norms:
            tensors[f"blk.{i}.{name}.weight"] = (F32, norm(H))
        if gemma:
            tensors[f"blk.{i}.attn_q_norm.weight"] = (F32, norm(c.head_dim))
            tensors[f"blk.{i}.attn_k_norm.weight"] = (F32, norm(c.head_dim))
    tensors.update(change or {})
    writer = gguf.GGUFWriter(str(path), "gemma3" if gemma else "llama")
    writer.add_block_count(c.num_hidden_layers)  # what `transformers`' converter reads (Llama's q/k order)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(I)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_context_length(c.max_position_embeddings)
    for name, (kind, values) in tensors.items():
        if kind == F32:
            writer.add_tensor(name, values)
        elif kind in (Q5_0, Q8_0, Q4_K, Q6_K):
            writer.add_tensor(name, quantize(kind, values), raw_dtype=gguf.GGMLQuantizationType(kind))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType(kind)),
                              raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config


def read_model(path, family: str, config):
    import gguf

    from longspec.runtime.gguf_reading import quantized_decoder

    return quantized_decoder(gguf.GGUFReader(str(path)), config, "gemma3" if family == "gemma3" else "llama")
