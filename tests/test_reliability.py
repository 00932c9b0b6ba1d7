"""Faults a user can cause, each reproduced first: silent wrong answers are refused,
and the command line answers with one line naming the problem and the fix (no
traceback, right exit status) — with tiny checkpoints, so all of it runs in seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longspec.api import LongSpecModel
from longspec.cli.main import main as cli_main
from longspec.runtime.loading import load_target
from longspec.speculation.processors import SamplingParams, processed_probs
from tiny_models import VOCAB_SIZE, char_tokenizer, random_ids, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # A long context so that a streaming run lasts long enough to be interrupted.
    return save_checkpoint(tmp_path_factory.mktemp("tiny-with-tokenizer"), max_position_embeddings=1 << 16)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the test printed before (progress bars of save_pretrained)
    status = cli_main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("longspec: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# ------------------------------------------------------------ silent wrong answers
def test_float16_is_refused_for_gemma3_which_overflows_it(tmp_path, capsys):
    directory = save_checkpoint(tmp_path / "gemma", family="gemma3", tokenizer_size=None)
    with pytest.raises(ValueError, match="overflow float16.*bfloat16"):
        load_target(directory, dtype=torch.float16)
    status, _, err = run_cli(["generate", "--model", str(directory), "--dtype", "float16", "hi"], capsys)
    assert status == 2
    assert_one_line_error(err, "overflow float16")


def test_tiny_temperature_and_extreme_penalties(checkpoint):
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    probs = processed_probs(logits, None, SamplingParams(temperature=1e-39))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # the argmax, not NaN
    for theta in (1e-300, 1e300, 0.0):
        with pytest.raises(ValueError, match=r"penalty must lie in \[2\^-32, 2\^32\]"):
            SamplingParams(penalty=theta)
    model = LongSpecModel(load_target(checkpoint, dtype=torch.float32))
    out = model.generate(random_ids(8)[0], temperature=1e-39, max_new_tokens=6, seed=0, ignore_eos=True)
    assert out.token_ids == model.generate(random_ids(8)[0], max_new_tokens=6, ignore_eos=True).token_ids


@pytest.mark.parametrize(
    "prompt,kwargs,error,message",
    [
        (torch.tensor([1.0, 2.0]), {}, TypeError, "integer tensor, got torch.float32"),
        (torch.tensor([True, False]), {}, TypeError, "integer tensor, got torch.bool"),
        (torch.tensor([[1, 2], [3, 4]]), {}, ValueError, "call generate_batch with a list of prompts"),
        ([[1, 2], [3, 4]], {}, TypeError, "call generate_batch with a list of prompts"),
        ([1, 2.5], {}, TypeError, "must be integers, got float"),
        ([1, True], {}, TypeError, "must be integers, got bool"),
        ([1, 2], {"max_new_tokens": 4.5}, TypeError, "max_new_tokens must be an int, got float"),
        ([1, 2], {"seed": 1.5}, TypeError, "seed must be an int, got float"),
        ([1, 2], {"seed": 2**64}, ValueError, r"seed must be in \[0, 18446744073709551615\]"),
        ([1, 2], {"stop": ["ok", 3]}, TypeError, "stop must be a string or a list of strings"),
        ([1, 2], {"method_options": "k=3"}, TypeError, "method_options must be a dict"),
    ],
)
def test_api_validates_types_and_shapes_naming_the_argument(checkpoint, prompt, kwargs, error, message):
    model = LongSpecModel(load_target(checkpoint, dtype=torch.float32))
    with pytest.raises(error, match=message):
        model.generate(prompt, **kwargs)


def test_api_accepts_a_1xT_batch_and_a_bare_stop_string(checkpoint):
    model = LongSpecModel(load_target(checkpoint, dtype=torch.float32))
    ids = random_ids(10, seed=2)
    assert model.generate(ids, max_new_tokens=5).token_ids == model.generate(ids[0].tolist(), max_new_tokens=5).token_ids
    text = model.generate("abcabc", max_new_tokens=30, ignore_eos=True).text
    assert len(text) > 6
    stop = text[4:6]
    stopped = model.generate("abcabc", max_new_tokens=30, stop=stop, ignore_eos=True)
    assert stopped.stats.stop_reason == "stop" and stopped.text == text[: text.find(stop)]


def test_a_huge_prompt_is_refused_from_its_size_before_tokenizing(checkpoint, monkeypatch):
    model = LongSpecModel(load_target(checkpoint, dtype=torch.float32))
    context = model.config.max_position_embeddings
    calls = []
    monkeypatch.setattr(type(model.tokenizer), "__call__", lambda *a, **k: calls.append(1))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=f"at least .* tokens long, beyond the model's context of {context:,}"):
        model.generate("x" * (20 << 20))  # 20 MB
    assert not calls and time.perf_counter() - started < 5


def test_a_prompt_shorter_than_the_context_in_bytes_skips_the_vocabulary_scan(checkpoint, monkeypatch):
    """The size check's bound (bytes / the longest entry) cannot pass the context when the
    bytes do not: a first short prompt does not wait for a scan of the whole vocabulary."""
    model = LongSpecModel(load_target(checkpoint, dtype=torch.float32))
    monkeypatch.setattr(type(model.tokenizer), "get_vocab", lambda *a, **k: pytest.fail("vocabulary scanned"))
    assert model.encode("def fib(n):").numel() > 0


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_load(tmp_path, capsys):
    directory = save_checkpoint(tmp_path / "big-tokenizer", tokenizer_size=VOCAB_SIZE + 40)
    with pytest.raises(ValueError, match=f"tokenizer .* has {VOCAB_SIZE + 40} tokens but the model's vocabulary has {VOCAB_SIZE}"):
        load_target(directory)


# --------------------------------------------------------------- corrupt files
def test_corrupt_checkpoint_files_are_named(tmp_path, capsys):
    truncated = save_checkpoint(tmp_path / "truncated", tokenizer_size=None)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    status, _, err = run_cli(["generate", "--model", str(truncated), "hi"], capsys)
    assert status == 2
    assert_one_line_error(err, "model.safetensors is truncated or corrupt")

    bad_config = save_checkpoint(tmp_path / "bad-config", tokenizer_size=None)
    (bad_config / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    status, _, err = run_cli(["generate", "--model", str(bad_config), "hi"], capsys)
    assert status == 2
    assert_one_line_error(err, "config.json is not a valid model config")

    gguf = tmp_path / "short.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    status, _, err = run_cli(["generate", "--model", str(gguf), "hi"], capsys)
    assert status == 2
    assert_one_line_error(err, "short.gguf is truncated or not a GGUF file")


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    gguf = tmp_path / "short.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError):
        cli_main(["--debug", "generate", "--model", str(gguf), "hi"])
    monkeypatch.setenv("LONGSPEC_DEBUG", "1")
    with pytest.raises(ValueError):
        cli_main(["generate", "--model", str(gguf), "hi"])


def test_internal_errors_say_how_to_report_them():
    from longspec.cli.faults import describe

    status, message = describe(ZeroDivisionError("division by zero"))
    assert status == 1 and "internal error: ZeroDivisionError" in message and "--debug" in message


# -------------------------------------------------------------- CLI messages
def test_prompt_file_messages(tmp_path, checkpoint, capsys, monkeypatch):
    status, _, err = run_cli(["generate", "--prompt-file", str(tmp_path)], capsys)
    assert status == 2
    assert_one_line_error(err, "is a directory")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait".encode("latin-1"))
    status, _, err = run_cli(["generate", "--prompt-file", str(latin)], capsys)
    assert status == 2
    assert_one_line_error(err, "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)", "iconv")
    # '-' reads standard input.
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abcabcabc")))
    status, out, err = run_cli(["generate", "--prompt-file", "-", "--model", str(checkpoint), "--max-new-tokens", "4",
                                "--json", "--dtype", "float32"], capsys)
    assert status == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] == 9


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["generate", "hi", "--method", "pld", "--option", "foo=1"],
         ["method 'pld' has no option foo; its options are: num_tokens, min_ngram, max_ngram, max_candidates"]),
        (["generate", "hi", "--method", "pld", "--option", "num_tokens=many"], ["num_tokens='many'", "num_tokens must be"]),
        (["generate", "hi", "--seed", str(2**64)], ["--seed must be in [0, 18446744073709551615]"]),
        (["generate", "hi", "--dtype", "float8"], ["unknown dtype 'float8'"]),
    ],
)
def test_cli_messages_point_at_the_fix(argv, fragments, capsys):
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    assert_one_line_error(err, *fragments)


def test_chat_and_tokenizer_messages(tmp_path, checkpoint, capsys):
    status, _, err = run_cli(["generate", "hi", "--chat", "--model", str(checkpoint)], capsys)
    assert status == 2
    assert_one_line_error(err, "no chat template (a base model)", "drop --chat")
    bare = save_checkpoint(tmp_path / "no-tokenizer", tokenizer_size=None)
    status, _, err = run_cli(["generate", "hi", "--model", str(bare)], capsys)
    assert status == 2
    assert_one_line_error(err, "has no tokenizer files", "save_pretrained(DIR)")


@pytest.mark.parametrize("command", [["train", "tokenswift", "--stdlib-files", "1"], ["train", "longspec", "--stdlib"]])
def test_train_out_that_is_a_file_is_named(tmp_path, capsys, command):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    status, _, err = run_cli([*command, "--out", str(a_file)], capsys)
    assert status == 2
    assert_one_line_error(err, "--out", "is a file")


def test_train_tokenswift_names_the_extensions_it_reads(tmp_path, capsys):
    (tmp_path / "code.py").write_text("print(1)\n")
    status, _, err = run_cli(["train", "tokenswift", "--data", str(tmp_path), "--out", str(tmp_path / "run")], capsys)
    assert status == 2
    assert_one_line_error(err, "holds no .txt files", "--data FILE")


# --------------------------------------------------------------- process faults
def _cli_process(*args: str, cache: Path) -> subprocess.Popen:
    # A shell starts background jobs with SIGINT ignored, and children inherit that:
    # restore the default so Ctrl-C reaches the CLI however the tests were started.
    # Its own cache: what it measures under the busy suite stays out of the user's.
    return subprocess.Popen([sys.executable, "-m", "longspec.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=default_sigint,
                            env={**os.environ, "LONGSPEC_CACHE": str(cache)})


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line(checkpoint, tmp_path):
    process = _cli_process("generate", "--model", str(checkpoint), "--max-new-tokens", "60000", "--ignore-eos",
                           "--dtype", "float64", "x" * 50, cache=tmp_path)
    # Wait until text streams, then interrupt.
    first = process.stdout.read(1)
    assert first
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert b"Traceback" not in err and b"longspec: interrupted" in err


def test_broken_pipe_exits_quietly(checkpoint, tmp_path):
    process = _cli_process("generate", "--model", str(checkpoint), "--max-new-tokens", "60000", "--ignore-eos",
                           "--dtype", "float64", "x" * 50, cache=tmp_path)
    process.stdout.read(1)
    process.stdout.close()  # the reader goes away, like `| head -c 1`
    err = process.stderr.read()
    process.wait(timeout=60)
    assert b"Traceback" not in err and b"Exception ignored" not in err, err
    assert process.returncode == 141


# ----------------------------------------------------------------- bench and train
def test_bench_refuses_to_replace_an_earlier_run_and_an_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.jsonl").write_text("{}\n")
    status, _, err = run_cli(["bench", "--tasks", "jsonl=/none.jsonl", "--out", str(out)], capsys)
    assert status == 2
    assert_one_line_error(err, "already holds an earlier run", "--resume", "--overwrite")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    status, _, err = run_cli(["bench", "--tasks", "jsonl=/none.jsonl", "--out", str(a_file)], capsys)
    assert status == 2
    assert_one_line_error(err, "is a file")


def test_bench_refuses_out_of_vocabulary_prompt_ids_naming_file_and_line(tmp_path, checkpoint, capsys):
    tasks = tmp_path / "ids.jsonl"
    tasks.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n" + json.dumps({"prompt_ids": [5, 10_000]}) + "\n")
    status, _, err = run_cli(["bench", "--tasks", f"jsonl={tasks}", "--methods", "ar", "--model", str(checkpoint),
                              "--out", str(tmp_path / "out"), "--max-new-tokens", "4", "--no-plots"], capsys)
    assert status == 2
    assert_one_line_error(err, f"{tasks}:2: prompt_ids [10000] lie outside the model's vocabulary [0, {VOCAB_SIZE})")
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_bench_where_every_method_fails_exits_nonzero(tmp_path, checkpoint, capsys):
    tasks = tmp_path / "ids.jsonl"
    tasks.write_text(json.dumps({"prompt_ids": [1, 2, 3, 4]}) + "\n")
    status, _, err = run_cli(["bench", "--tasks", f"jsonl={tasks}", "--methods", "longspec", "--model", str(checkpoint),
                              "--out", str(tmp_path / "out"), "--max-new-tokens", "4", "--no-plots"], capsys)
    assert status == 1
    assert "no run produced a result" in err


def test_changed_corpus_never_reuses_stale_token_shards(tmp_path):
    from longspec.training.data import build_shards, iter_documents, shards_key

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first corpus " * 20)
    tokenizer = char_tokenizer()
    shards = tmp_path / "shards"

    def build():
        key = shards_key([corpus], tokenizer, text_field=None, heldout_fraction=0.0)
        return build_shards(iter_documents([corpus]), tokenizer, shards, heldout_fraction=0.0, key=key)

    first = build()
    assert build() == first  # the same corpus reuses its shards
    time.sleep(0.01)
    (corpus / "b.txt").write_text("second corpus " * 20)
    with pytest.raises(ValueError, match="built from another corpus"):
        build()


def test_the_command_exits_with_its_status_and_all_its_output(checkpoint, tmp_path):
    """`longspec` (console_main) skips the interpreter's teardown: its output is still all
    there, flushed, and its exit status is the command's."""
    done = subprocess.run([sys.executable, "-m", "longspec.cli.main", "generate", "--model", str(checkpoint),
                           "--max-new-tokens", "5", "--method", "ar", "--json", "abc"], capture_output=True,
                          env={**os.environ, "LONGSPEC_CACHE": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 5
    refused = subprocess.run([sys.executable, "-m", "longspec.cli.main", "generate", "--model", str(checkpoint),
                              "--max-new-tokens", "0", "abc"], capture_output=True,
                             env={**os.environ, "LONGSPEC_CACHE": str(tmp_path)}, timeout=600)
    assert refused.returncode == 2 and b"longspec: error:" in refused.stderr
