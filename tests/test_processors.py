"""Processors must reproduce transformers' own logits processors exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    EtaLogitsWarper,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from longspec.speculation import processors
from longspec.speculation.processors import (
    SamplingParams,
    greedy_tokens,
    history_windows,
    penalize,
    processed_logits,
    processed_probs,
    sample,
)

V = 50
DTYPES = [torch.float32, torch.float64]


def _logits(n: int, dtype: torch.dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g, dtype=torch.float64) * scale).to(dtype)


def _tokens(t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # A small id range makes repeats (and hence "once per distinct token") likely.
    return torch.randint(0, 20, (t,), generator=g)


def _hf_reference(logits: torch.Tensor, input_ids: torch.Tensor | None, p: SamplingParams) -> torch.Tensor:
    """What generate() applies for ``p``, one row at a time, HF's own processors."""
    scores = logits.clone()
    if p.penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(p.penalty))(input_ids, scores)
    if p.is_greedy:
        return scores
    warpers = []
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(p.temperature)))
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p is not None and p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p is not None:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.typical_p is not None and p.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(p.typical_p))
    if p.eta is not None:
        warpers.append(EtaLogitsWarper(p.eta))
    for w in warpers:
        scores = w(input_ids, scores)
    return scores


def _assert_same_scores(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype
    # The set of removed tokens must match exactly; the survivors numerically.
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=1.0),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, eta=0.01),
    SamplingParams(temperature=2.0, eta=0.0009),
    SamplingParams(temperature=1.0, typical_p=0.9),
    SamplingParams(temperature=1.5, typical_p=0.2),
    SamplingParams(temperature=0.9, top_k=30, min_p=0.01, typical_p=0.7, eta=0.005),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, eta=0.005),
    SamplingParams(temperature=0.9, top_k=V + 10, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=10, top_p=0.9, penalty=1.3, penalty_window=8),
    SamplingParams(temperature=1.1, penalty=1.2, penalty_window=64),
    SamplingParams(temperature=1.0, min_p=0.1, eta=0.02, penalty=0.8, penalty_window=5),
    SamplingParams(penalty=1.5, penalty_window=7),  # greedy with penalty
    SamplingParams(),  # plain greedy
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PARAMS)), ids=[repr(p) for p in PARAMS])
def test_matches_transformers_per_row_histories(case: int, dtype: torch.dtype) -> None:
    params = PARAMS[case]
    n, t = 6, 40
    logits = _logits(n, dtype, seed=100 + case)
    tokens = _tokens(t)
    ends = torch.tensor([0, 1, 3, 7, 25, 40])
    histories = history_windows(tokens, ends, params.penalty_window)
    ours = processed_logits(logits, histories, params)
    for r in range(n):
        start = max(0, int(ends[r]) - params.penalty_window)
        input_ids = tokens[start : int(ends[r])][None, :]
        ref = _hf_reference(logits[r : r + 1], input_ids, params)
        _assert_same_scores(ours[r : r + 1], ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_penalty_window_matches_hf_on_last_w_tokens(dtype: torch.dtype) -> None:
    tokens = _tokens(100, seed=5)
    logits = _logits(1, dtype, seed=6)
    for window in (1, 3, 10, 99, 100, 500):
        params = SamplingParams(penalty=1.7, penalty_window=window)
        # A full-length history: processed_logits itself must cut it to the window.
        full = tokens[None, :]
        ours = processed_logits(logits, full, params)
        ref = RepetitionPenaltyLogitsProcessor(1.7)(tokens[None, -window:], logits.clone())
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_window_counts_real_tokens_wherever_the_padding_is() -> None:
    logits = _logits(2, torch.float64, seed=3)
    params = SamplingParams(penalty=2.0, penalty_window=2)
    # Row 0 right-padded, row 1 padded in the middle; each holds tokens [5, 6, 7].
    histories = torch.tensor([[5, 6, 7, -1, -1], [5, -1, 6, -1, 7]])
    ours = processed_logits(logits, histories, params)
    expected = penalize(logits, torch.tensor([[6, 7], [6, 7]]), 2.0)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_penalize_once_per_distinct_token_and_ignores_padding(dtype: torch.dtype) -> None:
    logits = _logits(3, dtype, seed=11)
    histories = torch.tensor(
        [
            [-1, -1, 4, 4, 4, 9],
            [-1, -1, -1, -1, -1, -1],
            [0, 1, 2, 2, 1, V - 1],
        ]
    )
    ours = penalize(logits, histories, 1.5)
    for r in range(3):
        ids = histories[r][histories[r] >= 0]
        ref = logits[r : r + 1].clone()
        if ids.numel():
            ref = RepetitionPenaltyLogitsProcessor(1.5)(ids[None, :], ref)
        torch.testing.assert_close(ours[r : r + 1], ref, rtol=0, atol=0)
    # Row 1 has no history at all: untouched.
    torch.testing.assert_close(ours[1], logits[1], rtol=0, atol=0)


def test_penalize_sign_rule_and_purity() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0]])
    before = logits.clone()
    out = penalize(logits, torch.tensor([[0, 1, 2, 0]]), 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 0.0, 1.0]]))
    assert torch.equal(logits, before)
    assert out.data_ptr() != logits.data_ptr()
    # Even a no-op penalty hands back a fresh tensor.
    assert penalize(logits, torch.tensor([[0]]), 1.0).data_ptr() != logits.data_ptr()


