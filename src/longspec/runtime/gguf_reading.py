"""The quantized target read straight from a GGUF file's memory map, without converting
any tensor to float32 first (`transformers`' converter dequantizes every tensor, 32 GB
for an 8B file): layer products stay in the file's blocks (`runtime.gguf_layers`), the
embedding and output layer stay the file's rows (`runtime.file_rows`), and norms and
other float tensors are converted one by one. Every tensor is checked against the
metadata's shapes and the kernel's formats before any is converted.

The float tensors get the processing `transformers` applies to a GGUF file (Gemma's norms
stored as 1 + w, Llama's q/k rows interleaved for llama.cpp's RoPE), so a float tensor
here has the bits the dequantized load gives it."""

from __future__ import annotations

import numpy as np
import torch

from longspec.runtime.config import DecoderConfig, rope_tables
from longspec.runtime.file_rows import FileRows
from longspec.runtime.gguf_layers import (
    PRODUCTS,
    _llama_row_order,
    _shapes,
    quantized_layers,
)
from longspec.runtime.model import Decoder
from longspec.runtime.quantized import format_name

# Our parameter -> the GGUF tensor of each layer (Gemma names first where they differ).
GEMMA_NORMS = {"input_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "pre_mlp_norm": "ffn_norm",
               "post_mlp_norm": "post_ffw_norm"}
PLAIN_NORMS = {"input_norm": "attn_norm", "pre_mlp_norm": "ffn_norm"}


def _tensor(tensors: dict, name: str, shape: tuple[int, ...]):
    """The GGUF tensor `name`, its shape checked against the metadata's [rows, cols] (or [n])."""
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"the GGUF file lacks tensor {name!r} that its metadata's model needs; the file is "
                         "truncated or not a model of this family")
    found = tuple(int(n) for n in tensor.shape)[::-1]
    if found != shape:
        raise ValueError(f"tensor {name!r} has shape {list(found)} where the model's metadata needs {list(shape)}; "
                         "convert the file again")
    kind = int(tensor.tensor_type)
    import gguf

    values = 1
    for n in shape:
        values *= n
    try:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (KeyError, ValueError):
        raise ValueError(f"tensor {name!r} is {format_name(kind)}, which longspec cannot read") from None
    if values % block or np.asarray(tensor.data).nbytes != values // block * nbytes:
        raise ValueError(f"tensor {name!r} holds {np.asarray(tensor.data).nbytes} bytes where {list(shape)} values of "
                         f"{format_name(kind)} need {values // block * nbytes}; the file is truncated, copy it again")
    return tensor


def _rows(tensor, rows: int, cols: int) -> FileRows:
    raw = np.asarray(tensor.data)
    return FileRows(tensor.name, int(tensor.tensor_type), raw.reshape(rows, -1), cols)


