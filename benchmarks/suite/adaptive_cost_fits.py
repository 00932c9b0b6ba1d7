"""Alternatives to `auto`'s one-factor cost scale, kept for the replay
(`adaptive_replay.py`'s `auto-pld-cost-fit` and `auto-pld-nodes-only-cost-fit`):
measured against it and left out
(docs/lab-notes/auto-controller.md#autos-cost-correction-one-factor-or-the-measured-curve-refitted-per-term-issue-adaptive-speculation--measured-left-out).

The forward cost is measured once, on an idle machine, and cached. The machine does
not stay as it was measured: on this project's 2-core VM, 1024-token context, one
token took 15.7 ms and sixteen 41.2 ms when cached, 20.4-21.7 and 40.8-43.4 ms hours
later: the weight-bound base got 30-38% dearer, the nodes' part did not. One factor
keeps the measured curve's shape. `ThreeTermCostFit` models a round's verification
as a * base + b * extra + c * accepted: `base` the measured forward of the root
alone, `extra` what the tree's nodes add to it in the measurement, `accepted` the
speculative tokens the round accepted (under sampling each is drawn from the
processed distribution over the whole vocabulary, 2.3-3.4 ms a token here; a fit
without that term, `NodesOnlyCostFit`, charges it to the nodes: 2.5-2.7x their
measured cost on sampled AIME and Spec-Bench rows, where `auto` then verified 4-5
nodes and fell behind prompt lookup's 10). a, b and c are fitted by least squares
to the realised rounds, recent rounds weighted most (`FADE`), with a weak prior:
a toward the recent realised / measured ratio (the one factor), b toward a (the
measured shape), c toward 0. Trees are priced by a * base + b * extra alone: a cost
per accepted token is paid whatever tree the tokens come from.
"""

from __future__ import annotations

import numpy as np

from longspec.speculation.drafters.adaptive.cost_fit import CLIP

class ThreeTermCostFit:
    FADE = 0.95  # share of the fitted statistics kept per round (the last ~20 rounds weigh most)
    LEVEL_EMA = 0.2  # weight of the newest round in the one-factor ratio the prior pulls toward
    PRIOR_ROUNDS = 0.02  # the prior's weight, in rounds of typical size
    # Rounds that never verified a node still give b this share of the base's prior
    # weight, so b stays defined (the one factor) while speculation is off.
    MIN_EXTRA_SHARE = 0.01
    TOKEN_PRIOR_SHARE = 0.01  # c's prior weight against the others' (see `observe`)

    def __init__(self) -> None:
        self.level = 1.0  # moving average of realised / measured
        self.a = self.b = 1.0
        self.c = 0.0  # seconds per accepted token
        self._gram = np.zeros((3, 3))  # faded Σ x xᵀ, x = (base, extra, accepted)
        self._moment = np.zeros(3)  # faded Σ x · realised
        self._weight = 0.0  # faded number of rounds

    def seconds(self, base: float, extra: float) -> float:
        """Predicted seconds of a forward measured at `base` + `extra` (the cost of
        the tokens it accepts left out: it is the same whichever tree they come from)."""
        return self.a * base + self.b * extra

    def observe(self, base: float, extra: float, realised: float, accepted: int = 0) -> None:
        """One round whose forward was measured at `base` + `extra` took `realised`
        seconds and accepted `accepted` speculative tokens."""
        extra = max(extra, 0.0)
        measured = max(base + extra, 1e-12)
        ratio = min(max(realised / measured, CLIP[0]), CLIP[1])
        self.level = (1 - self.LEVEL_EMA) * self.level + self.LEVEL_EMA * ratio
        x = np.array([base, extra, float(accepted)])
        self._gram = self.FADE * self._gram + np.outer(x, x)
        self._moment = self.FADE * self._moment + x * (ratio * measured)
        self._weight = self.FADE * self._weight + 1.0
        typical = np.diag(self._gram) / self._weight
        # The prior, each term worth PRIOR_ROUNDS rounds of typical size: a toward the
        # one factor, b toward a (the measured curve's shape), c toward 0.
        p_a = self.PRIOR_ROUNDS * typical[0]
        p_b = self.PRIOR_ROUNDS * max(typical[1], self.MIN_EXTRA_SHARE * typical[0])
        # Where nodes and accepted tokens rose together in every round (trees accepted
        # whole), the data cannot split their costs. Charged to the nodes, such costs
        # shrink the trees, which keep being accepted whole: the split never comes.
        # Charged to the tokens, they leave the trees as measured, some are accepted in
        # part, and those rounds split it. So c's prior is the weaker one by far.
        p_c = self.PRIOR_ROUNDS * self.TOKEN_PRIOR_SHARE * max(typical[2], 1.0)
        prior = np.array([[p_a + p_b, -p_b, 0.0], [-p_b, p_b, 0.0], [0.0, 0.0, p_c]])
        a, b, c = np.linalg.solve(self._gram + prior, self._moment + np.array([p_a * self.level, 0.0, 0.0]))
        self.a = float(min(max(a, CLIP[0]), CLIP[1]))
        self.b = float(min(max(b, CLIP[0]), CLIP[1]))
        self.c = float(max(c, 0.0))

    def telemetry(self) -> dict:
        return {"cost_scale_base": self.a, "cost_scale_extra": self.b, "cost_per_accepted_token_s": self.c}


class NodesOnlyCostFit(ThreeTermCostFit):
    """The fit without its per-accepted-token term: each accepted token's draw is
    charged to the nodes verified with it."""

    def observe(self, base: float, extra: float, realised: float, accepted: int = 0) -> None:
        super().observe(base, extra, realised, 0)

