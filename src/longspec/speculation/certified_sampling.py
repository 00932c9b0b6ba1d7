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

Every uniform comes from the request's generator, so a seed gives one output, and
plain decoding and every drafter with deterministic candidates make the same draws.
"""

from __future__ import annotations

import math

import torch

from longspec.runtime.certified_head import Candidates, Screen
from longspec.speculation.processors import SamplingParams

# Candidates reach this many temperatures below the largest logit; the rows further down
# are drawn through the tail's bins. A truncation the first selection cannot decide (a
# nucleus that reaches further) gets one wider selection before the full head.
MARGINS = (6.0, 16.0)
TAIL_STEP = 0.5  # temperatures per bin of the tail: a tail row is accepted with probability >= e^-(step + 2 band)
TAIL_BINS = 64
_SAFETY = 1e-12  # relative slack on the float64 decisions of what the bound excludes: undecided is safe


def certified_sampling_applies(params: SamplingParams) -> bool:
    """Whether draws under `params` can go through the certified head: sampling without
    the windowed penalty (it changes the logits of the history's tokens) and without eta
    (its cut needs the whole distribution's entropy)."""
    return not params.is_greedy and not params.uses_history and params.eta is None


def margin(params: SamplingParams, temperatures: float = MARGINS[0]) -> float:
    """How far below the largest logit the candidates reach: `temperatures` of them, and
    beyond min-p's threshold (l_max + T ln min_p) by as much."""
    extra = -math.log(params.min_p) if params.min_p else 0.0
    return params.temperature * (temperatures + extra)


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else torch.device("cpu")
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def certified_draw(screen: Screen, row: int, hidden: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None, margins: tuple[float, ...] = MARGINS) -> int | None:
    """One token drawn from the processed distribution of the head's logits at `hidden`
    [H] (bf16; row `row` of `screen`), or None where no selection decides the truncation
    (the caller then draws from the full head). Nothing is drawn from `generator` before
    the truncation is decided."""
    for temperatures in margins:
        (candidates,) = screen.select(torch.tensor([margin(params, temperatures)], dtype=torch.float64), rows=[row])
        if candidates is None:
            return None
        token = _draw(screen, row, hidden, candidates, params, generator)
        if token is not None:
            return token
    return None


def _draw(screen: Screen, row: int, hidden: torch.Tensor, candidates: Candidates, params: SamplingParams,
          generator: torch.Generator | None) -> int | None:
    head = screen.head
    rows, cut, T = candidates.rows, candidates.cut, params.temperature
    vocab = head.vocab
    logits = head.exact_logits(hidden.unsqueeze(0), rows)[0].double()
    scores = logits / T
    kept = torch.ones_like(logits, dtype=torch.bool)
    others_kept = True  # whether the rows outside the candidates keep their mass
    if params.top_k and params.top_k < vocab:
        if rows.numel() < params.top_k:
            return None
        kth = torch.topk(logits, params.top_k).values[-1]
        if not float(kth) > cut + _SAFETY * abs(cut):  # a row outside could reach the k-th largest
            return None
        kept &= logits >= kth  # ties with the k-th survive, as in TopKLogitsWarper
        others_kept = False
    top = float(scores[kept].max())
    step = TAIL_STEP * T
    bins = screen.tail_counts(row, cut, step, TAIL_BINS).double() if others_kept else None
    envelopes = torch.exp((cut - step * torch.arange(TAIL_BINS, dtype=torch.float64)) / T - top)
    unknown = float((bins * envelopes).sum()) if others_kept else 0.0  # the most the rows outside can hold
    if params.top_p is not None and params.top_p < 1.0:
        ranked_logits = torch.sort(logits[kept], descending=True).values
        values = torch.exp(ranked_logits / T - top)
        known = float(values.sum())
        mass_above = torch.cumsum(values, 0) - values
        # TopPLogitsWarper's rule: a token goes when the tokens ranked above it hold top_p
        # of the mass; the total is known up to what the rows outside could add.
        last = [int((mass_above < params.top_p * total).sum()) - 1 for total in (known, known + unknown)]
        if last[0] != last[1]:  # the nucleus's end depends on mass the bound leaves open
            return None
        cut_logit = float(ranked_logits[max(last[0], 0)])
        if others_kept and not cut_logit > cut + _SAFETY * abs(cut):
            return None  # a row outside could tie into the nucleus
        kept &= logits >= cut_logit  # ties with the last kept survive
        others_kept = False
    if params.min_p is not None:
        threshold = top + math.log(params.min_p)  # p_i >= min_p p_max
        kept &= scores >= threshold
        if others_kept:
            if cut / T >= threshold - _SAFETY * abs(threshold):  # a row outside could pass it
                return None
            others_kept = False
    weights = torch.exp(scores - top) * kept
    known = float(weights.sum())
    tail = bins * envelopes if others_kept else torch.zeros(TAIL_BINS, dtype=torch.float64)
    unknown = float(tail.sum())
    cumulative, tail_cumulative = torch.cumsum(weights, 0), torch.cumsum(tail, 0)
    while True:
        u = _uniform(generator) * (known + unknown)
        if u < known:
            return int(rows[int(torch.searchsorted(cumulative, torch.tensor([u], dtype=torch.float64), right=True))])
        # A bin of the tail by its envelope mass, a row of it uniformly, accepted with its
        # weight over the bin's envelope.
        b = min(int(torch.searchsorted(tail_cumulative, torch.tensor([u - known], dtype=torch.float64), right=True)),
                TAIL_BINS - 1)
        count = int(bins[b])
        if count == 0:  # rounding put u past the last non-empty bin
            continue
        token = screen.tail_row(row, cut, step, TAIL_BINS, b, min(int(_uniform(generator) * count), count - 1))
        exact = float(head.exact_logits(hidden.unsqueeze(0), torch.tensor([token]))[0, 0])
        if _uniform(generator) < math.exp((exact - (cut - b * step)) / T):
            return token
