"""How many of the ranked candidate nodes a round verifies: the policies behind
one small interface.

A controller ranks candidate nodes by their estimated probability of being
accepted (path products, so every prefix of the ranking is a tree) and asks the
policy for k, the number of nodes to verify. After the round it reports what k
bought: accepted tokens (the bonus included) and the round's seconds.

* `ThroughputPolicy`: k maximising expected tokens per second,
  (1 + Σ_{i<k} p_i) / (draft seconds + verification seconds of k + 1 tokens),
  from the measured cost model; k = 0 (plain decoding) is always a candidate.
* `UCBPolicy`: UCB1 over a fixed set of node budgets (arms), rewarded with minus
  the cost per committed token, as in the Mamba-drafter paper's test-time tree
  search (`mamba_reward` is that paper's reward, for drafters that count draft steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Protocol


class TreePolicy(Protocol):
    def choose(self, expected: Sequence[float], seconds: Callable[[int], float]) -> int:
        """k in 0..len(expected): expected[i] is the i-th ranked node's acceptance
        probability (non-increasing in i); seconds(k) the predicted round time
        verifying k nodes (non-decreasing in k)."""

    def update(self, k: int, committed: int, seconds: float, ar_seconds: float) -> None:
        """What the round bought: `committed` tokens (bonus included) in `seconds`;
        `ar_seconds` is one plain decoding round, the unit of cost."""


class ThroughputPolicy:
    """A larger tree is chosen only where its predicted rate beats the best smaller
    one's by `min_gain` (a share): best-of-five timings of one forward differ by about
    that much between runs, so a tree predicted to gain less than that is as likely a
    loss; on a GPU, whose eager forwards are flat in k to within that noise, garbage
    nodes with an acceptance estimate of 1e-5 were verified every round, well below
    plain decoding's speed
    (docs/lab-notes/gpu.md#on-an-h100-what-a-short-decode-step-asks-of-the-controller)."""

    def __init__(self, min_gain: float = 0.01) -> None:
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain is a share in [0, 1), got {min_gain}")
        self.min_gain = min_gain

    def choose(self, expected: Sequence[float], seconds: Callable[[int], float]) -> int:
        gains = list(accumulate(map(float, expected), initial=1.0))
        best, best_rate = 0, gains[0] / seconds(0)
        for k in range(1, len(gains)):
            time = seconds(k)
            # No larger tree gains more than all the nodes, nor costs less than this
            # one: once that cannot win, stop (a garbage drafter's nodes: at k = 1).
            if gains[-1] / time <= best_rate * (1.0 + self.min_gain):
                break
            rate = gains[k] / time
            if rate > best_rate * (1.0 + self.min_gain):
                best, best_rate = k, rate
        return best

    def update(self, k: int, committed: int, seconds: float, ar_seconds: float) -> None:
        pass  # stateless: the controller's acceptance statistics and cost model carry what it learns


def mamba_reward(accepted: int, gamma: int, draft_cost_ratio: float) -> float:
    """The Mamba-drafter paper's bandit reward, -(1/N + λγ/N): N accepted tokens
    counting the bonus, γ draft steps, λ = draft step cost / target forward cost."""
    if accepted < 1:
        raise ValueError(f"a round commits at least the bonus token, got N = {accepted}")
    return -(1.0 + draft_cost_ratio * gamma) / accepted


class UCBPolicy:
    """UCB1 over node budgets. Reward: -(round seconds / plain-decoding seconds) /
    tokens committed — the paper's reward with the measured verification cost in
    place of 1 (rewards lie in [-cost, 0); larger is better)."""

    def __init__(self, arms: Sequence[int] = (0, 2, 4, 8, 16, 32, 64), exploration: float = 1.0) -> None:
        if not arms or any(a < 0 for a in arms):
            raise ValueError(f"UCB arms are node budgets >= 0, got {tuple(arms)}")
        if exploration < 0:
            raise ValueError(f"exploration must be >= 0, got {exploration}")
        self.arms = tuple(sorted(set(int(a) for a in arms)))
        self.exploration = exploration
        self.counts = [0] * len(self.arms)
        self.totals = [0.0] * len(self.arms)
        self._last = 0

    def choose(self, expected: Sequence[float], seconds: Callable[[int], float]) -> int:
        self._last = self.best_arm()
        return min(self.arms[self._last], len(expected))

    def best_arm(self) -> int:
        for arm, count in enumerate(self.counts):
            if not count:
                return arm
        rounds = sum(self.counts)
        scores = [self.totals[a] / self.counts[a] + self.exploration * math.sqrt(2 * math.log(rounds) / self.counts[a])
                  for a in range(len(self.arms))]
        return max(range(len(scores)), key=scores.__getitem__)

    def update(self, k: int, committed: int, seconds: float, ar_seconds: float) -> None:
        self.record(self._last, -(seconds / ar_seconds) / max(committed, 1))

    def record(self, arm: int, reward: float) -> None:
        self.counts[arm] += 1
        self.totals[arm] += reward
