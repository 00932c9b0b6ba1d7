"""What a verification forward costs now: the cached measurement, refitted online.

The forward cost is measured once per machine, model and context, on an idle
machine, and cached. The machine does not stay as it was measured: on a shared
host another tenant can take memory bandwidth for minutes, and that slows the
weight-bound part of a forward (reading every weight once, whatever the tree's
size) far more than the compute-bound part that grows with the tree (measured on
this project's 2-core VM, 1024-token context: one token 15.7 ms and sixteen
41.2 ms when cached, 21.7 and 41.3 ms hours later). Scaling the whole curve by one
factor, as a single realised / measured ratio does, then keeps the measured
curve's shape: a 10-node chain stays priced 1.7x a 3-node tree where it now costs
1.3x, and the controller verifies trees smaller than they should be.

So a round's verification is predicted as a * base + b * extra: `base` the measured
forward of the root alone, `extra` what the tree's nodes add to it in the
measurement. a and b are fitted by least squares to the realised round times,
recent rounds weighted most (`FADE`), with a prior that pulls both toward the
realised / measured ratio of the last few rounds (one factor, as before). Rounds
that all verify trees of one size cannot tell a from b; the prior then decides,
and the fit is that single factor.
"""

from __future__ import annotations

import numpy as np

# Realised times beyond these multiples of the measurement are clipped before they
# are fitted: a stall (a page fault storm, a preempted thread) says nothing about
# the curve, and one such round must not swing the fit.
_CLIP = (0.25, 4.0)


class OnlineCostFit:
    FADE = 0.95  # share of the fitted statistics kept per round (the last ~20 rounds weigh most)
    LEVEL_EMA = 0.2  # weight of the newest round in the one-factor ratio the prior pulls toward
    PRIOR_ROUNDS = 0.1  # the prior's weight, in rounds of typical size
    # A tree size never verified still gets this share of the base's prior weight, so
    # b stays defined (and equal to the one factor) while speculation is off.
    MIN_EXTRA_SHARE = 0.01

    def __init__(self) -> None:
        self.level = 1.0  # moving average of realised / measured
        self.a = self.b = 1.0
        self._gram = np.zeros((2, 2))  # faded Σ x xᵀ, x = (base, extra)
        self._moment = np.zeros(2)  # faded Σ x · realised
        self._weight = 0.0  # faded number of rounds

    def seconds(self, base: float, extra: float) -> float:
        """Predicted seconds of a forward measured at `base` + `extra`."""
        return self.a * base + self.b * extra

    def observe(self, base: float, extra: float, realised: float) -> None:
        """One verification forward measured at `base` + `extra` took `realised` seconds."""
        measured = max(base + max(extra, 0.0), 1e-12)
        ratio = min(max(realised / measured, _CLIP[0]), _CLIP[1])
        self.level = (1 - self.LEVEL_EMA) * self.level + self.LEVEL_EMA * ratio
        x = np.array([base, max(extra, 0.0)])
        self._gram = self.FADE * self._gram + np.outer(x, x)
        self._moment = self.FADE * self._moment + x * (ratio * measured)
        self._weight = self.FADE * self._weight + 1.0
        typical = np.diag(self._gram) / self._weight
        prior = self.PRIOR_ROUNDS * np.maximum(typical, self.MIN_EXTRA_SHARE * typical[0])
        a, b = np.linalg.solve(self._gram + np.diag(prior), self._moment + prior * self.level)
        self.a = float(min(max(a, _CLIP[0]), _CLIP[1]))
        self.b = float(min(max(b, _CLIP[0]), _CLIP[1]))
