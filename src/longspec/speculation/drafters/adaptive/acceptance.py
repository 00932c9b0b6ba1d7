"""How often `auto`'s proposed nodes are accepted: rates learned online per cell
(drafter, level, rank, agreement, first token or continuing), and the two halves of
evidence that keep the predictions of the chosen nodes honest."""

from __future__ import annotations

import math

import numpy as np

from longspec.speculation.drafters.adaptive.merge import Source


class AcceptanceTable:
    """P(node accepted | parent accepted) per (drafter, level, rank, whether another
    drafter proposed the same node — agreement is strong evidence, whether the node
    continues a speculative parent). A node's level is
    its depth or, for a node copied from earlier text (prompt lookup), the length of
    the copied run it extends (`CopiedTree.copied_runs`): a copy that has matched for 30
    tokens keeps matching far more often than one that matched for 3, whatever the
    depth (replayed on held-out continuations it beat depth alone:
    docs/lab-notes/auto-controller.md#copied-runs-auto-knows-how-long-a-prompt-lookup-copy-has-matched-issue-adaptive-speculation).
    Each level's cell is shrunk toward the previous level's rate (one token
    shallower, or a run one token shorter), and level 1 toward the drafter's rate
    pooled over levels (smoothed by `FLAT_PRIOR` or a copy prior): along a chain that keeps matching,
    acceptance stays high, so a level that was rarely reached starts from the highest
    measured level before it — not from 1/2, and not from the pooled rate, which level
    1 (the hardest token, right after a bonus) dominates. That is what lets the deep
    nodes of a good drafter be proposed, and so measured. Levels and ranks beyond the
    table share its last cell.

    The first token after the bonus (depth 1) and a token continuing a speculative
    parent are counted apart, even at the same level: the first token is a fresh
    guess (the bonus was the target's own choice, and a copy may restart there), the
    others extend a copy the target has just followed. Pooled, the first tokens of
    short copies were over-predicted, an error every deeper node of their chain
    inherited; apart, the predictions came right at equal speed
    (docs/lab-notes/prompt-lookup.md#copies-that-continue-into-their-own-draft-the-cost-model-measured-under-load-issue-adaptive-speculation).

    Trees are chosen with optimistic rates — the posterior mean plus `OPTIMISM`
    posterior standard deviations — so that a cell that a few unlucky rounds pushed
    down (three rejections at depth 6 of a chain that is otherwise accepted 9 times in
    10) is still proposed now and then and can recover; with the plain mean such a
    depth is never verified again and the controller settles on trees shorter than a
    fixed chain. The bonus fades as the cell is measured; predictions (telemetry,
    calibration) use the mean.

    Two timescales: a cell's rate is its recent rate (counts that fade by `RETAINED`
    at the end of every round, so the last ~1 / (1 - RETAINED) rounds weigh most)
    shrunk toward its rate over the whole sequence. Acceptance moves with the text (a
    passage being copied, then new prose), and trees are verified mostly in the
    stretches where drafts are accepted: with every round weighed alike the table lagged
    behind those stretches and predicted too few accepted tokens, most under sampling
    (docs/lab-notes/auto-controller.md#calibration-autos-acceptance-table-on-two-timescales-issue-adaptive-speculation).
    A cell measured many times over the whole
    sequence still knows its rate when its recent counts are thin. The recent rate is
    shrunk with half an observation's weight only: sampled text copies in bursts, and
    with a whole observation the first tokens of a burst were still under-predicted
    (docs/lab-notes/auto-controller.md#auto-against-every-fixed-method-each-method-timed-three-times-issue-adaptive-speculation,
    docs/lab-notes/auto-controller.md#auto-with-the-recent-acceptance-rate-trusted-more-the-wall-clock-run-issue-adaptive-speculation).

    Counts live in NumPy and the shrunk rates are recomputed for every cell at once
    when a count changed, so a round's lookups cost microseconds, not a tensor
    operation per node and depth."""

    PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior rate in every cell
    OPTIMISM = 0.5  # posterior standard deviations added when choosing trees
    RETAINED = 0.85  # share of its recent counts a cell keeps at the end of each round
    RECENT_PRIOR_WEIGHT = 0.5  # pseudo-observations of the whole-sequence rate in the recent one
    SEPARATE_FIRST_TOKEN = True  # depth-1 nodes and nodes continuing a speculative parent in cells apart
    # Pseudo-counts (accepted, rejected) of the rate pooled over levels that level 1 is
    # shrunk toward: a coin flip, except for the nodes of a copying drafter (`Tree.
    # copied_runs`) that continue a speculative parent: a started copy goes on — most of
    # them were accepted on the replayed full preset, Spec-Bench and AIME outputs; the low
    # end of those rates, worth ten observations. With the flat prior there, a fresh
    # request's first copies were verified a few tokens at a time while prompt lookup's
    # 10-token chains were accepted whole
    # (docs/lab-notes/auto-controller.md#a-fresh-requests-prior-auto-expects-a-started-copy-to-go-on-issue-adaptive-speculation).
    FLAT_PRIOR = (1.0, 1.0)
    COPY_CONTINUES_PRIOR = (8.0, 2.0)
    # The copy prior of a request that samples (`expect_sampling`): a drafted token is
    # accepted only where the draw lands on it, so a started copy goes on less often than
    # under greedy decoding. Swept with the first-token prior on replayed sampled outputs
    # (full preset, Spec-Bench, AIME; held-out prose): an even prior here was the best or
    # level on each, a first-token prior below the flat one changed nothing measurable
    # (docs/lab-notes/certified-head.md#sampled-requests-expect-shorter-copies).
    SAMPLED_COPY_CONTINUES_PRIOR = (4.0, 4.0)

    def __init__(self, drafters: int, max_level: int = 32, max_rank: int = 4) -> None:
        # [drafter, level, rank, agreed, continues a speculative parent]
        self.accepted = np.zeros((drafters, max_level, max_rank, 2, 2), dtype=np.float64)
        self.proposed = np.zeros_like(self.accepted)
        self.recent_accepted = np.zeros_like(self.accepted)  # the same counts, fading each round
        self.recent_proposed = np.zeros_like(self.accepted)
        self.copying = np.zeros(drafters, dtype=bool)  # drafters seen proposing copies (`note_copying`)
        self._rates: tuple[np.ndarray, np.ndarray] | None = None  # (mean, optimistic); None once a count changed
        self._prior: tuple[np.ndarray, np.ndarray] | None = None  # the pooled rates' (accepted, all) pseudo-counts
        self._levels_measured = 0  # levels up to the deepest with a count
        self.sampled = False  # the request samples: the sampled copy prior (`expect_sampling`)

    def cell(self, source: Source, agreed: bool) -> tuple[int, int, int, int, int]:
        """Index of a proposed node's cell in the count and rate arrays."""
        D, R = self.accepted.shape[1:3]
        return (source.drafter, min(source.run or source.depth, D) - 1, min(source.rank, R - 1), int(agreed),
                int(self.SEPARATE_FIRST_TOKEN and source.depth > 1))

    def rates(self, optimistic: bool = False) -> np.ndarray:
        """[drafters, level, rank, agreed, continues] shrunk acceptance rates (posterior means),
        or the optimistic rates trees are chosen with."""
        if self._rates is None:
            m, w = self.PRIOR_WEIGHT, self.RECENT_PRIOR_WEIGHT
            if self._prior is None:
                prior = self._priors()
                self._prior = (prior[..., 0], prior.sum(axis=-1))
            rate = (self.accepted.sum(axis=1) + self._prior[0]) / (self.proposed.sum(axis=1) + self._prior[1])
            # Levels above the deepest one measured keep the rate below them (no counts:
            # offset 0, slope 1), so the levels end there.
            top = self._levels_measured
            # Each level's whole-sequence rate is shrunk toward the previous level's rate,
            # its recent rate toward that: composed, rate_d = offset_d + slope_d * rate_(d-1).
            levels = slice(0, top)
            whole_weight = 1.0 / (self.proposed[:, levels] + m)
            recent_weight = 1.0 / (self.recent_proposed[:, levels] + w)
            offset = (self.recent_accepted[:, levels] + w * self.accepted[:, levels] * whole_weight) * recent_weight
            slope = (w * m) * whole_weight * recent_weight
            _compose_down_levels(offset, slope)
            mean = np.empty_like(self.accepted)
            mean[:, levels] = offset + slope * rate[:, None]
            if top:
                rate = mean[:, top - 1]
            mean[:, top:] = rate[:, None]
            np.minimum(np.maximum(mean, 0.0, out=mean), 1.0, out=mean)  # a rate of 1 can round just above it
            # The cell's Beta posterior has proposed + m observations (prior included).
            deviation = np.sqrt(mean * (1.0 - mean) / (self.proposed + m + 1.0))
            self._rates = (mean, np.minimum(mean + self.OPTIMISM * deviation, 1.0))
        return self._rates[int(optimistic)]

    def _priors(self) -> np.ndarray:
        """[drafters, 1, 1, continues, (accepted, rejected)] pseudo-counts of the pooled rates."""
        continues = self.SAMPLED_COPY_CONTINUES_PRIOR if self.sampled else self.COPY_CONTINUES_PRIOR
        prior = np.empty((len(self.copying), 1, 1, 2, 2))
        prior[..., 0, :] = self.FLAT_PRIOR
        prior[..., 1, :] = np.where(self.copying[:, None], continues, self.FLAT_PRIOR)[:, None, None]
        return prior

    def expect_sampling(self, sampled: bool) -> None:
        """Whether the request samples: the copy prior its evidence starts from."""
        if self.sampled != sampled:
            self.sampled = sampled
            self._rates = self._prior = None

    def note_copying(self, drafter: int) -> None:
        """The drafter proposes copies of earlier text: its continuing nodes take the copy prior."""
        if not self.copying[drafter]:
            self.copying[drafter] = True
            self._rates = self._prior = None

    def rate(self, source: Source, agreed: bool = False) -> float:
        return float(self.rates()[self.cell(source, agreed)])

    def record(self, source: Source, accepted: bool, agreed: bool = False) -> None:
        self.record_cell(self.cell(source, agreed), accepted)

    def record_cell(self, cell: tuple[int, int, int, int, int], accepted: bool) -> None:
        self.proposed[cell] += 1.0
        self.accepted[cell] += float(accepted)
        self.recent_proposed[cell] += 1.0
        self.recent_accepted[cell] += float(accepted)
        self._levels_measured = max(self._levels_measured, cell[1] + 1)
        self._rates = None

    def end_round(self) -> None:
        """Fade the recent counts by `RETAINED`."""
        self.recent_accepted *= self.RETAINED
        self.recent_proposed *= self.RETAINED
        self._rates = None


