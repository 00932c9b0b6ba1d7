"""What a verification round costs now: the cached measurement, scaled online.

The forward cost is measured once per machine, model and context and cached; the
machine then runs slower or faster than it was measured (other work on the cores,
a neighbour taking memory bandwidth, the context growing within its bucket). The
controller scales the measured curve by the realised / measured time of its recent
rounds, one factor for every tree size.

Fitting the curve's shape as well — the weight-bound base and what the nodes add
scaled apart, and the cost of each accepted token's draw told apart from both
(`benchmarks/suite/adaptive_cost_fits.py`) — was measured against this one factor on
replayed bench outputs and did not pay
(docs/lab-notes/auto-controller.md#autos-cost-correction-one-factor-or-the-measured-curve-refitted-per-term-issue-adaptive-speculation--measured-left-out).
The `cost_fit_type` of `AdaptiveDrafter` is where such alternatives plug in.
"""

from __future__ import annotations

# Realised times beyond these multiples of the measurement are clipped: a stall (a
# preempted thread, a page-fault storm) says nothing about the machine's speed, and
# one such round must not swing the scale.
CLIP = (0.25, 4.0)


class RealisedCostScale:
    EMA = 0.2  # weight of the newest round

    def __init__(self) -> None:
        self.scale = 1.0  # moving average of realised / measured

    def seconds(self, base: float, extra: float) -> float:
        """Predicted seconds of a forward measured at `base` (the root alone) plus
        `extra` (what the tree's nodes add to it)."""
        return self.scale * (base + extra)

    def observe(self, base: float, extra: float, realised: float, accepted: int = 0) -> None:
        """One round whose forward was measured at `base` + `extra` took `realised`
        seconds and accepted `accepted` speculative tokens."""
        ratio = realised / max(base + extra, 1e-12)
        self.scale = (1 - self.EMA) * self.scale + self.EMA * min(max(ratio, CLIP[0]), CLIP[1])

    def telemetry(self) -> dict:
        return {"cost_scale": self.scale}
