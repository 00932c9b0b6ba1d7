"""Exact sampling through the certified head (runtime/certified_head.py): one draw from
the target's processed distribution — temperature, then top-k, top-p and min-p, with the
rules of `processors.py` computed exactly — reading the int8 screen and recomputing only
the rows that can matter.

The screen gives the candidates: every output row whose plain logit could lie within a
margin of the largest (`margin`: a few temperatures, plus what min-p cuts), with their
exact logits, and a bound `cut` that every other row's logit lies below; the other rows
are counted in bins by how far below `cut` their upper bounds lie. Then:

* truncation (top-k, top-p, min-p) is decided from the exact logits of the candidates
  when the bound shows that no other row can be kept (the k-th largest above `cut`; a
  nucleus whose last token is above `cut` and whose rank is the same for the least and
  the largest total mass the other rows could add; a min-p threshold above `cut`); a
  cut the bound cannot decide returns None, and the caller draws from the full head;
* without truncation every token keeps its mass, the other rows' too: a draw is
  rejection sampling. The proposal gives each candidate its exact weight exp(l_i / T)
  and every other row the envelope of its bin, exp(top of the bin / T) >= its own
  weight; a candidate is accepted at once, another row i (its bin by the bins' envelope
  mass, then uniformly within the bin, its logit recomputed) with probability
  exp((l_i - top of its bin) / T). An accepted token is distributed exactly as
  exp(l_i / T), and a tail row is accepted with probability at least e^-(step + 2 band).
  Under min-p the cut lies below min-p's threshold, so no tail row can be kept: the
  draw leaves the tail out, and its bins are counted only for a top-p decision that
  needs their mass.

Every uniform comes from the request's generator, so a seed gives one output, and
plain decoding and every drafter with deterministic candidates make the same draws.
"""

from __future__ import annotations

import functools
import math

import torch

from longspec.runtime.certified_head import Candidates, Screen
from longspec.speculation.processors import SamplingParams, min_p_kept, top_p_cut

# Candidates reach this many temperatures below the largest logit; the rows further down
# are drawn through the tail's bins. A truncation the first selection cannot decide (a
# nucleus that reaches further) gets one wider selection before the full head.
MARGINS = (6.0, 16.0)
# Where a margin's candidates overflow the cap (a flat distribution: thousands of rows within a
# few temperatures), one temperature beyond min-p's threshold is tried before the full head; the
# draw is as exact with any margin, only its tail holds more of the mass.
NARROW_MARGIN = 1.0
# Under min-p without top-k no row below min-p's threshold can be kept, and the mass below it
# matters only to a top-p decision the candidates' own mass leaves open: the first selection
# reaches one temperature past the threshold (fewer candidates to recompute,
# docs/lab-notes/certified-head.md#sampled-draws-under-min-p-the-tail-left-out).
MIN_P_MARGINS = (NARROW_MARGIN, MARGINS[1])
TAIL_STEP = 0.5  # temperatures per bin of the tail: a tail row is accepted with probability >= e^-(step + 2 band)
TAIL_BINS = 64
_SAFETY = 1e-12  # relative slack on the float64 decisions of what the bound excludes: undecided is safe


def certified_sampling_applies(params: SamplingParams) -> bool:
    """Whether draws under `params` can go through the certified head: sampling without
    a bias or penalties (they change the logits of chosen tokens) and without a warper
    whose cut needs the whole distribution (eta, typical sampling: the entropy)."""
    return not params.is_greedy and not params.adjusts_logits and not params.reads_whole_distribution


def margin(params: SamplingParams, temperatures: float = MARGINS[0]) -> float:
    """How far below the largest logit the candidates reach: `temperatures` of them, and
    beyond min-p's threshold (l_max + T ln min_p) by as much."""
    extra = -math.log(params.min_p) if params.min_p else 0.0
    return params.temperature * (temperatures + extra)


def margins_for(params: SamplingParams, vocab: int) -> tuple[float, ...]:
    """The selections a draw under `params` tries, narrowest first (in temperatures, see `margin`)."""
    top_k = params.top_k and params.top_k < vocab
    return MIN_P_MARGINS if params.min_p and not top_k else MARGINS


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else torch.device("cpu")
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def certified_draw(screen: Screen, row: int, hidden: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None, full_logits=None,
                   margins: tuple[float, ...] | None = None) -> int | None:
    """One token drawn from the processed distribution of the head's logits at `hidden`
    [H] (bf16; row `row` of `screen`), or None where the screen cannot serve it (a row
    without a certificate, a top-k the candidates cannot hold): the caller then draws
    from the full head. Nothing is drawn from `generator` before that is known.
    `full_logits()` gives the row's full logits [V] for the rare top-p decision the
    bounds leave open (None: such a draw returns None too, before drawing). `margins`:
    the selections to try (default `margins_for`)."""
    margins = margins_for(params, screen.head.vocab) if margins is None else margins
    narrow = torch.tensor([margin(params, NARROW_MARGIN)], dtype=torch.float64)
    for temperatures in margins:
        (candidates,) = screen.select(torch.tensor([margin(params, temperatures)], dtype=torch.float64), rows=[row],
                                      narrower=narrow if temperatures > NARROW_MARGIN else None)
        if candidates is None:
            return None
        draw = _Draw(screen, row, hidden, candidates, params, generator, full_logits)
        if params.top_k and params.top_k < screen.head.vocab:
            token = draw.within_top_k()
            if token is None:
                continue  # a wider selection may hold the top k
            return token
        return draw.with_membership()
    return None


