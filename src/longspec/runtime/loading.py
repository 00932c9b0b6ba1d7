"""Building a `Decoder` from what users have: an HF checkpoint directory, a model id
already in the local HF cache (offline), or a GGUF file."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from longspec.runtime.config import DecoderConfig, rope_tables
from longspec.runtime.device import HOST, check_dtype_on_device, resolve_device
from longspec.runtime.model import Decoder
from longspec.runtime.native import prebuild


# Any of these marks a directory that carries its tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass
class LoadedTarget:
    model: Decoder
    tokenizer: object  # runtime.tokenizer.Tokenizer, a transformers tokenizer, or None when the checkpoint has none
    hf_config: object
    source: str


def decoder_from_state_dict(hf_config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                            quantized: list[dict] | None = None) -> Decoder:
    """Map `transformers` parameter names onto our fused layout. quantized: per layer, the
    products kept in a GGUF file's quantization (`runtime.gguf_layers`)."""
    return decoder_from_params(hf_config, fused_params(hf_config, state_dict, dtype), quantized)


def decoder_from_params(hf_config, params: dict[str, torch.Tensor], quantized: list[dict] | None = None,
                        before_copy=None) -> Decoder:
    """A prepared decoder over `params` in our fused names (`fused_params`), used as they are.
    before_copy: see `Decoder.prepare`."""
    config = DecoderConfig.from_hf(hf_config)
    # Outside the meta-device context: RoPE initialisers must compute real tensors.
    tables = rope_tables(hf_config, config)
    with torch.device("meta"):
        model = Decoder(config, tables)
    model.assign(params, tables, quantized)
    # Parameters default to requires_grad=False already; keep them frozen.
    return model.eval().prepare(before_copy=before_copy)


