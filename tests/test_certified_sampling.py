"""Exact sampling through the certified head (speculation/certified_sampling.py): draws
follow the exact processed distribution of the plain head's logits (temperature, top-k,
top-p, min-p) by chi-square, also when the rows outside the candidates hold real mass
(a small margin, so the rejection path runs); a variant that ignores those rows fails
the same test; undecidable truncations return None (the caller draws from the full
head); and decoding through it keeps the seeded identities: plain decoding and the
drafters with deterministic candidates give the same tokens from one seed, in one
sequence and in a batch."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from longspec.runtime.certified_head import CertifiedHead
from longspec.runtime.linear import prepack
from longspec.runtime.native import bf16_linear_ops, native_ops
from longspec.speculation import certified_sampling
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.certified_sampling import certified_draw
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.methods import make_drafter
from longspec.speculation.processors import SamplingParams
from tiny_models import random_ids, tiny_decoder

pytestmark = pytest.mark.skipif(native_ops() is None or bf16_linear_ops() is None,
                                reason="the certified head needs the native bf16 product (reason logged)")

DRAWS = 6000
ALPHA = 1e-3
V, H = 600, 64


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(21)
    weight = (torch.randn(V, H, generator=g) * 0.08).bfloat16()
    hidden = (torch.randn(H, generator=g) * 6).bfloat16()
    head = CertifiedHead(weight)
    logits = bf16_linear_ops().bf16_packed_linear(hidden.unsqueeze(0), prepack(weight).tiles, V, None)[0].double()
    return head, hidden, logits


def exact_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processors' rules in float64 over the exact logits (what the sampler targets)."""
    scores = logits / params.temperature
    kept = torch.ones_like(scores, dtype=torch.bool)
    if params.top_k:
        kept &= logits >= torch.topk(logits, params.top_k).values[-1]
    if params.top_p is not None and params.top_p < 1:
        probs = torch.softmax(scores.masked_fill(~kept, -math.inf), 0)
        values = torch.sort(probs, descending=True).values
        last = int(((torch.cumsum(values, 0) - values) < params.top_p).sum()) - 1
        kept &= probs >= values[last]
    if params.min_p:
        probs = torch.softmax(scores.masked_fill(~kept, -math.inf), 0)
        kept &= probs >= params.min_p * probs.max()
    return torch.softmax(scores.masked_fill(~kept, -math.inf), 0)


def draws(head, hidden, params, seed=0, margins=None) -> torch.Tensor:
    screen = head.screen(hidden.unsqueeze(0))
    full_logits = full_logits_of(head, hidden)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(DRAWS):
        counts[certified_draw(screen, 0, hidden, params, generator, full_logits, margins)] += 1
    return counts


def full_logits_of(head, hidden):
    tiles = prepack(head.weight).tiles
    return lambda: bf16_linear_ops().bf16_packed_linear(hidden.unsqueeze(0), tiles, V, None)[0]


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    assert counts[probs == 0].sum() == 0  # removed tokens are never drawn
    expected = probs * DRAWS
    keep = expected >= 5  # cells expected under 5 draws are pooled (the chi-square approximation)
    observed, expected = counts[keep], expected[keep]
    pooled = probs[~keep].sum() * DRAWS
    if pooled > 0:
        observed = torch.cat([observed, counts[~keep].sum().reshape(1)])
        expected = torch.cat([expected, pooled.reshape(1)])
    return float(chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)


SETTINGS = {
    "temperature": SamplingParams(temperature=1.0),
    "cold": SamplingParams(temperature=0.6),
    "top-k": SamplingParams(temperature=0.9, top_k=20),
    "top-p": SamplingParams(temperature=1.0, top_p=0.9),
    "min-p": SamplingParams(temperature=1.2, min_p=0.05),
    "all": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02),
    "min-p 0": SamplingParams(temperature=1.0, top_p=0.9, min_p=0.0),  # keeps every token, as None does
    "top-k, min-p 0": SamplingParams(temperature=1.0, top_k=20, min_p=0.0),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_draws_follow_the_exact_processed_distribution(setup, name):
    head, hidden, logits = setup
    params = SETTINGS[name]
    assert p_value(draws(head, hidden, params), exact_probs(logits, params)) > ALPHA