class _Draw:
    """One draw at one row: the candidates' exact logits, the tail's bins, the rules."""

    def __init__(self, screen, row, hidden, candidates: Candidates, params: SamplingParams, generator, full_logits):
        self.screen, self.row, self.hidden, self.params, self.generator = screen, row, hidden, params, generator
        self.full_logits = full_logits
        self.rows, self.cut, self.margin, self.T = candidates.rows, candidates.cut, candidates.margin, params.temperature
        self.head = screen.head
        logits = self.head.exact_logits(hidden.unsqueeze(0), self.rows)[0]
        self.logits = logits.double()
        self.scores = self._scores(logits)  # float32 logit / T, as the full-head sampler holds them
        self.top = float(self.scores.max())  # the largest logit is a candidate
        self.weights = torch.exp(self.scores - self.top)  # the candidates' untruncated mass, relative to the top
        self.known = float(self.weights.sum())
        self._tail: tuple[torch.Tensor, torch.Tensor] | None = None
        self.counts_tails = True  # HeadStats.tails counts draws, not their wider selections

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits / T, computed as the full-head sampler computes them (then held in
        float64): min-p's rule (`processors.min_p_kept`) then sees the same numbers in both."""
        logits = logits.float()
        return (logits if self.T == 1.0 else logits / self.T).double()

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows outside the candidates counted in bins by upper bound (`Screen.tail_counts`),
        and each bin's envelope mass relative to the largest weight (counted once, when first asked)."""
        if self._tail is None:
            self.head.stats.tails += self.counts_tails
            step = TAIL_STEP * self.T
            bins = self.screen.tail_counts(self.row, self.cut, step, TAIL_BINS).double()
            envelopes = torch.exp((self.cut - step * torch.arange(TAIL_BINS, dtype=torch.float64)) / self.T - self.top)
            self._tail = bins, bins * envelopes
        return self._tail

    def _pick(self, weights: torch.Tensor, u: float) -> int:
        """The row whose cumulative weight first exceeds `u` (inverse CDF)."""
        cumulative = torch.cumsum(weights, 0)
        index = int(torch.searchsorted(cumulative, torch.tensor([u], dtype=torch.float64), right=True))
        if index >= weights.numel():  # u at or past the last sum (rounding): the last row with weight, as the plain draw
            index = int(torch.nonzero(weights > 0).max())
        return int(self.rows[index])

    def within_top_k(self) -> int | None:
        """Top-k decided among the candidates (None when a row outside could be in it),
        then top-p and min-p exactly over the k kept, and one inverse-CDF draw."""
        k = self.params.top_k
        if self.rows.numel() < k:
            return None
        kth = torch.topk(self.logits, k).values[-1]
        if not float(kth) > self.cut + _SAFETY * abs(self.cut):
            return None
        kept = self.logits >= kth  # ties with the k-th survive, as in TopKLogitsWarper
        weights = torch.exp(self.scores - self.top) * kept
        if self.params.top_p is not None and self.params.top_p < 1.0:
            ranked = torch.sort(self.scores[kept], descending=True).values.unsqueeze(0)
            total = torch.exp(ranked - self.top).sum(dim=-1, keepdim=True)
            kept &= self.scores >= top_p_cut(ranked, total, self.params.top_p)[0]  # ties with the last kept survive
        if self.params.min_p:  # 0 keeps every token, as None does
            kept &= min_p_kept(self.scores, self.top, self.params.min_p)
        weights = torch.exp(self.scores - self.top) * kept
        return self._pick(weights, _uniform(self.generator) * float(weights.sum()))

    def with_membership(self) -> int | None:
        """Without top-k: a token drawn from the untruncated distribution (the candidates'
        exact weights, the tail through its bins), kept when top-p and min-p keep it and
        drawn again otherwise (the accepted token then follows the truncated
        distribution exactly).

        Where min-p's threshold lies above the cut, min-p removes every row outside the
        candidates: a draw landing in the tail would always be drawn again, so the tail
        is left out of the draw (the kept tokens keep their distribution) and its bins
        are counted only if a top-p decision needs their mass."""
        T, cut, weights, known = self.T, self.cut, self.weights, self.known
        top_p = self.params.top_p if self.params.top_p is not None and self.params.top_p < 1.0 else None
        min_p = self.params.min_p or None  # 0 keeps every token, as None does
        # Min-p's rule at the cut rounded up to a float32: no tail row (logit <= cut) scores
        # above it, so where it fails, every tail row fails min-p too.
        cut_up = torch.tensor([cut], dtype=torch.float64).float()
        cut_up = torch.nextafter(cut_up, torch.tensor(math.inf)) if float(cut_up) < cut else cut_up
        tail_removed = min_p is not None and not bool(min_p_kept(self._scores(cut_up), self.top, min_p))
        open_decisions = top_p is not None and self.full_logits is None
        if open_decisions and float(self.tail()[1].sum()) > 0:
            return None  # a decision the bounds leave open would need the full head
        if tail_removed:
            unknown, bins, tail_cumulative = 0.0, None, None
        else:
            bins, tail = self.tail()
            unknown, tail_cumulative = float(tail.sum()), torch.cumsum(tail, 0)
        while True:
            u = _uniform(self.generator) * (known + unknown)
            if u < known:
                token = self._pick(weights, u)
                logit = float(self.logits[int(torch.searchsorted(self.rows, torch.tensor([token])))])
            else:
                step = TAIL_STEP * T
                b = min(int(torch.searchsorted(tail_cumulative, torch.tensor([u - known], dtype=torch.float64),
                                               right=True)), TAIL_BINS - 1)
                count = int(bins[b])
                if count == 0:  # rounding put u past the last non-empty bin
                    continue
                token = self.screen.tail_row(self.row, cut, step, TAIL_BINS, b,
                                             min(int(_uniform(self.generator) * count), count - 1))
                logit = float(self.head.exact_logits(self.hidden.unsqueeze(0), torch.tensor([token]))[0, 0])
                if not _uniform(self.generator) < math.exp((logit - (cut - b * step)) / T):
                    continue
            if min_p is not None and not bool(min_p_kept(self._scores(torch.tensor([logit])), self.top, min_p)):
                continue
            if top_p is not None and not self._in_nucleus(logit, top_p):
                continue
            return token

    def _in_nucleus(self, logit: float, top_p: float) -> bool:
        """TopPLogitsWarper's rule for one token: kept when the mass strictly above its
        logit is below top_p of the total. From the bounds; where they leave it open, from
        the bounds of a wider selection (the tail's top bins recomputed exactly), and only
        then from the full head. No uniform is drawn here, so every route decides alike."""
        decided = self._nucleus_by_bounds(logit, top_p)
        if decided is None:
            decided = None if self.wider is None else self.wider._nucleus_by_bounds(logit, top_p)
            self.head.stats.widened += decided is not None
        if decided is not None:
            return decided
        self.head.stats.undecided += 1
        scores = self._scores(self.full_logits())
        mass = torch.exp(scores - float(scores.max()))
        above = mass[scores > float(self._scores(torch.tensor([logit]))[0])]
        return float(above.sum()) < top_p * float(mass.sum())

    def _nucleus_by_bounds(self, logit: float, top_p: float) -> bool | None:
        """The rule from the candidates' exact mass and the tail's, which lies between 0 and
        its envelopes (all of it below the cut); None where they leave it open."""
        above = float(self.weights[self.scores > float(self._scores(torch.tensor([logit]))[0])].sum())
        if logit >= self.cut and above < top_p * self.known:
            return True  # decided without the tail's mass
        unknown = float(self.tail()[1].sum())
        tail_above = unknown if logit < self.cut else 0.0
        if above + tail_above < top_p * self.known:
            return True
        if above >= top_p * (self.known + unknown):
            return False
        return None

    @functools.cached_property
    def wider(self) -> "_Draw | None":
        """This row's draw state over a wider selection: the candidates and as many of the
        tail's top bins as the cap holds (None where not one bin fits, or the selection
        overflows). Built once per draw: every open decision of its loop reads it."""
        bins, _ = self.tail()
        fit = int((torch.cumsum(bins, 0) <= self.head.cap - self.rows.numel()).sum())
        if fit == 0:
            return None
        margin = torch.tensor([self.margin + fit * TAIL_STEP * self.T], dtype=torch.float64)
        (candidates,) = self.screen.select(margin, rows=[self.row], tally=False)
        if candidates is None:
            return None
        wider = _Draw(self.screen, self.row, self.hidden, candidates, self.params, self.generator, self.full_logits)
        wider.counts_tails = False
        return wider
