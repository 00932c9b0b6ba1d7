"""Loading from a checkpoint directory, clear errors on bad input, the Python API
and the CLI's failure paths (all fast: tiny models or no model at all)."""

from __future__ import annotations

import json

import pytest
import torch

from longspec.api import LongSpecModel, load
from longspec.cli.main import main as cli_main
from longspec.runtime.config import UnsupportedArchitectureError
from longspec.runtime.loading import load_target
from longspec.runtime.static_step import DEFAULT_BUCKETS, CompileOptions
from longspec.speculation.metrics import distinct_n
from tiny_models import random_ids, tiny_hf_model


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    model = tiny_hf_model("qwen3", dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


def test_checkpoint_directory_loads_with_equal_logits(checkpoint_dir):
    directory, hf_model = checkpoint_dir
    loaded = load_target(directory, dtype=torch.float32)
    assert loaded.tokenizer is None  # the tiny checkpoint ships no tokenizer
    ids = random_ids(17, seed=3)
    cache = loaded.model.new_cache(32)
    ours = loaded.model(ids, cache).logits
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_api_generates_from_token_ids_and_refuses_text_without_tokenizer(checkpoint_dir):
    directory, _ = checkpoint_dir
    model = LongSpecModel(load_target(directory, dtype=torch.float64))
    ids = random_ids(12, seed=1)[0].repeat(2)
    ar = model.generate(ids, max_new_tokens=20, method="ar")
    pld = model.generate(ids.tolist(), max_new_tokens=20, method="pld")
    assert ar.token_ids == pld.token_ids and len(ar.token_ids) == 20
    assert pld.stats.target_forwards <= ar.stats.target_forwards
    assert ar.stats.distinct == [distinct_n(ar.token_ids, n) for n in (1, 2, 3, 4)]  # repetition, beside speed
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("hello")
    with pytest.raises(ValueError, match="token ids must lie"):
        model.generate([1, 2, 10_000])
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, top_p=1.5, temperature=1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown method"):
        model.generate(ids, method="nope", max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model.generate(ids, max_new_tokens=10_000)
    sampled = [model.generate(ids, max_new_tokens=8, temperature=1.0, seed=5).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded sampling is reproducible


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*supported families"):
        load_target(tmp_path)


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_target(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target(tmp_path / "absent.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_target(tmp_path)


def test_gguf_of_unsupported_architecture_is_refused(tmp_path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_eps(1e-5)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported; supported families"):
        load_target(path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "--prompt-file", "/no/such/file"], "prompt file not found"),
        (["generate", "", "--model", "x"], "prompt is empty"),
        (["generate", "hi", "--model", "/no/such/model"], "never downloads"),
        (["generate", "hi", "--draft-tokens", "4"], "--draft-tokens applies to --method pld"),
        (["generate", "hi", "--method", "tokenswift", "--option", "budget"], "write KEY=VALUE"),
        (["generate", "hi", "--method", "tokenswift", "--option", "sinks=-1"], "sinks must be"),
        (["generate", "hi", "--method", "tokenswift", "--option", "bogus=1"], "method 'tokenswift' has no option bogus; its options are: heads, budget"),
        (["generate", "hi", "--method", "ar", "--option", "k=3"], "method 'ar' has no option k; its options are: none"),
        (["generate", "hi", "--regex", "(ab"], "the regex does not compile"),
        (["generate", "hi", "--json-object", "--ignore-eos"], "--ignore-eos cannot go with a structured output"),
        (["generate", "hi", "--json-schema", "/no/such/schema.json"], "JSON schema file not found"),
    ],
)
def test_cli_rejects_bad_input_before_work(argv, message, capsys):
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_info_without_model(capsys):
    assert cli_main(["info", "--no-model"]) == 0
    out = capsys.readouterr().out
    assert "longspec" in out and "methods:" in out


def test_load_with_compile_turns_on_static_steps(checkpoint_dir):
    directory, _ = checkpoint_dir
    assert load(directory, dtype="float32").model.static_steps is None  # eager unless asked
    compiled = load(directory, dtype="float32", compile=True)  # compiles every bucket at load
    assert compiled.model.static_steps.options == CompileOptions.for_device(torch.device("cpu"))
    assert compiled.model.static_steps.failure is None and compiled.model.static_steps.calls == len(DEFAULT_BUCKETS)
    ids = random_ids(12, seed=1)[0].repeat(2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokens = compiled.generate(ids, max_new_tokens=20, method="pld").token_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the request compiled nothing
    assert tokens == load(directory, dtype="float32").generate(ids, max_new_tokens=20, method="pld").token_ids