def test_rows_outside_the_candidates_keep_their_mass(setup):
    """A margin of one temperature leaves real mass outside the candidates: the
    rejection path draws it exactly; ignoring it (the broken variant) fails."""
    head, hidden, logits = setup
    params = SamplingParams(temperature=1.0)
    (candidates,) = head.select(hidden.unsqueeze(0), torch.tensor([1.0], dtype=torch.float64))
    outside = torch.ones(V, dtype=torch.bool)
    outside[candidates.rows] = False
    probs = exact_probs(logits, params)
    assert probs[outside].sum() > 0.2  # the test is about that mass
    assert p_value(draws(head, hidden, params, margins=(1.0,)), probs) > ALPHA

    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.float64)
    # The broken variant: the candidates' weights alone (what a sampler that trusts the
    # candidate set would do).
    exact = head.exact_logits(hidden.unsqueeze(0), candidates.rows)[0].double()
    weights = torch.softmax(exact, 0)
    for token in candidates.rows[torch.multinomial(weights, DRAWS, replacement=True, generator=generator)]:
        counts[token] += 1
    assert p_value(counts, probs) < ALPHA


@pytest.mark.parametrize("name", ["temperature", "top-p", "min-p"])
def test_a_flat_row_over_the_cap_is_drawn_through_a_narrower_margin(setup, name):
    """A cap the first margin's candidates overflow (as thousands of rows within a few
    temperatures do on flat prose): the draw takes the narrower margin, not the full
    head, and still follows the exact processed distribution."""
    head, hidden, logits = setup
    params = SETTINGS[name]
    screen = head.screen(hidden.unsqueeze(0))
    (wide,), (narrow,) = (screen.select(torch.tensor([certified_sampling.margin(params, t)], dtype=torch.float64))
                          for t in (certified_sampling.MARGINS[0], certified_sampling.NARROW_MARGIN))
    assert narrow.rows.numel() < wide.rows.numel()  # the test is about a cap between them
    head = CertifiedHead(head.weight, cap=narrow.rows.numel())
    counts = draws(head, hidden, params, margins=certified_sampling.MARGINS)  # min-p's own default starts narrow
    assert head.stats.narrowed > 0 and head.stats.fallbacks == 0
    assert p_value(counts, exact_probs(logits, params)) > ALPHA


@pytest.mark.parametrize("top_p, min_p, temperature", [(None, 0.05, 1.0), (0.9, 0.05, 1.0), (0.7, 0.01, 1.5)])
@pytest.mark.parametrize("margins", [certified_sampling.MARGINS, (1.0,)])
def test_under_min_p_the_tail_is_counted_only_for_an_open_nucleus(setup, top_p, min_p, temperature, margins):
    """Min-p removes every row outside the candidates: the draw leaves the tail out (a
    draw from the candidates alone follows the processed distribution, also where the
    tail holds real mass: margins of one temperature), and counts its bins only where
    a top-p decision needs their mass (the last setting: a nucleus ending among tokens
    min-p keeps)."""
    head, hidden, logits = setup
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    head = CertifiedHead(head.weight)
    assert p_value(draws(head, hidden, params, margins=margins), exact_probs(logits, params)) > ALPHA
    if min_p == 0.01:
        assert 0 < head.stats.tails < DRAWS
    else:
        assert head.stats.tails == 0


@pytest.mark.parametrize("room", ["wide", "none"])
def test_an_open_nucleus_is_settled_over_a_wider_selection_before_the_full_head(setup, room):
    """Top-p decisions the bounds leave open (a margin of one temperature leaves much
    of the mass in the tail): settled over a wider selection where the cap holds more
    rows, else by the full head; the draws follow the processed distribution either way."""
    head, hidden, logits = setup
    params = SamplingParams(temperature=1.0, top_p=0.7)
    (narrow,) = head.select(hidden.unsqueeze(0), torch.tensor([certified_sampling.margin(params, 1.0)],
                                                                dtype=torch.float64))
    head = CertifiedHead(head.weight, cap=V if room == "wide" else narrow.rows.numel())
    assert p_value(draws(head, hidden, params, margins=(1.0,)), exact_probs(logits, params)) > ALPHA
    if room == "wide":
        assert head.stats.widened > 0 and head.stats.undecided == 0
    else:
        assert head.stats.undecided > 0


