"""`auto` prices trees by the cached forward-cost measurement refitted to the rounds it
times: the weight-bound base and what the nodes add are scaled apart, so a machine
whose memory got slower (a neighbour taking bandwidth) after the measurement makes
small trees dearer, not large ones cheaper."""

from __future__ import annotations

import random

import pytest
import torch

from longspec.speculation.drafters.adaptive import AdaptiveDrafter
from longspec.speculation.drafters.adaptive.cost_fit import OnlineCostFit
from longspec.speculation.drafters.base import DraftContext
from test_adaptive import CopiedRuns, FakeClock, cheap_trees_cost


def test_the_base_and_the_nodes_are_scaled_apart():
    fit = OnlineCostFit()
    measured = cheap_trees_cost(0.1)
    base = measured.seconds_for(1)
    for k in [1, 13, 5, 9, 2, 16] * 10:
        extra = measured.seconds_for(k) - base
        fit.observe(base, extra, 2.0 * base + 0.5 * extra)
    assert fit.a == pytest.approx(2.0, rel=0.02) and fit.b == pytest.approx(0.5, rel=0.05)
    extra = measured.seconds_for(11) - base
    assert fit.seconds(base, extra) == pytest.approx(2.0 * base + 0.5 * extra, rel=0.02)


def test_rounds_of_one_size_leave_one_factor():
    """They cannot tell the base from the nodes: the prior decides, and the whole
    measured curve is scaled by the realised ratio, as before the fit."""
    fit = OnlineCostFit()
    for _ in range(30):
        fit.observe(0.010, 0.004, 1.5 * 0.014)
    assert fit.a == pytest.approx(1.5, rel=1e-3) and fit.b == pytest.approx(1.5, rel=1e-3)
    speculation_off = OnlineCostFit()
    for _ in range(30):
        speculation_off.observe(0.010, 0.0, 0.030)
    assert speculation_off.a == pytest.approx(3.0, rel=1e-3) and speculation_off.b == pytest.approx(3.0, rel=1e-2)


def test_a_stall_is_clipped():
    fit = OnlineCostFit()
    for _ in range(20):
        fit.observe(0.010, 0.0, 0.010)
    fit.observe(0.010, 0.0, 5.0)  # 500x the measurement: a preempted thread, not the machine
    assert fit.a <= 1.0 + (4.0 - 1.0) * 0.2


def test_the_controller_learns_that_the_base_got_dearer_and_keeps_its_long_copies():
    """The machine now: the base forward costs twice its measurement, each node what it
    measured. The controller's telemetry shows both factors, and after a long copied
    run it still verifies the whole chain."""
    measured = cheap_trees_cost(0.1)
    base = measured.seconds_for(1)

    def machine_now(tokens: int) -> float:
        return 2.0 * base + (measured.seconds_for(tokens) - base)

    copier = CopiedRuns()
    clock = FakeClock()
    drafter = AdaptiveDrafter([("copy", copier)], forward_cost=measured, clock=clock)
    context = DraftContext(tokens=torch.zeros(4, dtype=torch.long), max_nodes=24)
    drafter.begin(context)
    rng = random.Random(0)
    chosen = []
    for _ in range(300):
        copier.run = rng.choice([1, 30])
        tree = drafter.propose(context)
        clock.now += machine_now(tree.size)
        if copier.run == 30:
            chosen.append(tree.size - 1)
        right = copier.length if copier.run == 30 else 0
        drafter.observe(torch.tensor(list(range(1, right + 1)) + [999]))
    telemetry = drafter.telemetry()
    assert telemetry["cost_scale_base"] == pytest.approx(2.0, rel=0.05), telemetry
    assert telemetry["cost_scale_extra"] == pytest.approx(1.0, rel=0.1), telemetry
    assert min(chosen[-50:]) == copier.length
