"""The native truncation-sampling kernels (runtime/kernels/truncated_sampling.cpp): the
kept set of top-k, then top-p, then min-p is the one the warpers' rules give when computed
exactly (float64 over the row sorted by score, ties at a cut kept), the probabilities are
the softmax over it, and a draw is bit for bit the PyTorch path's (same seed, same token)."""

from __future__ import annotations

import math

import pytest
import torch

from longspec.runtime import native
from longspec.speculation import processors
from longspec.speculation.processors import SamplingParams, processed_logits, processed_probs, sample

OPS = native.native_ops()
needs_library = pytest.mark.skipif(OPS is None, reason="native kernels unavailable here (reason logged)")


def exact_kept(scores: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The rules as TopK-, TopP- and MinPLogitsWarper state them (min_tokens_to_keep=1),
    one row, float64, in order: a warper keeps a prefix of the tokens ranked by score and
    every token tied with the prefix's last one."""
    s = scores.double()
    kept = torch.isfinite(s) | (s == s.max())
    if top_k and top_k < s.numel():
        kept &= s >= s.topk(top_k).values[-1]
    if top_p < 1:
        probs = s.masked_fill(~kept, -math.inf).softmax(-1)
        order = probs.argsort(descending=True, stable=True)
        above = probs[order].cumsum(0) - probs[order]
        last = max(int((above < top_p).sum()) - 1, 0)
        kept &= s >= s[order[last]]
    if min_p > 0:
        probs = s.masked_fill(~kept, -math.inf).softmax(-1)
        kept &= probs >= min_p * probs.max()
    return kept


def rows(seed: int):
    """Rows that stress the cuts: smooth, peaked, flat, bf16-quantised (ties everywhere),
    with -inf entries, and a length that is no multiple of the 16-wide vector."""
    g = torch.Generator().manual_seed(seed)
    yield torch.randn(4, 3001, generator=g) * 3
    yield torch.randn(4, 4096, generator=g) * 0.3  # flat: large nuclei
    peaked = torch.randn(4, 2048, generator=g)
    peaked[:, 7] += 12
    yield peaked
    yield (torch.randn(4, 5000, generator=g) * 4).to(torch.bfloat16).float()  # ties at every cut
    masked = torch.randn(3, 1000, generator=g) * 2
    masked[:, ::3] = -math.inf
    yield masked
    yield torch.randn(2, 17, generator=g)


TOP_P_ROUNDING = 1e-6
SETTINGS = [(0, 0.95, 0.05), (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.1), (50, 1.0, 0.0), (20, 0.8, 0.0),
            (40, 0.95, 0.02), (1, 0.9, 0.3), (0, 0.999, 0.0), (0, 1.0, 1.0)]


@needs_library
@pytest.mark.parametrize("top_k, top_p, min_p", SETTINGS)
def test_kept_set_is_the_exact_rule_and_probs_its_softmax(top_k, top_p, min_p):
    for batch in rows(top_k + int(100 * top_p) + int(100 * min_p)):
        got = OPS.truncated_probs(batch.contiguous(), top_k, top_p, min_p)
        for scores, probs in zip(batch, got):
            kept = probs > 0
            # Top-p's masses come from a float32 normaliser: a cut whose mass lies within
            # ~1e-7 of top_p may fall either way (the rows above hold two such cuts).
            fewest = exact_kept(scores, top_k, top_p * (1 - TOP_P_ROUNDING), min_p)
            most = exact_kept(scores, top_k, min(top_p * (1 + TOP_P_ROUNDING), 1.0) if top_p < 1 else 1.0, min_p)
            assert bool((fewest <= kept).all() and (kept <= most).all()), (top_k, top_p, min_p, int(kept.sum()),
                                                                           int(fewest.sum()), int(most.sum()))
            if top_p >= 1:  # without top-p every cut is exact
                assert torch.equal(kept, exact_kept(scores, top_k, top_p, min_p))
            expected = scores.double().masked_fill(~kept, -math.inf).softmax(-1)
            torch.testing.assert_close(probs.double(), expected, rtol=1e-6, atol=1e-9)


@needs_library
def test_processed_probs_runs_the_kernel_for_truncated_float32_and_bf16_rows(monkeypatch):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 4000, generator=g) * 3).to(torch.bfloat16)
    history = torch.randint(0, 4000, (5, 30), generator=g)
    params = SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02, penalty=1.3)
    got = processed_probs(logits, history, params)
    scores = processors._temperature(processors._penalized(logits, history, params), params.temperature)
    assert torch.equal(got, OPS.truncated_probs(scores, 100, 0.9, 0.02))
    for scores_row, probs in zip(scores, got):
        assert torch.equal(probs > 0, exact_kept(scores_row, 100, 0.9, 0.02))
    # Without the library, the PyTorch path gives the same kept sets on these rows.
    monkeypatch.setattr(processors, "native_ops", lambda: None)
    torch.testing.assert_close(processed_probs(logits, history, params), got, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_top_k_beyond_the_vocabulary_keeps_every_token(dtype):
    """A top_k beyond int64 (a request's) reaches neither the kernel nor topk as such."""
    logits = (torch.randn(3, 500, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    for top_k in (500, 501, 2**40, 2**63 + 5):
        got = processed_probs(logits, None, SamplingParams(temperature=0.7, top_k=top_k, top_p=0.9))
        assert torch.equal(got, processed_probs(logits, None, SamplingParams(temperature=0.7, top_p=0.9)))


def test_processed_probs_keeps_the_pytorch_path_where_the_kernel_does_not_apply(monkeypatch):
    """float64 (the exact tests), no truncation, eta: the PyTorch path, whatever the library."""
    calls = []
    if OPS is not None:
        class Spy:
            def __getattr__(self, name):
                calls.append(name)
                return getattr(OPS, name)
        monkeypatch.setattr(processors, "native_ops", lambda: Spy())
    logits = torch.randn(2, 300, dtype=torch.float64)
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=1.0, top_p=0.9, eta=0.01)):
        x = logits if params.top_p and params.eta is None else logits.float()
        torch.testing.assert_close(processed_probs(x, None, params), processed_logits(x, None, params).softmax(-1))
    assert "truncated_probs" not in calls


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_draw_is_the_pytorch_draw_bit_for_bit(monkeypatch, dtype):
    g = torch.Generator().manual_seed(5)
    dense = torch.rand(6, 3001, generator=g, dtype=dtype)
    sparse = dense * (torch.rand(6, 3001, generator=g, dtype=dtype) < 0.01)
    sparse[:, 17] += 1e-3  # every row has mass
    tiny_tail = torch.zeros(2, 40, dtype=dtype)
    tiny_tail[:, 0], tiny_tail[:, 39] = 1.0, 1e-30
    for probs in (dense, sparse, tiny_tail, dense.softmax(-1)):
        native_draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(40)]
        with monkeypatch.context() as m:
            m.setattr(processors, "native_ops", lambda: None)
            torch_draws = [sample(probs, torch.Generator().manual_seed(s)) for s in range(40)]
        assert all(torch.equal(a, b) for a, b in zip(native_draws, torch_draws))
