"""Tiny randomly initialised `transformers` models of every supported family, and
our `Decoder` built from the same weights.

All models share one small shape (hidden 64, 4 query heads over 2 KV heads of
dimension 16, vocabulary 128) so tests run in milliseconds. Sliding-window
families use a window of 8 so short sequences already leave the window.

Usage:

    hf_model, decoder = tiny_pair("gemma3", dtype=torch.float64)
    config = tiny_config("mistral", sliding_window=4)   # any field can be overridden

Tiny configs have no special tokens (bos/eos/pad are None) so greedy generation
never stops early; pass e.g. ``eos_token_id=5`` to get one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from longspec.runtime.loading import decoder_from_state_dict
from longspec.runtime.model import Decoder

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "gemma3")
SLIDING_WINDOW = 8
VOCAB_SIZE = 128

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _llama(**kw):
    return LlamaConfig(**{**_COMMON, "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _llama3_rope(**kw):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(**{**_COMMON, "num_hidden_layers": 2, "rope_parameters": rope, **kw})


def _mistral(**kw):
    return MistralConfig(
        **{
            **_COMMON,
            "num_hidden_layers": 2,
            "sliding_window": SLIDING_WINDOW,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            **kw,
        }
    )


def _qwen2(**kw):
    # Qwen2 always has q/k/v biases; head_dim is derived from hidden_size / heads (64 / 4).
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return Qwen2Config(**{**common, "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _qwen3(**kw):
    return Qwen3Config(**{**_COMMON, "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _gemma3(**kw):
    return Gemma3TextConfig(
        **{
            **_COMMON,
            "num_hidden_layers": 3,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,  # deliberately not head_dim: the scale must come from here
            "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            **kw,
        }
    )


_BUILDERS = {
    "llama": _llama,
    "llama3_rope": _llama3_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
}


def tiny_config(family: str, **overrides):
    """A tiny `transformers` config of one of FAMILIES; keyword arguments override fields."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    return _BUILDERS[family](**overrides)


def tiny_hf_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A randomly initialised causal LM (eager attention, eval mode) in `dtype`.

    Norm weights and biases, which `transformers` initialises to constants (ones or
    zeros), are randomised too so that every parameter influences the logits.
    """
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim != 1:
                continue
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                # Gemma norms scale by (1 + w), the others by w.
                param.copy_(0.2 * noise if gemma else 1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model.to(dtype).eval()


def decoder_from_hf(hf_model: PreTrainedModel, dtype: torch.dtype | None = None) -> Decoder:
    """Our decoder over the weights of an HF model (in the HF model's dtype by default)."""
    dtype = dtype or hf_model.dtype
    return decoder_from_state_dict(hf_model.config, hf_model.state_dict(), dtype)


def tiny_pair(
    family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> tuple[PreTrainedModel, Decoder]:
    """(hf_model, decoder): the same random weights, both in `dtype`."""
    hf_model = tiny_hf_model(family, seed=seed, dtype=dtype, **overrides)
    return hf_model, decoder_from_hf(hf_model, dtype)


def tiny_decoder(family: str, *, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> Decoder:
    """Just our decoder (float64 by default, for cache and engine tests)."""
    return tiny_pair(family, dtype=dtype, seed=seed, **overrides)[1]


def random_ids(length: int, *, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """[1, length] random token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def char_tokenizer(size: int = 96) -> PreTrainedTokenizerFast:
    """One token per printable character (ids 1..95), `size` entries in all."""
    vocab = {"<unk>": 0, **{chr(32 + i): i + 1 for i in range(95)}}
    vocab.update({f"<extra{i}>": i for i in range(len(vocab), size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def save_checkpoint(directory: Path, family: str = "qwen3", tokenizer_size: int | None = 96,
                    chat_template: str | None = None, **overrides) -> Path:
    """A tiny HF checkpoint directory (safetensors), with a character tokenizer of
    `tokenizer_size` entries (None: no tokenizer) and optionally a chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(family, dtype=torch.float32, **overrides).save_pretrained(directory, safe_serialization=True)
    if tokenizer_size is not None:
        tokenizer = char_tokenizer(tokenizer_size)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(directory)
    return directory