def fused_params(hf_config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`transformers`' parameters in our fused names and layout (q, k, v and gate, up
    concatenated), cast to `dtype`."""
    config = DecoderConfig.from_hf(hf_config)
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in state_dict) else "model."

    def take(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in state_dict:
            raise KeyError(f"checkpoint lacks tensor {key!r} needed by a {config.model_type} model")
        return state_dict[key].to(dtype)

    params: dict[str, torch.Tensor] = {"embed_weight": take("embed_tokens.weight"), "final_norm.weight": take("norm.weight")}
    if not config.tie_word_embeddings:
        head = state_dict.get("lm_head.weight")
        if head is None:
            raise KeyError("checkpoint lacks lm_head.weight and does not tie word embeddings")
        params["lm_head_weight"] = head.to(dtype)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        params[p + "qkv_weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if config.attention_bias:
            params[p + "qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        params[p + "o_weight"] = take(p + "self_attn.o_proj.weight")
        params[p + "gate_up_weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        params[p + "down_weight"] = take(p + "mlp.down_proj.weight")
        params[p + "input_norm.weight"] = take(p + "input_layernorm.weight")
        if config.gemma_norms:
            params[p + "post_attn_norm.weight"] = take(p + "post_attention_layernorm.weight")
            params[p + "pre_mlp_norm.weight"] = take(p + "pre_feedforward_layernorm.weight")
            params[p + "post_mlp_norm.weight"] = take(p + "post_feedforward_layernorm.weight")
        else:
            params[p + "pre_mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        if config.qk_norm:
            q_norm = take(p + "self_attn.q_norm.weight").expand(config.num_heads, -1)
            k_norm = take(p + "self_attn.k_norm.weight").expand(config.num_kv_heads, -1)
            params[p + "qk_norm.weight"] = torch.cat([q_norm, k_norm])
    return params


def load_target(source: str | os.PathLike | None = None, *, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None) -> LoadedTarget:
    """Load a target model and its tokenizer.

    source: None for the embedded default (Gemma 3 270M), a .gguf file, an HF
    checkpoint directory (config.json + *.safetensors), or a model id in the local HF
    cache (no network is used).
    device: where the model computes ("cpu", "cuda", "cuda:N"; None: the CPU). A device
    that is missing or cannot compute in `dtype` is refused before any weight is read.
    dtype: None computes in bf16 and, on the CPU, keeps a GGUF file's quantization for the
    layer weights (`runtime.gguf_layers`): the target is then that quantized model. A dtype
    given dequantizes every tensor to it.
    """
    device = resolve_device(device)
    keep_quantization = dtype is None and device == HOST
    dtype = torch.bfloat16 if dtype is None else dtype
    check_dtype_on_device(dtype, device)
    if dtype == torch.bfloat16 and device == HOST:
        prebuild()  # on a fresh machine the kernels compile while the model converts and loads
    target = _load_on_host(source, dtype, keep_quantization)
    if device != HOST:
        target.model.place(device)
    return target


def _load_on_host(source: str | os.PathLike | None, dtype: torch.dtype, keep_quantization: bool = False) -> LoadedTarget:
    if source is None:
        from longspec.runtime.default_model import default_checkpoint_dir

        return load_checkpoint_dir(default_checkpoint_dir(), dtype=dtype, prepared=True)
    text = str(source)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return load_gguf(path, dtype=dtype, keep_quantization=keep_quantization)
    if path.is_dir():
        return load_checkpoint_dir(path, dtype=dtype)
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a checkpoint directory")
    cached = _local_hub_snapshot(text)
    if cached is None:
        raise FileNotFoundError(
            f"model {text!r} is not a file, a directory, or a model id in the local Hugging Face cache "
            "(longspec never downloads). Pass a checkpoint directory or a .gguf file, or omit --model "
            "for the embedded Gemma 3 270M."
        )
    return load_checkpoint_dir(cached, dtype=dtype)


def load_checkpoint_dir(directory: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                        prepared: bool = False) -> LoadedTarget:
    """prepared: keep the weights as the decoder takes them in the model cache and map them
    from there (`runtime.prepared_weights`; bf16 only): the embedded model's loads do, since
    its checkpoint is a cache entry already; another checkpoint would cost its size again
    on disk."""
    from longspec.runtime.checkpoint_config import read_config
    from longspec.runtime.tokenizer import read_tokenizer

    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        hf_config = read_config(directory)  # without transformers where the file is complete
    except (ValueError, OSError) as error:
        raise ValueError(f"{config_file} is not a valid model config ({_first_line(error)}); restore it from the "
                         "checkpoint's source") from None
    DecoderConfig.from_hf(hf_config)  # fail on unsupported families before reading weights
    check_dtype_fits(hf_config, dtype)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} holds no *.safetensors weights (PyTorch .bin files are not loaded)")
    # The tokenizer is read on a thread beside the weights: transformers' (Python parsing, where our
    # Rust-only one cannot stand in) overlaps their torch work; the Rust one holds the GIL while it
    # parses, about a second for Gemma's 262k entries (docs/lab-notes/startup.md), so from prepared
    # weights its parse starts when the main thread enters the one call that releases the GIL for
    # long, the packed copies (`Decoder.prepare`'s before_copy): started earlier, it would hold
    # the main thread's Python back instead.
    prepared = prepared and dtype == torch.bfloat16
    go = threading.Event()
    if not prepared:
        go.set()

    def read_when_told(directory: Path):
        go.wait()
        return read_tokenizer(directory)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="longspec-tokenizer") as pool:
        tokenizer_loaded = None
        if any((directory / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer_loaded = pool.submit(read_when_told, directory)  # Rust `tokenizers` alone where it can

        def params() -> dict[str, torch.Tensor]:
            return fused_params(hf_config, _read_shards(shards), dtype)

        try:
            if prepared:
                from longspec.runtime.prepared_weights import cached_params

                model = decoder_from_params(hf_config, cached_params(directory, dtype, params), before_copy=go.set)
            else:
                model = decoder_from_params(hf_config, params())
        finally:
            go.set()
        tokenizer = None if tokenizer_loaded is None else tokenizer_loaded.result()
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, model.config.vocab_size, str(directory))
    return LoadedTarget(model, tokenizer, hf_config, str(directory))


def _read_shards(shards: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state_dict.update(load_file(str(shard)))
        except Exception as error:  # safetensors raises its own error type for a bad header or short file
            raise ValueError(f"{shard} is truncated or corrupt ({_first_line(error)}); copy or convert the "
                             "checkpoint again") from None
    return state_dict


# Families whose activations exceed float16's range (65504): Gemma 3 270M's residual
# stream (measured in float32 on code and prose) passes 68k after layer 8 and 104k by
# layer 15 of 18, so in float16 it overflows to inf/NaN and every token comes out as 0.
_FLOAT16_OVERFLOWS = ("gemma3", "gemma3_text")


def check_dtype_fits(hf_config, dtype: torch.dtype) -> None:
    model_type = getattr(hf_config, "model_type", "")
    if dtype == torch.float16 and model_type in _FLOAT16_OVERFLOWS:
        raise ValueError(f"{model_type} models overflow float16 (activations beyond its 65504 limit give NaN logits); "
                         "use --dtype bfloat16 (same memory, float32's range) or float32")


def check_tokenizer_fits(tokenizer, vocab_size: int, source: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding."""
    size = len(tokenizer)
    if size > vocab_size:
        raise ValueError(f"the tokenizer of {source} has {size} tokens but the model's vocabulary has {vocab_size}: "
                         "they do not belong together; use the tokenizer saved with this model")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


@contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's metadata once for the config, once for the tensors and
    once for the tokenizer, each in Python field by field: 17 s each for Gemma's 262k-entry
    vocabulary on a 2-core CPU (docs/lab-notes/startup.md). Inside this block one reader per
    file serves all three; they only read it."""
    import gguf

    original = gguf.GGUFReader
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
              keep_quantization: bool = False) -> LoadedTarget:
    """Dequantize a GGUF file through `transformers`' converter; keep_quantization: the
    quantized target read from the file directly (`runtime.gguf_reading`): the layer products,
    the embedding and the output layer stay the file's blocks."""
    path = Path(path)
    with _gguf_parsed_once():
        return _load_gguf(path, dtype, keep_quantization)


def _load_gguf(path: Path, dtype: torch.dtype, keep_quantization: bool = False) -> LoadedTarget:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as error:  # the GGUF reader raises assorted errors on a bad or short file
        if "not supported" in str(error):
            raise ValueError(f"cannot read {path}: {_first_line(error)}") from None
        raise ValueError(f"{path} is truncated or not a GGUF file ({_first_line(error)})") from None
    DecoderConfig.from_hf(hf_config)  # fail on unsupported families before reading weights
    check_dtype_fits(hf_config, dtype)
    if keep_quantization:
        from longspec.runtime.quantized import quantized_available

        keep_quantization = dtype == torch.bfloat16 and quantized_available()
    if keep_quantization:
        model = _quantized_from_gguf(path, hf_config)
    else:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        try:
            checkpoint = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
        except Exception as error:
            raise ValueError(f"{path} is truncated or corrupt ({_first_line(error)})") from None
        model = decoder_from_state_dict(hf_config, checkpoint["tensors"], dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    check_tokenizer_fits(tokenizer, model.config.vocab_size, str(path))
    return LoadedTarget(model, tokenizer, hf_config, str(path))


def _quantized_from_gguf(path: Path, hf_config) -> Decoder:
    """The quantized target read from the file's memory map (`runtime.gguf_reading`): every
    tensor checked first, none dequantized whole."""
    import gguf

    from longspec.runtime.gguf_reading import quantized_decoder

    try:
        reader = gguf.GGUFReader(path)  # the one `_gguf_parsed_once` hands transformers too
    except Exception as error:  # numpy raises on tensors that run past the end of a short file
        raise ValueError(f"{path} is truncated or corrupt ({_first_line(error)}); copy or convert it again") from None
    architecture = str(reader.fields["general.architecture"].contents())
    return quantized_decoder(reader, hf_config, architecture)


def write_checkpoint_from_gguf(gguf_path: Path, directory: Path) -> None:
    """Write a GGUF file as an HF checkpoint (config.json, float32 safetensors,
    tokenizer) into the existing `directory`, so later loads skip dequantization.
    The caller makes it atomic (see `model_cache.cached_entry`)."""
    with _gguf_parsed_once():
        _write_checkpoint_from_gguf(gguf_path, directory)


def _write_checkpoint_from_gguf(gguf_path: Path, directory: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from longspec.runtime.model_cache import ensure_free_space

    hf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    checkpoint = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors = {k: v.contiguous() for k, v in checkpoint["tensors"].items()}
    ensure_free_space(directory, sum(t.nbytes for t in tensors.values()), "the converted model")
    save_file(tensors, str(directory / "model.safetensors"))
    hf_config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True).save_pretrained(directory)
    (directory / "longspec-source.json").write_text(json.dumps({"gguf": gguf_path.name}))


def _local_hub_snapshot(model_id: str) -> Path | None:
    if model_id.count("/") > 1 or not model_id.strip():
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # not in the cache (or not a valid id): the caller names the problem
        return None