class _Plan:
    """Every tensor the model needs, found and checked (no conversion yet)."""

    def __init__(self, reader, config: DecoderConfig, architecture: str) -> None:
        c = config
        self.config, self.architecture = c, architecture
        self.tensors = {t.name: t for t in reader.tensors}
        V, H = c.vocab_size, c.hidden_size
        self.embedding = _rows(_tensor(self.tensors, "token_embd.weight", (V, H)), V, H)
        head = self.tensors.get("output.weight")
        self.head = self.embedding if head is None or c.tie_word_embeddings else _rows(
            _tensor(self.tensors, "output.weight", (V, H)), V, H)
        self.floats: dict[str, object] = {"final_norm.weight": _tensor(self.tensors, "output_norm.weight", (H,))}
        norms = GEMMA_NORMS if c.gemma_norms else PLAIN_NORMS
        shapes = _shapes(c)
        for i in range(c.num_layers):
            p, blk = f"layers.{i}.", f"blk.{i}."
            for ours, theirs in norms.items():
                self.floats[p + ours + ".weight"] = _tensor(self.tensors, f"{blk}{theirs}.weight", (H,))
            if c.qk_norm:
                self.floats[p + "q_norm"] = _tensor(self.tensors, f"{blk}attn_q_norm.weight", (c.head_dim,))
                self.floats[p + "k_norm"] = _tensor(self.tensors, f"{blk}attn_k_norm.weight", (c.head_dim,))
            if c.attention_bias:
                for part in ("attn_q", "attn_k", "attn_v"):
                    self.floats[f"{p}{part}.bias"] = _tensor(self.tensors, f"{blk}{part}.bias", (shapes[part][0],))
            for parts in PRODUCTS.values():
                for part in parts:
                    self.floats[f"{p}{part}"] = _tensor(self.tensors, f"{blk}{part}.weight", shapes[part])

    def dense(self, key: str) -> torch.Tensor:
        """bf16 of a float tensor (or a layer product the kernel does not keep), processed as
        `transformers` processes it."""
        import gguf

        tensor = self.floats[key]
        shape = tuple(int(n) for n in tensor.shape)[::-1]
        values = gguf.quants.dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType(int(tensor.tensor_type)))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if self.config.gemma_norms and "norm.weight" in tensor.name:
            values = values - 1  # llama.cpp stores Gemma's norms as 1 + w
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if self.architecture == "llama" and part in ("attn_q", "attn_k"):
            heads = self.config.num_heads if part == "attn_q" else self.config.num_kv_heads
            values = values[_llama_row_order(shape[0], heads)]
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.bfloat16)


def _absent(shape: tuple[int, ...]) -> torch.Tensor:
    """Stands for a weight the model reads from the file's blocks instead: the shape and
    dtype without the bytes; NaN, so that code reading it as a dense weight fails visibly."""
    return torch.full((), float("nan"), dtype=torch.bfloat16).expand(shape)


def quantized_decoder(reader, hf_config, architecture: str) -> Decoder:
    """The quantized target of a GGUF file, every tensor checked before any is converted."""
    config = DecoderConfig.from_hf(hf_config)
    plan = _Plan(reader, config, architecture)
    layers = quantized_layers(reader, config, architecture)  # checks the products' formats and bytes
    tables = rope_tables(hf_config, config)
    with torch.device("meta"):
        model = Decoder(config, tables)
    c, head_kept = config, plan.head.runs_quantized
    params = {"embed_weight": _absent((c.vocab_size, c.hidden_size)), "final_norm.weight": plan.dense("final_norm.weight")}
    if plan.head is plan.embedding and not head_kept:
        params["embed_weight"] = plan.embedding.dense()
    if not c.tie_word_embeddings:
        params["lm_head_weight"] = _absent((c.vocab_size, c.hidden_size)) if head_kept else plan.head.dense()
    for i, kept in enumerate(layers):
        p = f"layers.{i}."
        for product, parts in PRODUCTS.items():
            rows = sum(_shapes(c)[part][0] for part in parts)
            cols = _shapes(c)[parts[0]][1]
            params[p + product] = (_absent((rows, cols)) if product in kept else
                                   torch.cat([plan.dense(p + part) for part in parts]))
        if c.attention_bias:
            params[p + "qkv_bias"] = torch.cat([plan.dense(f"{p}{part}.bias") for part in ("attn_q", "attn_k", "attn_v")])
        for ours in (GEMMA_NORMS if c.gemma_norms else PLAIN_NORMS):
            params[p + ours + ".weight"] = plan.dense(p + ours + ".weight")
        if c.qk_norm:
            params[p + "qk_norm.weight"] = torch.cat([plan.dense(p + "q_norm").expand(c.num_heads, -1),
                                                      plan.dense(p + "k_norm").expand(c.num_kv_heads, -1)])
    model.assign(params, tables, layers)
    model.file_embedding = plan.embedding
    model.file_head = plan.head if head_kept else None
    return model.eval().prepare()
