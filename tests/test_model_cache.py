"""The model cache survives interrupted and concurrent builders (real processes,
each bounded in time), rebuilds partial or corrupt entries with one line saying so,
and names the directory, the bytes and LONGSPEC_CACHE when the disk is full or not
writable."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longspec.runtime import model_cache
from longspec.runtime.model_cache import MANIFEST, CacheWriteError, cached_entry, entry_problem

WORKER = Path(__file__).with_name("cache_builder_worker.py")
TIMEOUT_S = 60


def start_worker(root: Path, chunks: int = 40, delay: float = 0.05) -> subprocess.Popen:
    # SIGINT back to its default in the worker: a shell starts background jobs (and so
    # their children) with it ignored.
    return subprocess.Popen([sys.executable, str(WORKER), str(root), "entry", str(chunks), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_partial_weights(root: Path, worker: subprocess.Popen) -> None:
    """Until a builder's temporary directory holds a non-empty weights file; a builder
    that exits first fails the test with what it printed."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in root.glob(".entry.*.partial/weights.bin")):
            return
        if worker.poll() is not None:
            out, err = worker.communicate()
            raise AssertionError(f"the builder exited ({worker.returncode}) before writing: {out}{err}")
        time.sleep(0.02)
    raise AssertionError("the builder never started writing")


def quick_build(directory: Path) -> None:
    (directory / "small.json").write_text('{"ok": true}')
    (directory / "weights.bin").write_bytes(b"w" * 1000)


def builds(root: Path) -> int:
    log = root / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_ctrl_c_during_a_build_leaves_nothing_and_the_next_run_builds(tmp_path):
    worker = start_worker(tmp_path)
    wait_for_partial_weights(tmp_path, worker)
    worker.send_signal(signal.SIGINT)
    assert worker.wait(TIMEOUT_S) != 0
    assert not list(tmp_path.glob(".entry.*.partial")), "Ctrl-C left a partial build behind"
    assert not (tmp_path / "entry").exists()
    entry = cached_entry(tmp_path, "entry", quick_build, what="a test entry")
    assert entry_problem(entry) is None


def test_sigkill_during_a_build_is_cleaned_up_by_the_next_builder(tmp_path, caplog):
    worker = start_worker(tmp_path)
    wait_for_partial_weights(tmp_path, worker)
    worker.kill()
    worker.wait(TIMEOUT_S)
    assert list(tmp_path.glob(".entry.*.partial")), "SIGKILL cannot clean up: a partial directory remains"
    with caplog.at_level(logging.WARNING, logger="longspec"):
        entry = cached_entry(tmp_path, "entry", quick_build, what="a test entry")
    assert "left by an interrupted build" in caplog.text
    assert not list(tmp_path.glob(".entry.*.partial"))
    # Only the new build's files: nothing of the killed one was moved into the entry.
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, "small.json", "weights.bin"]
    assert (entry / "weights.bin").stat().st_size == 1000


def test_two_processes_building_at_once_share_one_build(tmp_path):
    first = start_worker(tmp_path, chunks=100)  # ~5 s of writing
    wait_for_partial_weights(tmp_path, first)
    second = start_worker(tmp_path, chunks=100)
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outputs
    assert outputs[0][0] == outputs[1][0] == f"{tmp_path / 'entry'}\n"
    assert builds(tmp_path) == 1  # the loser waited and used the winner's entry
    assert "waiting for another longspec process" in outputs[0][1] + outputs[1][1]
    assert entry_problem(tmp_path / "entry") is None
    assert not list(tmp_path.glob(".entry.*.partial"))


@pytest.mark.parametrize("damage", ["truncated", "no-manifest", "stray-file", "bad-manifest"])
def test_partial_or_corrupt_entries_are_rebuilt_with_one_line(tmp_path, caplog, damage):
    entry = cached_entry(tmp_path, "entry", quick_build, what="a test entry")
    if damage == "truncated":
        os.truncate(entry / "weights.bin", 10)
    elif damage == "no-manifest":
        (entry / MANIFEST).unlink()
    elif damage == "stray-file":
        (entry / "tmpabc123").write_bytes(b"x" * 100)
    else:
        (entry / MANIFEST).write_text("{not json")
    assert entry_problem(entry) is not None
    with caplog.at_level(logging.WARNING, logger="longspec"):
        rebuilt = cached_entry(tmp_path, "entry", quick_build, what="a test entry")
    lines = [r.getMessage() for r in caplog.records if "incomplete or corrupt" in r.getMessage()]
    assert len(lines) == 1 and "rebuilding it" in lines[0]
    assert entry_problem(rebuilt) is None
    assert json.loads((rebuilt / MANIFEST).read_text())["files"]["weights.bin"]["size"] == 1000


def test_full_disk_is_refused_before_the_build_naming_directory_bytes_and_variable(tmp_path, monkeypatch):
    class Usage:
        free = 5 << 20

    monkeypatch.setattr(model_cache.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(CacheWriteError) as error:
        cached_entry(tmp_path, "entry", quick_build, what="a test entry", needed_bytes=300 << 20)
    message = str(error.value)
    assert str(tmp_path) in message and "300 MiB" in message and "5 MiB" in message and "LONGSPEC_CACHE" in message


@pytest.mark.parametrize("code,expected", [(errno.ENOSPC, "disk filled up"), (errno.EACCES, "Permission denied")])
def test_write_errors_during_a_build_name_the_fix(tmp_path, code, expected):
    def failing_build(directory: Path) -> None:
        (directory / "part").write_bytes(b"x")
        raise OSError(code, os.strerror(code))

    with pytest.raises(CacheWriteError) as error:
        cached_entry(tmp_path, "entry", failing_build, what="a test entry", needed_bytes=1 << 30)
    assert expected in str(error.value) and "LONGSPEC_CACHE" in str(error.value) and str(tmp_path) in str(error.value)
    assert not list(tmp_path.glob(".entry.*.partial")) and not (tmp_path / "entry").exists()


def test_a_cache_root_that_is_a_file_is_named(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(OSError) as error:
        cached_entry(blocker / "cache", "entry", quick_build, what="a test entry")
    assert "not-a-dir" in str(error.value)