def _compose_down_levels(offset: np.ndarray, slope: np.ndarray) -> None:
    """In place: level d's map r -> offset_d + slope_d * r (axis 1) becomes the
    composition of the maps of levels 0..d, so that rate_d = offset_d + slope_d * rate
    for the rate below level 0. Composing by doubling (an inclusive scan) takes
    log2(levels) steps of NumPy calls over every cell, where walking the levels took one
    step per level (32 here); with the cached priors, the rates cost less
    (docs/lab-notes/auto-controller.md#what-changed). Only products and sums, no division: a product of
    slopes that underflows is as good as zero."""
    levels = offset.shape[1]
    shift = 1
    while shift < levels:
        # Level d takes over the maps below d - shift (the right-hand sides are the old values).
        offset[:, shift:] += slope[:, shift:] * offset[:, :-shift]
        slope[:, shift:] *= slope[:, :-shift]  # NumPy buffers overlapping operands
        shift *= 2


class CrossFittedAcceptance:
    """Two halves of evidence, each fed every other verdict of a cell: each round one
    half decides (its optimistic rates rank the nodes and size the tree) and the other
    predicts (its means: the telemetry's predicted acceptance), the roles swapping
    every round.

    With one table, the nodes chosen are those whose estimate is high, partly by
    chance, so the same estimate over-predicted them: on an AVX2 CPU, where a verified
    node costs a large share of a forward and only the best-looking ones are verified,
    the predicted accepted tokens per round ran above the realised
    (docs/lab-notes/auto-controller.md#autos-calibration-depends-on-the-machines-cost-shape-issue-adaptive-speculation--measured-constants-left-as-they-are).
    A half's noise is independent of the other's, so the predicting half is not
    flattered by the choice. Each half holds half the evidence, so its prior weights
    are halved (the balance of prior and evidence the constants were tuned at) and its
    optimism divided by sqrt(2): a half's posterior deviation is sqrt(2) times the
    whole's, and the full bonus made the deciding half explore more (fewer tokens per
    second in replays). Replayed on an AVX2 CPU's full preset and Spec-Bench/AIME
    outputs, the halves' predictions came closer to the realised acceptance than one
    table's (docs/lab-notes/auto-controller.md#cross-fitted-acceptance-predictions-no-longer-flattered-by-the-choice)."""

    def __init__(self, drafters: int, max_level: int = 32, max_rank: int = 4) -> None:
        # One table whose drafter rows come twice: row h * drafters + d is drafter d's half h,
        # so one pass over the levels computes both halves' rates.
        self.drafters = drafters
        self.table = AcceptanceTable(2 * drafters, max_level, max_rank)
        self.table.PRIOR_WEIGHT = AcceptanceTable.PRIOR_WEIGHT / 2
        self.table.RECENT_PRIOR_WEIGHT = AcceptanceTable.RECENT_PRIOR_WEIGHT / 2
        self.table.OPTIMISM = AcceptanceTable.OPTIMISM / math.sqrt(2)
        self._next_half = np.zeros((drafters, *self.table.accepted.shape[1:]), dtype=np.int8)  # per cell: the half its next verdict feeds
        self._deciding = 0

    def cell(self, source: Source, agreed: bool) -> tuple[int, int, int, int, int]:
        return self.table.cell(source, agreed)

    def half(self, index: int) -> slice:
        """The drafter rows of half `index` in the table's arrays."""
        return slice(index * self.drafters, (index + 1) * self.drafters)

    def deciding_rates(self) -> np.ndarray:
        """The optimistic rates trees are chosen with this round."""
        return self.table.rates(optimistic=True)[self.half(self._deciding)]

    def predicting_rates(self) -> np.ndarray:
        """The mean rates this round's chosen nodes are predicted with."""
        return self.table.rates()[self.half(1 - self._deciding)]

    def rate(self, source: Source, agreed: bool = False) -> float:
        return float(self.predicting_rates()[self.cell(source, agreed)])

    @property
    def proposed(self) -> np.ndarray:
        """Verdicts recorded per cell, both halves."""
        return self.table.proposed[self.half(0)] + self.table.proposed[self.half(1)]

    def expect_sampling(self, sampled: bool) -> None:
        self.table.expect_sampling(sampled)

    def note_copying(self, drafter: int) -> None:
        self.table.note_copying(drafter)
        self.table.note_copying(drafter + self.drafters)

    def record(self, source: Source, accepted: bool, agreed: bool = False) -> None:
        cell = self.cell(source, agreed)
        half = int(self._next_half[cell])
        self._next_half[cell] = 1 - half
        self.table.record_cell((cell[0] + half * self.drafters, *cell[1:]), accepted)

    def end_round(self) -> None:
        self.table.end_round()
        self._deciding = 1 - self._deciding