def test_the_tail_bins_hold_every_row_outside_the_candidates_under_its_envelope(setup):
    head, hidden, logits = setup
    screen = head.screen(hidden.unsqueeze(0))
    (candidates,) = screen.select(torch.tensor([1.0], dtype=torch.float64))
    step, bins = 0.25, 16
    counts = screen.tail_counts(0, candidates.cut, step, bins)
    assert int(counts.sum()) == V - candidates.rows.numel()
    seen = []
    for b in range(bins):
        members = [screen.tail_row(0, candidates.cut, step, bins, b, j) for j in range(int(counts[b]))]
        assert members == sorted(members)
        assert all(float(logits[i]) <= candidates.cut - b * step for i in members)  # under the bin's envelope
        seen += members
    assert sorted(seen) == sorted(set(range(V)) - set(candidates.rows.tolist()))


def test_a_truncation_the_bound_cannot_decide_returns_none(setup):
    """Top-k larger than the candidates: the caller must take the full head, and nothing
    was drawn from the generator."""
    head, hidden, _ = setup
    screen = head.screen(hidden.unsqueeze(0))
    (few,) = screen.select(torch.tensor([0.5], dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    too_many = SamplingParams(temperature=1.0, top_k=few.rows.numel() + 1)
    assert certified_draw(screen, 0, hidden, too_many, generator, margins=(0.5,)) is None
    # Top-p without the full head to settle an open decision: refused before drawing.
    assert certified_draw(screen, 0, hidden, SamplingParams(temperature=1.0, top_p=0.9), generator,
                          margins=(0.5,)) is None
    assert torch.equal(generator.get_state(), state)


# ------------------------------------------------------------------ through the engines
OPTIONS = EngineOptions(progress=False, max_tree_nodes=12, prefill_chunk=16)
SAMPLED = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9),
           SamplingParams(temperature=0.7, top_k=10, min_p=0.05)]


def bf16_decoder(family: str):
    return tiny_decoder(family, dtype=torch.bfloat16, head_dim=32)  # bf16 speculation is exact at head_dim 32


def run(model, prompt, params, method, seed, tokens=48):
    drafter = make_drafter(method) if method != "ar" else None
    engine = SpeculativeEngine(model, OPTIONS)
    return torch.cat(list(engine.generate(prompt, params=params, max_new_tokens=tokens, drafter=drafter,
                                          generator=torch.Generator().manual_seed(seed))))


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_seeded_runs_through_the_certified_sampler_equal_plain_decoding(family):
    model = bf16_decoder(family)
    head = model.certified_head
    prompt = random_ids(8, seed=5)[0].repeat(3)
    for params in SAMPLED:
        reference = run(model, prompt, params, "ar", seed=3)
        for method in ("pld", "ngram"):
            assert torch.equal(run(model, prompt, params, method, seed=3), reference), (method, params)
    assert head.stats.rows > 0


def test_min_p_zero_decodes_as_no_min_p():
    """min_p = 0 keeps every token (the processors' rule, and the API's lower bound):
    a seeded run draws what the same run without min-p draws, with and without top-k."""
    model = bf16_decoder("llama")
    prompt = random_ids(8, seed=2)[0].repeat(2)
    for params in (dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=10)):
        reference = run(model, prompt, SamplingParams(**params), "ar", seed=4)
        assert torch.equal(run(model, prompt, SamplingParams(**params, min_p=0.0), "pld", seed=4), reference)
    assert model.certified_head.stats.rows > 0


def test_batched_sampled_rows_equal_their_single_runs():
    model = bf16_decoder("llama")
    prompts = [random_ids(7, seed=s)[0].repeat(2) for s in range(3)]
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=3, row_capacity=256))
    handles = [engine.submit(p, params=SAMPLED[i], max_new_tokens=40, drafter=make_drafter("pld"),
                             generator=torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    engine.run()
    for i, (prompt, handle) in enumerate(zip(prompts, handles)):
        assert torch.equal(handle.tokens, run(model, prompt, SAMPLED[i], "ar", seed=i, tokens=40))


def test_a_uniform_at_or_past_the_last_cumulative_sum_picks_the_last_row_with_weight():
    """`weights.sum()` and the cumulative sum's last entry may round apart: a draw of u * sum
    at or past the end must land on the last row that has weight (as the plain draw does),
    never past the candidates."""
    from longspec.speculation.certified_sampling import _Draw

    draw = object.__new__(_Draw)
    draw.rows = torch.tensor([3, 8, 11, 20])
    weights = torch.tensor([0.25, 0.5, 0.25, 0.0], dtype=torch.float64)
    assert draw._pick(weights, float(torch.cumsum(weights, 0)[-1]) * (1 + 1e-15)) == 11
    assert draw._pick(weights, 0.3) == 8
