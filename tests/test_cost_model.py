"""The forward-cost model: interpolation, measurement on a tiny model, and the
per-machine cache that is reused under the same key and re-measured under another."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from longspec.runtime.native import native_ops
from longspec.speculation import cost_model
from longspec.speculation.cost_model import ForwardCost, cached_forward_cost, measure_forward_cost
from tiny_models import tiny_decoder

MACHINE = {"cpu": "test cpu", "cores": 2}


def test_interpolation_relative_cost_and_extrapolation():
    cost = ForwardCost({}, (1, 2, 4, 8), (0.010, 0.011, 0.012, 0.020))
    assert cost.seconds_for(4) == 0.012
    assert cost.seconds_for(3) == pytest.approx(0.0115)
    assert cost.seconds_for(6) == pytest.approx(0.016)
    assert cost.seconds_for(10) == pytest.approx(0.024)  # the last slope continues
    assert cost.relative(8) == pytest.approx(2.0)
    assert ForwardCost.from_json(cost.to_json()) == cost
    with pytest.raises(ValueError, match="k must be >= 1"):
        cost.seconds_for(0)
    with pytest.raises(ValueError, match="ks must be increasing"):
        ForwardCost({}, (2, 4), (0.1, 0.2))


def test_a_measured_dip_is_priced_at_the_cost_of_fewer_tokens():
    """More tokens never cost less: a dip in the measurement is timing noise."""
    cost = ForwardCost({}, (1, 2, 4, 8), (0.010, 0.009, 0.012, 0.011))
    assert [cost.seconds_for(k) for k in (1, 2, 4, 8)] == [0.010, 0.010, 0.012, 0.012]
    assert cost.seconds_for(3) == pytest.approx(0.011)
    assert cost.seconds_for(16) == pytest.approx(0.012)  # the envelope's last slope: flat
    assert ForwardCost.from_json(cost.to_json()).seconds == cost.seconds  # the file keeps what was measured


def test_measurement_times_every_k_on_a_real_forward():
    model = tiny_decoder("gemma3", dtype=torch.float32, max_position_embeddings=512)
    ticks = itertools.count()
    cost = measure_forward_cost(model, context=100, ks=(2, 8), repeats=2, machine=MACHINE, clock=lambda: next(ticks))
    assert cost.ks == (1, 2, 8)  # plain decoding is always measured
    assert cost.seconds == (1, 1, 1)  # one tick per forward under the fake clock
    assert cost.key["context"] == 100 and cost.key["dtype"] == "torch.float32" and cost.key["machine"] == MACHINE
    real = measure_forward_cost(model, context=100, ks=(1, 4), repeats=1)
    assert all(s > 0 for s in real.seconds)
    with pytest.raises(ValueError, match="must fit the model's 512 positions"):
        measure_forward_cost(model, context=500, ks=(64,))


def test_cache_is_reused_under_the_same_key_and_remeasured_under_another(tmp_path, monkeypatch):
    model = tiny_decoder("llama", dtype=torch.float32, max_position_embeddings=512)
    calls = []
    real = cost_model.measure_forward_cost

    def counting(*args, **kwargs):
        calls.append(kwargs["context"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "measure_forward_cost", counting)
    first = cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    again = cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    assert again == first and calls == [64]
    cached_forward_cost(model, context=128, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    other_machine = {"cpu": "another cpu", "cores": 2}
    cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=other_machine)
    cached_forward_cost(model.to(torch.float64), context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    assert calls == [64, 128, 64, 64]
    model.to(torch.bfloat16).prepare()
    cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    model.prepare(native_kernels=False)  # other kernels (where this machine builds them), another speed
    cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    assert calls == [64, 128, 64, 64, 64] + ([64] if native_ops() is not None else [])
    for path in tmp_path.glob("*.json"):
        path.write_text("{broken")
    cached_forward_cost(model, context=128, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    assert calls[-1] == 128  # an unreadable entry is measured again


def test_a_measurement_on_a_busy_machine_warns_and_names_the_file_to_delete(tmp_path, monkeypatch):
    model = tiny_decoder("llama", dtype=torch.float32, max_position_embeddings=512)
    monkeypatch.setattr(cost_model.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cost_model, "cores_busy_elsewhere", lambda: 1.2)
    with pytest.warns(RuntimeWarning, match=r"busy \(other processes keep 1.2 of 2 cores busy\).*delete .*\.json"):
        cached_forward_cost(model, context=64, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    # This process's own recent work (a benchmark between its timed runs) raises the load
    # average, not the cores busy elsewhere: no warning.
    monkeypatch.setattr(cost_model, "cores_busy_elsewhere", lambda: 0.1)
    monkeypatch.setattr(cost_model, "load_average", lambda: 5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cached_forward_cost(model, context=128, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    # Where the operating system reports no CPU times, the load average stands in.
    monkeypatch.setattr(cost_model, "cores_busy_elsewhere", lambda: None)
    with pytest.warns(RuntimeWarning, match=r"busy \(1-minute load 5.0 on 2 cores\)"):
        cached_forward_cost(model, context=256, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)
    monkeypatch.setattr(cost_model, "load_average", lambda: 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cached_forward_cost(model, context=192, directory=tmp_path, ks=(1, 4), repeats=1, machine=MACHINE)


def test_cores_busy_elsewhere_counts_other_processes_time_not_this_ones(monkeypatch):
    from longspec.runtime import machine

    real = machine.cores_busy_elsewhere(window_s=0.05)
    assert real is None or real >= 0.0
    seconds = {"machine": iter([100.0, 101.5]), "own": iter([10.0, 10.5]), "clock": iter([0.0, 1.0])}
    monkeypatch.setattr(machine, "_machine_busy_seconds", lambda: next(seconds["machine"]))
    monkeypatch.setattr(machine, "_own_cpu_seconds", lambda: next(seconds["own"]))
    busy = machine.cores_busy_elsewhere(window_s=1.0, clock=lambda: next(seconds["clock"]), sleep=lambda s: None)
    assert busy == pytest.approx(1.0)  # 1.5 busy core-seconds in 1 s, 0.5 of them this process's


def test_a_batched_forward_is_timed_over_rows_of_random_keys_and_cached_per_row_count(tmp_path, monkeypatch):
    model = tiny_decoder("gemma3", dtype=torch.float32, max_position_embeddings=512)
    ticks = itertools.count()
    cost = cost_model.measure_batch_forward_cost(model, rows=3, context=40, widths=(2, 4), repeats=2, machine=MACHINE,
                                                 clock=lambda: next(ticks))
    assert cost.ks == (1, 2, 4) and cost.seconds == (1, 1, 1) and cost.key["rows"] == 3 and cost.key["context"] == 40
    calls = []
    real = cost_model.measure_batch_forward_cost
    monkeypatch.setattr(cost_model, "measure_batch_forward_cost", lambda *a, **k: calls.append(k["rows"]) or real(*a, **k))
    options = dict(directory=tmp_path, widths=(1, 2), repeats=1, machine=MACHINE)
    first = cost_model.cached_batch_forward_cost(model, rows=2, context=40, **options)
    assert cost_model.cached_batch_forward_cost(model, rows=2, context=40, **options) == first
    cost_model.cached_batch_forward_cost(model, rows=4, context=40, **options)
    assert calls == [2, 4]


def test_random_keys_fill_every_row_and_ring_as_a_prefill_would():
    """The measurement's context is committed without a prefill (a forward's cost does
    not depend on the K/V numbers): every row holds the context, each ring slot the
    position a prefill would have put there, and forwards run over it."""
    from longspec.runtime.batch_cache import BatchKVCache

    model = tiny_decoder("gemma3", dtype=torch.float32, max_position_embeddings=512)
    assert any(model.config.layer_is_sliding)
    cache = BatchKVCache(model.config, 128, 3, max_forward_tokens=16, dtype=torch.float32)
    for _ in range(3):
        cache.acquire()
    rows = cache.rows(0, 3)
    cost_model.commit_random_keys(model, rows, 100, chunk=16)
    assert rows.lengths.tolist() == [100, 100, 100]
    window = cache.ring_size
    expected = sorted(range(100 - window, 100))
    assert all(sorted(cache.ring_positions[b].tolist()) == expected for b in range(3))
    out = model(torch.tensor([[1, 2]] * 3), rows, positions=rows.next_positions(2))
    assert out.logits.isfinite().all()
    single = model.new_cache(128, max_forward_tokens=16)
    cost_model.commit_random_keys(model, single, 50, chunk=16)
    assert single.length == 50


def test_a_copied_cache_row_holds_the_same_keys_and_values():
    from longspec.runtime.batch_cache import BatchKVCache

    model = tiny_decoder("gemma3", dtype=torch.float64, max_position_embeddings=512)
    cache = BatchKVCache(model.config, 64, 2, max_forward_tokens=32, dtype=torch.float64)
    a, b = cache.acquire(), cache.acquire()
    view = a.view()
    model(torch.arange(20).unsqueeze(0) % 7, view, positions=view.next_positions(20), with_logits=False)
    view.commit()
    cache.copy_row(a, b)
    assert b.length == a.length == 20
    tokens = torch.tensor([[3, 4], [3, 4]])
    both = cache.rows(0, 2)
    out = model(tokens, both, positions=both.next_positions(2))
    torch.testing.assert_close(out.logits[0], out.logits[1], rtol=0, atol=0)
