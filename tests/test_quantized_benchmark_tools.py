"""The pieces of benchmarks/quantized/ that decide what a comparison with llama.cpp
means: the synthetic vocabulary both engines load, the tensor plan of each real shape,
a random-weight file read back, and the rates read from llama.cpp's printouts."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quantized"))

import llama_cpp
from random_gguf import tensor_plan, write_f16
from shapes import SHAPES
from synthetic_vocab import CONTROL, byte_symbols, synthetic_vocabulary


def test_byte_symbols_are_gpt2s_spelling():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    assert byte_symbols() == [spelled[b] for b in range(256)]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_vocabulary_has_the_models_size_and_every_merge_joins_two_tokens(name):
    shape = SHAPES[name]
    vocab = synthetic_vocabulary(shape.vocab, shape.special_tokens)
    assert len(vocab.tokens) == len(set(vocab.tokens)) == len(vocab.token_types) == shape.vocab
    known = set(vocab.tokens)
    for merge in vocab.merges[::97] + vocab.merges[-3:]:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known
    assert vocab.token_types[vocab.bos] == vocab.token_types[vocab.eos] == CONTROL
    assert vocab.tokens[vocab.eos] == "<|endoftext|>"  # transformers adds that token where it is missing


def test_a_vocabulary_without_room_for_the_bytes_is_refused():
    with pytest.raises(ValueError, match="256 bytes"):
        synthetic_vocabulary(200, 2)


def test_plan_counts_the_published_parameters():
    # Llama-3.2-1B: 1.24B with the tied embedding; Llama-3.1-8B: 8.03B.
    assert SHAPES["llama-3.2-1b"].parameters() == pytest.approx(1.236e9, rel=0.01)
    assert SHAPES["llama-3.1-8b"].parameters() == pytest.approx(8.03e9, rel=0.01)
    for shape in SHAPES.values():
        total = sum(int(np.prod(dims)) for _, dims, std in tensor_plan(shape) if std is not None)
        assert total == shape.parameters()
        names = [name for name, _, _ in tensor_plan(shape)]
        assert ("output.weight" in names) != shape.tied
        assert ("blk.0.attn_q.bias" in names) == shape.qkv_bias


def test_a_written_file_reads_back_with_its_shapes_and_tokenizer(tmp_path):
    import gguf
    from transformers import AutoTokenizer

    shape = replace(SHAPES["qwen2.5-1.5b"], name="tiny", hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32,
                    ffn=128, vocab=1024, special_tokens=8)
    path = tmp_path / "tiny-f16.gguf"
    write_f16(shape, path)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_down.weight"].shape.tolist() == [128, 64]  # GGUF lists (columns, rows)
    embed = np.asarray(tensors["token_embd.weight"].data, dtype=np.float32)
    assert abs(embed.std() * np.sqrt(64) - 1) < 0.05  # N(0, 1/fan_in)
    assert np.all(np.asarray(tensors["blk.0.attn_norm.weight"].data) == 1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    assert len(tokenizer) == shape.vocab
    ids = tokenizer("ab ab").input_ids
    assert tokenizer.decode(ids) == "ab ab"


COMPLETION_LOG = """\
0.22.618.968 I common_perf_print:    sampling time =     472.45 ms
0.22.619.017 I common_perf_print: prompt eval time =   16669.83 ms /  1024 tokens (   16.28 ms per token,    61.43 tokens per second)
0.22.619.031 I common_perf_print:        eval time =     300.00 ms /    15 runs   (   20.00 ms per token,    50.00 tokens per second)
0.22.619.044 I common_perf_print:       total time =   19273.01 ms /  1039 tokens
"""

LOOKUP_LOG = """\
encoded 1024 tokens in    1.234 seconds, speed:  829.822 t/s
decoded   16 tokens in    0.200 seconds, speed:   80.000 t/s

n_draft      = 8
n_predict    = 16
n_drafted    = 24
n_accept     = 9
"""


def test_completion_rate_is_the_eval_line_not_the_prompt_line(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "_run", lambda command: COMPLETION_LOG)
    got = llama_cpp.completion(tmp_path, tmp_path / "m.gguf", tmp_path / "p.txt", new_tokens=16, threads=2,
                               context=2048, sampling=llama_cpp.Sampling(0.0))
    assert got == {"decode_tokens_per_s": pytest.approx(50.0), "decode_runs": 15, "prompt_tokens": 1024}


def test_speculation_rate_is_the_decoded_line(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "_run", lambda command: LOOKUP_LOG)
    got = llama_cpp.speculation(tmp_path, "llama-lookup", tmp_path / "m.gguf", tmp_path / "p.txt", new_tokens=16,
                                threads=2, context=2048)
    assert got["decode_tokens_per_s"] == pytest.approx(80.0)
    assert (got["decoded"], got["n_drafted"], got["n_accept"]) == (16, 24, 9)


def test_a_printout_without_timings_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "_run", lambda command: "main: error: failed to load model\n")
    with pytest.raises(RuntimeError, match="no timing printout"):
        llama_cpp.completion(tmp_path, tmp_path / "m.gguf", tmp_path / "p.txt", new_tokens=16, threads=2,
                             context=2048, sampling=llama_cpp.Sampling(1.0, 0.95, 0))


def test_sampled_flags_turn_off_llama_cpps_default_cuts():
    flags = llama_cpp.Sampling(1.0, 0.95, 1).flags()
    assert flags[flags.index("--top-k") + 1] == "0" and flags[flags.index("--min-p") + 1] == "0"
    assert flags[flags.index("--seed") + 1] == "1"
