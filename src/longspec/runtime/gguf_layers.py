"""Which layer weights of a GGUF file stay in the file's quantization, read and checked
before any dequantization: the decoder's products (q/k/v, output, gate/up, down) as
`QuantizedWeight`s, fused in the decoder's order (`runtime.model.DecoderLayer`).

A fused weight stays quantized when every part is in a format the kernel runs; a part in
F16, BF16 or F32 keeps that fused weight on the bf16 path (the dequantized copy, as a
bf16 load has). A part in any other quantized format is refused, naming the tensor."""

from __future__ import annotations

import numpy as np

from longspec.runtime.config import DecoderConfig
from longspec.runtime.quantized import FORMATS, QuantizedWeight, check_rows, format_name, segment, stacked

# GGML's float types: F32, F16, BF16.
FLOAT_KINDS = {0, 1, 30}

# The decoder's fused products and the GGUF tensors they stack, in order.
PRODUCTS = {"qkv_weight": ("attn_q", "attn_k", "attn_v"), "o_weight": ("attn_output",),
            "gate_up_weight": ("ffn_gate", "ffn_up"), "down_weight": ("ffn_down",)}


def _shapes(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    """[rows, values a row] of each tensor, from the model's metadata."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"attn_q": (q, c.hidden_size), "attn_k": (kv, c.hidden_size), "attn_v": (kv, c.hidden_size),
            "attn_output": (c.hidden_size, q), "ffn_gate": (c.intermediate_size, c.hidden_size),
            "ffn_up": (c.intermediate_size, c.hidden_size), "ffn_down": (c.hidden_size, c.intermediate_size)}


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp stores a Llama q/k weight's rows interleaved for its RoPE; `transformers`
    undoes that on load (its LlamaTensorProcessor). Rows are whole blocks, so the quantized
    rows are reordered the same way."""
    index = np.arange(rows)
    return index.reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def check_layer_tensors(reader, config: DecoderConfig) -> None:
    """Every layer product's tensor exists, has a format the quantized path runs (or a float
    one), and holds the bytes the metadata's shape needs: refused before any work otherwise."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = _shapes(config)
    for i in range(config.num_layers):
        for parts in PRODUCTS.values():
            for part in parts:
                name = f"blk.{i}.{part}.weight"
                tensor = tensors.get(name)
                if tensor is None:
                    raise ValueError(f"the GGUF file lacks tensor {name!r} that its metadata's {config.num_layers} "
                                     "layers need; the file is truncated or not a model of this family")
                rows, cols = shapes[part]
                kind = int(tensor.tensor_type)
                if kind in FLOAT_KINDS:
                    if [int(n) for n in tensor.shape] != [cols, rows]:
                        raise ValueError(f"tensor {name!r} has shape {[int(n) for n in tensor.shape][::-1]} where "
                                         f"the model's metadata needs [{rows}, {cols}]; convert the file again")
                    continue
                if kind not in FORMATS:
                    check_rows(name, kind, tensor.data, rows, cols)  # raises, naming the format and the fix
                data = np.asarray(tensor.data)
                if [int(n) for n in tensor.shape] != [cols, rows]:
                    raise ValueError(f"tensor {name!r} has shape {[int(n) for n in tensor.shape][::-1]} where the "
                                     f"model's metadata needs [{rows}, {cols}]; convert the file again")
                check_rows(name, kind, data.reshape(rows, -1) if data.size % max(rows, 1) == 0 else data, rows, cols)


def quantized_layers(reader, config: DecoderConfig, architecture: str) -> list[dict[str, QuantizedWeight]]:
    """Per layer, its products that stay quantized (checked first: `check_layer_tensors`)."""
    check_layer_tensors(reader, config)
    tensors = {t.name: t for t in reader.tensors}
    shapes = _shapes(config)
    layers = []
    for i in range(config.num_layers):
        kept: dict[str, QuantizedWeight] = {}
        for product, parts in PRODUCTS.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            if any(int(tensors[n].tensor_type) in FLOAT_KINDS for n in names):
                continue
            segments = []
            for part, name in zip(parts, names):
                rows, cols = shapes[part]
                raw = np.asarray(tensors[name].data).reshape(rows, -1)
                if architecture == "llama" and part in ("attn_q", "attn_k"):
                    heads = config.num_heads if part == "attn_q" else config.num_kv_heads
                    raw = raw[_llama_row_order(rows, heads)]
                segments.append(segment(name, int(tensors[name].tensor_type), raw, rows, cols))
            kept[product] = stacked(segments, shapes[parts[0]][1])
        layers.append(kept)
    return layers


def describe(layers: list[dict[str, QuantizedWeight]]) -> str:
    """The formats kept, e.g. "Q5_0 x 72, Q4_K x 27, ..." (for logs)."""
    counts: dict[str, int] = {}
    for kept in layers:
        for weight in kept.values():
            for s in weight.segments:
                counts[format_name(s.kind)] = counts.get(format_name(s.kind), 0) + 1
    return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))
