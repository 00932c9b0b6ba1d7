"""Decoder configuration: one dataclass for every supported family, read from a
`transformers` config. Family differences are explicit traits, never string modes
consulted in the hot path."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# model_type -> the family traits that differ from a plain Llama block.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    sliding_window: int | None
    layer_is_sliding: tuple[bool, ...]
    attention_scale: float
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    gemma_norms: bool  # Gemma: norm weight is (1 + w), pre/post norms around attn and MLP, scaled embeddings
    activation: str  # "silu" or "gelu_tanh"
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    model_type: str

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def embedding_scale(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.gemma_norms else None

    @staticmethod
    def from_hf(hf_config) -> "DecoderConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type == "gemma3" and hasattr(hf_config, "text_config"):
            hf_config = hf_config.text_config
            model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} is not supported; supported families: "
                "Llama (llama), Mistral (mistral), Qwen2/2.5 (qwen2), Qwen3 (qwen3), Gemma 3 text (gemma3_text)"
            )
        if getattr(hf_config, "attn_logit_softcapping", None):
            raise UnsupportedArchitectureError("attention logit soft-capping is not supported (Gemma 2 style models)")
        gemma = model_type.startswith("gemma3")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        layer_types = getattr(hf_config, "layer_types", None)
        sliding_window = getattr(hf_config, "sliding_window", None)
        if layer_types is None:
            kind = "sliding_attention" if sliding_window else "full_attention"
            layer_types = [kind] * hf_config.num_hidden_layers
        layer_is_sliding = tuple(t == "sliding_attention" for t in layer_types)
        if any(layer_is_sliding) and not sliding_window:
            raise UnsupportedArchitectureError("config marks sliding layers but sets no sliding_window")
        if gemma:
            scale = hf_config.query_pre_attn_scalar ** -0.5
            activation = "gelu_tanh"
        else:
            scale = head_dim ** -0.5
            activation = "silu"
        hidden_act = getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", None)
        if hidden_act not in ("silu", "gelu_pytorch_tanh", None):
            raise UnsupportedArchitectureError(f"activation {hidden_act!r} is not supported")
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return DecoderConfig(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_window=sliding_window if any(layer_is_sliding) else None,
            layer_is_sliding=layer_is_sliding,
            attention_scale=scale,
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            gemma_norms=gemma,
            activation=activation,
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )


def rope_tables(hf_config, config: DecoderConfig) -> dict[bool, tuple[torch.Tensor, float]]:
    """Inverse frequencies and attention scaling for full (False) and sliding (True)
    layers, computed by `transformers`' own RoPE initialisers so every scaling type
    (linear, llama3, yarn, dynamic at its base length, ...) matches exactly."""
    if getattr(hf_config, "model_type", None) == "gemma3" and hasattr(hf_config, "text_config"):
        hf_config = hf_config.text_config
    params = getattr(hf_config, "rope_parameters", None) or {}
    per_type = isinstance(params, dict) and "full_attention" in params

    def compute(layer_type: str | None) -> tuple[torch.Tensor, float]:
        p = params[layer_type] if layer_type else params
        rope_type = (p or {}).get("rope_type", "default")
        if rope_type == "default":
            base = p["rope_theta"]
            dim = config.head_dim
            # float32 arithmetic, as transformers computes it, so tables agree bit for bit
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only a scaled RoPE needs transformers

        kwargs = {"layer_type": layer_type} if layer_type else {}
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
        return inv.float(), float(scaling)

    if per_type:
        return {False: compute("full_attention"), True: compute("sliding_attention" if "sliding_attention" in params else "full_attention")}
    table = compute(None)
    return {False: table, True: table}
