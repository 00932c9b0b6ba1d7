"""Exact sampling through the certified head (runtime/certified_head.py): one draw from
the target's processed distribution — temperature, then top-k, top-p and min-p, with the
rules of `processors.py` computed exactly — reading the int8 screen and recomputing only
the rows that can matter.

The screen gives the candidates: every output row whose plain logit could lie within a
margin of the largest (`margin`: `MARGIN` temperatures, plus what min-p cuts), with
their exact logits, and a bound `cut` that every other row's logit lies below. Then:

* truncation (top-k, top-p, min-p) is decided from the exact logits of the candidates
  when the bound shows that no other row can be kept (the k-th largest above `cut`; a
  nucleus whose last token is above `cut` and whose rank is the same for the least and
  the largest total mass the other rows could add; a min-p threshold above `cut`); a
  cut the bound cannot decide returns None, and the caller draws from the full head;
* without truncation every token keeps its mass, the other rows' too: a draw is
  rejection sampling. The proposal gives each candidate its exact weight exp(l_i / T)
  and every other row the envelope exp(cut / T) >= its own weight; a candidate is
  accepted at once, another row i (chosen uniformly among them, its logit recomputed)
  with probability exp((l_i - cut) / T). An accepted token is distributed exactly as
  exp(l_i / T); the other rows hold at most V e^-MARGIN of the mass, so almost every
  draw takes one uniform.

Every uniform comes from the request's generator, so a seed gives one output, and
plain decoding and every drafter with deterministic candidates make the same draws.
"""

from __future__ import annotations

import math

import torch

from longspec.runtime.certified_head import Candidates, CertifiedHead
from longspec.speculation.processors import SamplingParams

MARGIN = 20.0  # temperatures below the largest logit: the rest hold <= V e^-20 of the top token's mass
_SAFETY = 1e-12  # relative slack on the float64 decisions of what the bound excludes: undecided is safe


def certified_sampling_applies(params: SamplingParams) -> bool:
    """Whether draws under `params` can go through the certified head: sampling without
    the windowed penalty (it changes the logits of the history's tokens) and without eta
    (its cut needs the whole distribution's entropy)."""
    return not params.is_greedy and not params.uses_history and params.eta is None


def margin(params: SamplingParams) -> float:
    """How far below the largest logit the candidates must reach: MARGIN temperatures,
    and beyond min-p's threshold (l_max + T ln min_p) by as much."""
    extra = -math.log(params.min_p) if params.min_p else 0.0
    return params.temperature * (MARGIN + extra)


def _uniform(generator: torch.Generator | None, device) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def certified_draw(head: CertifiedHead, hidden: torch.Tensor, candidates: Candidates, params: SamplingParams,
                   generator: torch.Generator | None) -> int | None:
    """One token drawn from the processed distribution of the head's logits at `hidden`
    [H] (bf16), or None where the candidates cannot decide a truncation (the caller then
    draws from the full head)."""
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
    if params.top_p is not None and params.top_p < 1.0:
        ranked_logits = torch.sort(logits[kept], descending=True).values
        ranked = ranked_logits / T
        values = torch.exp(ranked - top)
        known = float(values.sum())
        unknown = (vocab - rows.numel()) * math.exp(cut / T - top) if others_kept else 0.0
        mass_above = torch.cumsum(values, 0) - values
        # TopPLogitsWarper's rule: a token goes when the tokens ranked above it hold top_p
        # of the mass; the total is known up to what the rows outside could add.
        last = [int((mass_above < params.top_p * total).sum()) - 1 for total in (known, known + unknown)]
        if last[0] != last[1]:  # the nucleus's end depends on mass the bound leaves open
            return None
        cut_score = float(ranked[max(last[0], 0)])
        if others_kept and not float(ranked_logits[max(last[0], 0)]) > cut + _SAFETY * abs(cut):
            return None  # a row outside could tie into the nucleus
        kept &= scores >= cut_score  # ties with the last kept survive
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
    outside = vocab - rows.numel() if others_kept else 0
    envelope = math.exp(cut / T - top) if outside else 0.0
    cumulative = torch.cumsum(weights, 0)
    device = generator.device if generator is not None else torch.device("cpu")
    while True:
        u = _uniform(generator, device) * (known + outside * envelope)
        if u < known:
            return int(rows[int(torch.searchsorted(cumulative, torch.tensor([u], dtype=torch.float64),
                                                   right=True))])
        # A row outside the candidates, uniformly, accepted with its weight over the envelope.
        j = min(int(_uniform(generator, device) * outside), outside - 1)
        token = _nth_outside(rows, j)
        exact = float(head.exact_logits(hidden.unsqueeze(0), torch.tensor([token]))[0, 0])
        if _uniform(generator, device) < math.exp((exact - cut) / T):
            return token


def _nth_outside(rows: torch.Tensor, j: int) -> int:
    """The j-th (from 0) output row not among the ascending `rows`."""
    # Before the i-th candidate lie rows[i] - i outside rows; the answer is j plus the
    # candidates at or below it.
    below = int(torch.searchsorted(rows - torch.arange(rows.numel()), torch.tensor([j]), right=True))
    return j + below
