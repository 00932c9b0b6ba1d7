"""The forward-cost model: interpolation, measurement on a tiny model, and the
per-machine cache that is reused under the same key and re-measured under another."""

from __future__ import annotations

import itertools

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
