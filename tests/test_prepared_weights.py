"""The weights as the decoder takes them, kept in the model cache (`prepared_weights`): a
load from the cached entry has bit for bit the parameters, packed copies and logits of a
load that builds them from the checkpoint; an entry for another checkpoint, format or
build code is made anew (and replaces the old one); a damaged entry is found by its hashes
and rebuilt; two processes building at once build once, and a builder killed mid-build
leaves nothing the next load would use (real processes and signals, bounded in time, like
the model cache's tests). Also: the packed copies made by one strided copy are the
kernel's own packing, and the huge-page arena reports how much of it the kernel backs with
huge pages."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from cache_builders import TIMEOUT_S, builds, start_builder
from cache_builders import wait_for_a_build as wait_for
from longspec.runtime import head_cache, huge_pages, prepared_weights
from longspec.runtime.head_cache import tensor_digest
from longspec.runtime.linear import pack_tiles, tiles_nbytes
from longspec.runtime.loading import _read_shards, fused_params, load_checkpoint_dir
from longspec.runtime.model_cache import entry_problem
from longspec.runtime.native import bf16_linear_ops
from tiny_models import random_ids, save_checkpoint

WORKER = Path(__file__).with_name("prepared_weights_worker.py")


@pytest.fixture
def checkpoint(tmp_path):
    return save_checkpoint(tmp_path / "checkpoint", "gemma3")


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(prepared_weights.PREFIX + "*") if p.is_dir())


def fresh_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    from longspec.runtime.checkpoint_config import read_config

    return fused_params(read_config(checkpoint), _read_shards(sorted(checkpoint.glob("*.safetensors"))), torch.bfloat16)


def digests(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in sorted(params.items())}


def assert_same_model(a, b):
    named_a, named_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert named_a.keys() == named_b.keys()
    for name, tensor in named_a.items():
        assert tensor.dtype == named_b[name].dtype and torch.equal(tensor, named_b[name]), name
    packed_a, packed_b = a._packed_weights(), b._packed_weights()
    assert len(packed_a) == len(packed_b)
    for x, y in zip(packed_a, packed_b):
        assert (x.tiles is None) == (y.tiles is None)
        if x.tiles is not None:
            assert torch.equal(x.tiles.view(torch.int16), y.tiles.view(torch.int16))
    ids = random_ids(9, seed=3)
    torch.testing.assert_close(a(ids, a.new_cache(16)).logits, b(ids, b.new_cache(16)).logits, rtol=0, atol=0)


def test_a_load_from_the_cached_entry_is_the_built_model_bit_for_bit(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(head_cache, "default_directory", lambda: tmp_path / "prepared")
    built = load_checkpoint_dir(checkpoint).model  # from the checkpoint, no entry
    first = load_checkpoint_dir(checkpoint, prepared=True).model  # builds the entry
    (entry,) = entries(tmp_path / "prepared")
    assert entry_problem(entry) is None
    mapped = load_checkpoint_dir(checkpoint, prepared=True).model  # maps it
    assert_same_model(built, first)
    assert_same_model(built, mapped)
    # The plain weights are views of the entry's file (nothing copied), private to the process.
    assert mapped.embed_weight.untyped_storage().nbytes() == (entry / prepared_weights.FILE).stat().st_size
    before = (entry / prepared_weights.FILE).read_bytes()
    mapped.embed_weight.data[0, 0] += 1
    assert (entry / prepared_weights.FILE).read_bytes() == before


def test_another_checkpoint_or_format_builds_a_new_entry_that_replaces_the_old(checkpoint, tmp_path, monkeypatch):
    root = tmp_path / "prepared"
    prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    (old,) = entries(root)
    monkeypatch.setattr(prepared_weights, "FORMAT", prepared_weights.FORMAT + "-next")  # another format or build code
    params = prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    (new,) = entries(root)
    assert new != old and digests(params) == digests(fresh_params(checkpoint))
    # The checkpoint changes (converted again): its weights are read again, not the stale entry's.
    save_checkpoint(checkpoint, "gemma3", seed=1)
    params = prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    assert digests(params) == digests(fresh_params(checkpoint)) != digests(fresh_params_of_seed0(tmp_path))


def fresh_params_of_seed0(tmp_path: Path) -> dict[str, torch.Tensor]:
    return fresh_params(save_checkpoint(tmp_path / "seed0", "gemma3"))


def test_a_damaged_entry_is_found_by_its_hashes_and_rebuilt(checkpoint, tmp_path, caplog):
    root = tmp_path / "prepared"
    prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    (entry,) = entries(root)
    data = bytearray((entry / prepared_weights.FILE).read_bytes())
    data[-3] ^= 0x10  # one bit of a weight, the size unchanged: the manifest's check passes
    (entry / prepared_weights.FILE).write_bytes(bytes(data))
    assert entry_problem(entry) is None
    with caplog.at_level(logging.WARNING, logger="longspec"):
        params = prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    assert digests(params) == digests(fresh_params(checkpoint))


def start_worker(checkpoint: Path, root: Path, delay: float) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    return start_builder(WORKER, checkpoint, root, delay)


def wait_for_a_build(root: Path, worker: subprocess.Popen) -> None:
    wait_for(root, worker, f".{prepared_weights.PREFIX}*.partial")


def test_two_processes_building_at_once_build_once_and_map_the_same_weights(checkpoint, tmp_path):
    root = tmp_path / "prepared"
    first = start_worker(checkpoint, root, delay=3.0)
    wait_for_a_build(root, first)
    second = start_worker(checkpoint, root, delay=3.0)
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outputs
    assert builds(root) == 1  # the second waited for the first's entry
    assert json.loads(outputs[0][0]) == json.loads(outputs[1][0]) == digests(fresh_params(checkpoint))
    assert not list(root.glob(f".{prepared_weights.PREFIX}*.partial"))


def test_a_builder_killed_mid_build_leaves_nothing_and_the_next_builds(checkpoint, tmp_path, caplog):
    root = tmp_path / "prepared"
    worker = start_worker(checkpoint, root, delay=60.0)
    wait_for_a_build(root, worker)
    worker.send_signal(signal.SIGKILL)
    worker.wait(TIMEOUT_S)
    assert not entries(root), "a killed build left an entry"
    assert list(root.glob(f".{prepared_weights.PREFIX}*.partial"))  # SIGKILL cannot clean up
    with caplog.at_level(logging.WARNING, logger="longspec"):
        params = prepared_weights.cached_params(checkpoint, torch.bfloat16, lambda: fresh_params(checkpoint), root=root)
    assert "left by an interrupted build" in caplog.text
    assert digests(params) == digests(fresh_params(checkpoint))
    assert not list(root.glob(f".{prepared_weights.PREFIX}*.partial"))


@pytest.mark.skipif(bf16_linear_ops() is None, reason="the native bf16 kernels are not built here")
@pytest.mark.parametrize("shape", [(64, 40), (48, 7), (37, 40), (16, 2), (5, 3)])
def test_packed_copies_made_by_one_strided_copy_are_the_kernels_packing(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    weights = [torch.randn(*shape, generator=generator).to(torch.bfloat16) for _ in range(2)]
    outs = [None, torch.full((tiles_nbytes(weights[1]) + 10,), 0xAB, dtype=torch.uint8)]
    called = []
    tiles = pack_tiles(weights, outs, before_copy=lambda: called.append(True))
    assert called == [True]
    for weight, packed in zip(weights, tiles):
        assert torch.equal(packed.view(torch.int16), bf16_linear_ops().bf16_pack_weight(weight).view(torch.int16))
    assert tiles[1].data_ptr() == outs[1].data_ptr()


@pytest.mark.skipif(huge_pages.huge_page_policy() not in ("always", "madvise"), reason="no transparent huge pages")
def test_the_arena_reports_how_much_of_it_is_on_huge_pages():
    (buffer,) = huge_pages.huge_page_buffers([8 * huge_pages.HUGE_PAGE_BYTES])
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    buffer.fill_(1)
    backed = huge_pages.huge_page_bytes(buffer)
    assert backed is not None and 0 <= backed <= buffer.numel() + huge_pages.HUGE_PAGE_BYTES