def test_penalize_ignores_out_of_vocab_ids_like_hf() -> None:
    logits = _logits(1, torch.float32, seed=2)
    histories = torch.tensor([[3, V, V + 7]])
    ref = RepetitionPenaltyLogitsProcessor(1.4)(histories, logits.clone())
    torch.testing.assert_close(penalize(logits, histories, 1.4), ref, rtol=0, atol=0)


def test_processed_logits_does_not_modify_input() -> None:
    logits = _logits(4, torch.float32, seed=9)
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.9, penalty=1.2, penalty_window=4)
    processed_logits(logits, history_windows(_tokens(10), torch.tensor([2, 4, 6, 10]), 4), params)
    assert torch.equal(logits, before)


def test_bfloat16_is_computed_in_float32() -> None:
    logits = _logits(3, torch.float32, seed=4).to(torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_p=0.9, penalty=1.3, penalty_window=4)
    histories = torch.tensor([[1, 2, 3, 4], [-1, -1, 5, 5], [-1, -1, -1, -1]])
    out = processed_logits(logits, histories, params)
    assert out.dtype == torch.float32
    ref = processed_logits(logits.float(), histories, params)
    assert torch.equal(out, ref)
    assert processed_probs(logits, histories, params).dtype == torch.float32


def test_histories_required_only_with_penalty() -> None:
    logits = _logits(2, torch.float32)
    processed_logits(logits, None, SamplingParams(temperature=1.0, top_k=3))
    greedy_tokens(logits, None, SamplingParams())
    with pytest.raises(ValueError, match="histor"):
        processed_logits(logits, None, SamplingParams(penalty=1.2))
    with pytest.raises(ValueError, match="histor"):
        greedy_tokens(logits, None, SamplingParams(penalty=1.2))
    with pytest.raises(ValueError, match="histories"):
        processed_logits(logits, torch.zeros(3, 4, dtype=torch.long), SamplingParams(penalty=1.2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_is_argmax_of_penalized_logits(dtype: torch.dtype) -> None:
    logits = _logits(8, dtype, seed=21)
    tokens = _tokens(30, seed=22)
    # Penalize each row's current favourite so the penalty actually changes answers.
    tokens[:8] = logits.argmax(dim=-1)
    ends = torch.arange(1, 9) * 3
    params = SamplingParams(penalty=3.0, penalty_window=16)
    histories = history_windows(tokens, ends, params.penalty_window)
    expected = penalize(logits, histories, 3.0).argmax(dim=-1)
    got = greedy_tokens(logits, histories, params)
    assert got.dtype == torch.int64 and got.shape == (8,)
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits.argmax(dim=-1))
    # Without a penalty it is the plain argmax, including ties -> lowest index.
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    assert greedy_tokens(tied, None, SamplingParams()).tolist() == [1, 0]


def test_greedy_probs_are_one_hot_of_argmax() -> None:
    logits = _logits(5, torch.float32, seed=31)
    histories = history_windows(_tokens(12), torch.tensor([0, 2, 5, 9, 12]), 6)
    params = SamplingParams(penalty=2.0, penalty_window=6)
    probs = processed_probs(logits, histories, params)
    expected = torch.nn.functional.one_hot(greedy_tokens(logits, histories, params), V).float()
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_processed_probs_is_softmax_of_processed_logits(dtype: torch.dtype) -> None:
    logits = _logits(4, dtype, seed=41)
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
    probs = processed_probs(logits, None, params)
    torch.testing.assert_close(probs, processed_logits(logits, None, params).softmax(-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=probs.dtype))
    assert probs.dtype == dtype


def test_sample_respects_support_and_generator() -> None:
    logits = _logits(64, torch.float32, seed=51)
    params = SamplingParams(temperature=1.0, top_k=3)
    probs = processed_probs(logits, None, params)
    draws = sample(probs, torch.Generator().manual_seed(0))
    assert draws.dtype == torch.int64 and draws.shape == (64,)
    assert bool((probs.gather(1, draws[:, None]) > 0).all())
    again = sample(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)


def test_sample_frequencies_match_probs() -> None:
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.0, 0.5]])
    rows = probs.repeat(4000, 1)
    draws = sample(rows, torch.Generator().manual_seed(1)).view(4000, 2)
    for r in range(2):
        freq = torch.bincount(draws[:, r], minlength=3).double() / 4000
        torch.testing.assert_close(freq, probs[r].double(), rtol=0, atol=0.03)
    assert not bool((draws[:, 1] == 1).any())


