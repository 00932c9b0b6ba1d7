"""The certified head's int8 copy in the model cache: built once per machine (two
processes at once build it once), nothing half-written survives a killed builder,
a damaged copy is found by its hashes and rebuilt, and the copy a later process maps
is the one `quantize_head` derives, bit for bit (real processes and signals, each
bounded in time, like the model cache's tests)."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
from pathlib import Path

import torch

from cache_builders import TIMEOUT_S, builds, start_builder
from cache_builders import wait_for_a_build as wait_for
from head_cache_worker import seeded_head
from longspec.runtime import head_cache
from longspec.runtime.certified_head import GROUP, CertifiedHead, quantize_head
from longspec.runtime.model_cache import entry_problem

WORKER = Path(__file__).with_name("head_cache_worker.py")


def start_worker(root: Path, delay: float) -> subprocess.Popen:
    return start_builder(WORKER, root, delay)


def wait_for_a_build(root: Path, worker: subprocess.Popen) -> None:
    wait_for(root, worker, ".certified-head-*.partial")


def expected_digests() -> dict[str, str]:
    return {name: head_cache.tensor_digest(t) for name, t in sorted(quantize_head(seeded_head(), GROUP).items())}


def test_the_cached_copy_is_the_derived_one_and_decides_alike(tmp_path):
    weight = seeded_head()
    first = head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    again = head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    derived = quantize_head(weight, GROUP)
    for name, tensor in derived.items():
        assert torch.equal(first[name], tensor) and torch.equal(again[name], tensor)
    hidden = (torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    cached = CertifiedHead(weight, arrays=again)
    fresh = CertifiedHead(weight)
    assert torch.equal(cached.screen(hidden).scores, fresh.screen(hidden).scores)


def test_another_weight_or_group_is_another_entry(tmp_path):
    weight = seeded_head()
    changed = weight.clone()
    changed[7, 3] += 1
    names = {head_cache.entry_name(weight, GROUP), head_cache.entry_name(changed, GROUP),
             head_cache.entry_name(weight, 2 * GROUP)}
    assert len(names) == 3


def test_a_damaged_copy_is_found_by_its_hashes_and_rebuilt(tmp_path, caplog):
    weight = seeded_head()
    head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("certified-head-")]
    data = bytearray((entry / head_cache.FILE).read_bytes())
    data[-5] ^= 0x40  # one bit of the last array, the size unchanged: the manifest's check passes
    (entry / head_cache.FILE).write_bytes(bytes(data))
    assert entry_problem(entry) is None
    with caplog.at_level(logging.WARNING, logger="longspec"):
        arrays = head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    derived = quantize_head(weight, GROUP)
    assert all(torch.equal(arrays[name], derived[name]) for name in derived)


def test_two_processes_building_at_once_build_once_and_map_the_same_copy(tmp_path):
    first = start_worker(tmp_path, delay=3.0)
    wait_for_a_build(tmp_path, first)
    second = start_worker(tmp_path, delay=3.0)
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outputs
    assert builds(tmp_path) == 1  # the second waited for the first's entry
    assert json.loads(outputs[0][0]) == json.loads(outputs[1][0]) == expected_digests()
    assert not list(tmp_path.glob(".certified-head-*.partial"))


def test_a_builder_killed_mid_build_leaves_nothing_and_the_next_builds(tmp_path, caplog):
    worker = start_worker(tmp_path, delay=60.0)
    wait_for_a_build(tmp_path, worker)
    worker.send_signal(signal.SIGKILL)
    worker.wait(TIMEOUT_S)
    assert not [p for p in tmp_path.glob("certified-head-*") if p.is_dir()], "a killed build left an entry"
    assert list(tmp_path.glob(".certified-head-*.partial"))  # SIGKILL cannot clean up
    with caplog.at_level(logging.WARNING, logger="longspec"):
        arrays = head_cache.cached_head_arrays(seeded_head(), GROUP, directory=tmp_path)
    assert "left by an interrupted build" in caplog.text
    assert {name: head_cache.tensor_digest(t) for name, t in sorted(arrays.items())} == expected_digests()
    assert not list(tmp_path.glob(".certified-head-*.partial"))


def test_ctrl_c_mid_build_leaves_nothing(tmp_path):
    worker = start_worker(tmp_path, delay=60.0)
    wait_for_a_build(tmp_path, worker)
    worker.send_signal(signal.SIGINT)
    assert worker.wait(TIMEOUT_S) != 0
    assert not list(tmp_path.glob(".certified-head-*.partial"))
    assert not [p for p in tmp_path.glob("certified-head-*") if p.is_dir()]


def test_a_copy_for_another_screen_kernel_is_replaced_not_kept_beside(tmp_path, monkeypatch):
    weight = seeded_head()
    head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    (old,) = [p for p in tmp_path.glob("certified-head-*") if p.is_dir()]
    monkeypatch.setattr(head_cache, "sources_identity", lambda *names: "another-screen-kernel")
    head_cache.cached_head_arrays(weight, GROUP, directory=tmp_path)
    (new,) = [p for p in tmp_path.glob("certified-head-*") if p.is_dir()]
    assert new.name != old.name
    other = seeded_head().clone()
    other[0, 0] += 1  # another model's head: kept beside
    head_cache.cached_head_arrays(other, GROUP, directory=tmp_path)
    assert len([p for p in tmp_path.glob("certified-head-*") if p.is_dir()]) == 2
