"""Writes a kill cannot half-do (runtime/atomic_files.py): atomic replacement, checkpoints
of several files committed as one (real SIGKILLs at random instants: every restart
finds the files of one committed step), resume refused on damaged files or changed
inputs, torn tails of append-only logs, and the native build's stale lock."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from longspec.runtime.atomic_files import Checkpoint, CheckpointError, trim_torn_tail, write_atomically


def test_write_atomically_replaces_or_leaves_the_old_file(tmp_path):
    path = tmp_path / "f.json"
    write_atomically(path, "old")
    write_atomically(path, b"new")
    assert path.read_text() == "new"

    def broken(temporary: Path) -> None:
        temporary.write_text("half")
        raise OSError("disk gone")

    with pytest.raises(OSError):
        write_atomically(path, broken)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def writer(text: str):
    return lambda path: Path(path).write_text(text)


def test_a_checkpoint_commits_its_files_as_one(tmp_path):
    run = Checkpoint(tmp_path)
    run.commit({"weights": writer("w1"), "state": writer("s1")}, {"lr": 1}, step=1)
    assert run.verify({"lr": 1})["step"] == 1
    # Killed after staging, before the manifest: the old checkpoint stands.
    (tmp_path / "weights.next").write_text("w2")
    assert Checkpoint(tmp_path).verify({"lr": 1})["step"] == 1
    assert (tmp_path / "weights").read_text() == "w1" and not (tmp_path / "weights.next").exists()
    # Killed after the manifest, before the renames: the next run finishes them.
    run.commit({"weights": writer("w2"), "state": writer("s2")}, {"lr": 1}, step=2)
    os.replace(tmp_path / "weights", tmp_path / "weights.next")
    (tmp_path / "weights").write_text("w1")  # the old file still in place
    assert Checkpoint(tmp_path).verify({"lr": 1})["step"] == 2
    assert (tmp_path / "weights").read_text() == "w2"


def test_resume_is_refused_on_damaged_files_or_changed_inputs(tmp_path):
    run = Checkpoint(tmp_path)
    run.commit({"weights": writer("w"), "state": writer("s")}, {"lr": 1, "corpus": "abc"}, step=3)
    with pytest.raises(CheckpointError, match=r"other inputs \(corpus changed\)"):
        run.verify({"lr": 1, "corpus": "xyz"})
    (tmp_path / "state").write_text("tampered")
    with pytest.raises(CheckpointError, match="does not match the checkpoint of step 3"):
        run.verify({"lr": 1, "corpus": "abc"})
    (tmp_path / "state").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        run.verify({"lr": 1, "corpus": "abc"})


KILLED_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from longspec.runtime.atomic_files import Checkpoint

    out = Path(sys.argv[1])
    run = Checkpoint(out)
    manifest = run.manifest()
    step = manifest["step"] if manifest else 0
    while True:
        step += 1
        big = str(step).encode() * 200_000  # a few MB: kills land mid-write too
        run.commit({"weights": lambda p: p.write_bytes(big), "state": lambda p: p.write_text(str(step))},
                   {"run": "kill-test"}, step)
        print(step, flush=True)
""")


def test_sigkill_at_random_instants_leaves_one_committed_step(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    out = tmp_path / "run"
    rng = random.Random(7)
    last_step = 0
    for kill in range(12):
        process = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True)
        process.stdout.readline()  # at least one commit in this run
        time.sleep(rng.uniform(0.0, 0.3))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        manifest = Checkpoint(out).verify({"run": "kill-test"})
        step = manifest["step"]
        assert step > last_step  # nothing committed was lost, every restart went on
        assert (out / "state").read_text() == str(step)
        assert (out / "weights").read_bytes() == str(step).encode() * 200_000
        last_step = step
    assert not list(out.glob("*.next")) or Checkpoint(out).manifest() is not None


def test_a_torn_tail_is_cut_and_damage_elsewhere_refused(tmp_path):
    log = tmp_path / "rows.jsonl"
    log.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')

    def complete(line: bytes) -> bool:
        try:
            json.loads(line)
            return True
        except ValueError:
            return False

    assert trim_torn_tail(log, complete) == len('{"a": 3')
    assert log.read_text() == '{"a": 1}\n{"a": 2}\n'
    log.write_text('{"a": 1}\n{"a": 2\n{"a": 3}\n')
    with pytest.raises(ValueError, match="line 2 is damaged"):
        trim_torn_tail(log, complete)


def test_a_dead_builders_lock_is_taken_over(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    from longspec.runtime import native

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    (tmp_path / "lock").write_text("")  # what a build killed mid-way leaves
    with native._build_lock():
        assert not (tmp_path / "lock").exists()


def test_bench_resume_refuses_another_run_and_keeps_every_complete_row(tmp_path):
    from longspec.bench.runner import _is_json, check_same_run, load_rows

    results = tmp_path / "results.jsonl"
    header = {"kind": "header", "model": "m", "dtype": "bfloat16", "max_new_tokens": 64, "machine": {"cpu": "x"}}
    results.write_text(json.dumps(header) + "\n" + json.dumps({"kind": "run", "i": 1}) + "\n" + '{"kind": "ru')
    trim_torn_tail(results, _is_json)
    rows = load_rows(results)
    assert [r["kind"] for r in rows] == ["header", "run"]
    check_same_run(rows, {**header, "kind": None}, results)
    with pytest.raises(ValueError, match=r"dtype: 'bfloat16' -> 'float32'"):
        check_same_run(rows, {**header, "dtype": "float32"}, results)


def test_a_responses_file_loses_only_a_torn_last_line(tmp_path):
    from longspec.training.responses import answered_ids

    path = tmp_path / "responses.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "c", "te')
    assert answered_ids(path) == {"a", "b"} and path.read_text().endswith("}\n")
    path.write_text('{"id": "a"}\nnot json\n{"id": "c"}\n')
    with pytest.raises(ValueError, match="line 2 is damaged"):
        answered_ids(path)


def test_a_training_run_resumes_only_with_its_own_inputs(tmp_path):
    import torch

    from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions
    from tiny_models import tiny_decoder
    from training_setup import small_draft_config

    target = tiny_decoder("gemma3", dtype=torch.float32)
    tokens = torch.randint(0, target.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0))
    options = TrainOptions(steps=2, seq_len=32, batch_size=2, save_every=1)
    config = small_draft_config(target)
    LongSpecTrainer(target, tokens, tmp_path / "run", options, draft_config=config, progress=False).train()
    assert LongSpecTrainer(target, tokens, tmp_path / "run", TrainOptions(steps=4, seq_len=32, batch_size=2),
                           draft_config=config, progress=False).step == 2  # more steps: a resume
    with pytest.raises(CheckpointError, match=r"options changed"):
        LongSpecTrainer(target, tokens, tmp_path / "run", TrainOptions(steps=2, seq_len=32, batch_size=2, lr=0.5),
                        draft_config=config, progress=False)
    with pytest.raises(CheckpointError, match=r"tokens changed"):
        LongSpecTrainer(target, tokens.flip(0), tmp_path / "run", options, draft_config=config, progress=False)
    (tmp_path / "run" / "checkpoint.json").unlink()  # a directory of an older version
    with pytest.raises(CheckpointError, match="without a checkpoint manifest"):
        LongSpecTrainer(target, tokens, tmp_path / "run", options, draft_config=config, progress=False)