def test_sample_passes_a_chi_square_test_with_zero_mass_tokens() -> None:
    """10^5 draws from one distribution with zero-mass tokens at both ends and inside."""
    from scipy.stats import chisquare

    probs = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0], dtype=torch.float32)
    draws = sample(probs.expand(100_000, -1), torch.Generator().manual_seed(11))
    counts = torch.bincount(draws, minlength=probs.numel())
    assert int(counts[probs == 0].sum()) == 0
    support = probs > 0
    expected = probs[support].double() / probs.double().sum() * draws.numel()
    assert chisquare(counts[support].double().numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("native_draw", [True, False])
def test_sample_draws_by_inverse_cdf_and_never_a_zero_mass_token(monkeypatch, native_draw: bool) -> None:
    """The draw is the first token whose cumulative mass exceeds u * total; a uniform
    whose product rounds up to the total still lands on a token with mass (u = 1
    forces that branch); malformed rows are refused instead of drawn from. Both the
    native draw and the PyTorch path."""
    if not native_draw:
        monkeypatch.setattr(processors, "native_ops", lambda: None)
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        for u, expected in ((0.0, 1), (0.29, 1), (0.31, 3), (1.0 - 2.0**-53, 3), (1.0, 3)):
            with monkeypatch.context() as m:
                m.setattr(torch, "rand", lambda *a, u=u, **k: torch.full((1, 1), u, dtype=torch.float64))
                assert int(sample(probs.to(dtype), torch.Generator())[0]) == expected, (u, dtype)
    for bad in ([[0.0, 0.0]], [[float("nan"), 1.0]], [[-0.1, 1.1]], [[float("inf"), 1.0]]):
        with pytest.raises(ValueError, match="non-negative"):
            sample(torch.tensor(bad))


def _windows_reference(tokens: list[int], ends: list[int], window: int) -> list[list[int]]:
    out = []
    for e in ends:
        last = tokens[:e][-window:] if window else []
        out.append([-1] * (window - len(last)) + last)
    return out


@pytest.mark.parametrize("window", [0, 1, 4, 10, 25])
def test_history_windows_against_python_reference(window: int) -> None:
    tokens = _tokens(17, seed=61)
    ends = torch.tensor([0, 1, 2, 5, 10, 16, 17])
    got = history_windows(tokens, ends, window)
    assert got.dtype == torch.int64 and got.shape == (7, window)
    assert got.tolist() == _windows_reference(tokens.tolist(), ends.tolist(), window)


def test_history_windows_on_empty_stream() -> None:
    got = history_windows(torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]), 3)
    assert got.tolist() == [[-1, -1, -1], [-1, -1, -1]]


def test_params_properties() -> None:
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert not SamplingParams().uses_history
    assert SamplingParams(penalty=1.1).uses_history
    assert SamplingParams(penalty=0.9).uses_history
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        ({"temperature": -1.0}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_p": -0.1}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", ">= 0"),
        ({"top_k": 2.5}, "top_k", ">= 0"),
        ({"min_p": -0.01}, "min_p", "[0, 1]"),
        ({"min_p": 1.01}, "min_p", "[0, 1]"),
        ({"eta": 0.0}, "eta", "(0, 1)"),
        ({"eta": 1.0}, "eta", "(0, 1)"),
        ({"eta": -0.5}, "eta", "(0, 1)"),
        ({"penalty": 0.0}, "penalty", "[2^-32, 2^32]"),
        ({"penalty": -1.2}, "penalty", "[2^-32, 2^32]"),
        ({"penalty_window": 0}, "penalty_window", ">= 1"),
        ({"penalty_window": -3}, "penalty_window", ">= 1"),
    ],
)
def test_validation_names_field_value_and_range(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(field + " ")
    assert fragment in msg
    assert repr(next(iter(kwargs.values()))) in msg


def test_validation_message_examples() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 \(0 means greedy\), got -1\.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5)


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, penalty_window=1)
    SamplingParams(temperature=2, top_k=None, top_p=None, min_p=1.0, eta=0.5, penalty=0.5)


@pytest.mark.parametrize("scale,top_p", [(0.05, 0.95), (1.0, 0.9), (8.0, 0.5)])
def test_top_p_over_a_large_vocabulary_matches_the_full_sort(scale, top_p):
    """Nuclei from a handful of tokens to most of a 5000-token vocabulary (the
    candidate set grows past its first guess), against transformers' full sort."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 5000, generator=g, dtype=torch.float64) * scale
    params = SamplingParams(temperature=1.0, top_p=top_p)
    ours = processed_logits(logits, None, params)
    ref = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = (~torch.isinf(ours)).sum(dim=-1)
    assert kept.min() >= 1 and (scale > 1 or kept.max() > 256)


def test_top_p_keeps_every_token_tied_with_the_last_kept_one():
    # Probabilities 0.4, 0.2, 0.2, 0.2: top-p 0.5 needs the top token and one of the
    # tied three; all three survive rather than an arbitrary one by sort order.
    logits = torch.log(torch.tensor([[0.2, 0.4, 0.2, 0.2]], dtype=torch.float64))
    kept = ~torch.isinf(processed_logits(logits, None, SamplingParams(temperature=1.0, top_p=0.5)))
    assert kept.tolist() == [[True, True, True, True]]
    kept = ~torch.isinf(processed_logits(logits, None, SamplingParams(temperature=1.0, top_p=0.4)))
    assert kept.tolist() == [[False, True, False, False]]
