"""Logits processors: pure, batched functions of (logits, per-row history, params).

Speculative verification must score every tree node with exactly the distribution
plain autoregressive decoding would have used at that point, or decoding is no
longer lossless. The engine therefore applies these functions to all nodes at
once, each row carrying the node's own token history (its ancestor path), and
autoregressive decoding uses the same functions with a single row.

The penalty and warpers reproduce, in order, what transformers' ``generate``
applies for sampling: RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper and EtaLogitsWarper (all with
``min_tokens_to_keep=1``).

On the CPU, truncated distributions (top-k, top-p, min-p) of float32/bf16 logits and
every draw run through native kernels (`runtime/kernels/truncated_sampling.cpp`); the
PyTorch code here is their reference and runs everywhere else (float64 included).

Histories are ``[N, W]`` int64 with ``-1`` as padding. ``history_windows`` builds
them right-aligned (left-padded), but padding may sit anywhere: only the row's
non-padding tokens and their order matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longspec.runtime.argmax import row_argmax
from longspec.runtime.device import HOST
from longspec.runtime.native import native_ops

_NEG_INF = float("-inf")
_NOT_A_DISTRIBUTION = "probs rows must be finite and non-negative with a positive total"
# The penalty divides or multiplies logits by theta; within [1/limit, limit] the
# result stays far inside float32's range for any logit a model produces.
_PENALTY_LIMIT = 2.0**32


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's logits.

    temperature: 0 means greedy (argmax after the penalty); > 0 samples.
    top_k: keep the k most likely tokens; None or 0 disables.
    top_p: nucleus mass in (0, 1]; None (or 1.0) disables.
    min_p: in [0, 1], drop tokens below min_p * p_max; None disables.
    eta: eta-sampling epsilon in (0, 1); None disables.
    penalty: contextual (repetition) penalty theta > 0, usually >= 1; 1.0 disables.
    penalty_window: only the last W tokens of a row's history are penalized.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    eta: float | None = None
    penalty: float = 1.0
    penalty_window: int = 1024

    def __post_init__(self) -> None:
        t = self.temperature
        if not (_is_real(t) and t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t!r}")
        k = self.top_k
        if k is not None and not (_is_int(k) and k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 or None (0 or None disables), got {k!r}")
        p = self.top_p
        if p is not None and not (_is_real(p) and 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if m is not None and not (_is_real(m) and 0 <= m <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        e = self.eta
        if e is not None and not (_is_real(e) and 0 < e < 1):
            raise ValueError(f"eta must be in (0, 1), got {e!r}")
        th = self.penalty
        if not (_is_real(th) and 1 / _PENALTY_LIMIT <= th <= _PENALTY_LIMIT):
            raise ValueError(
                f"penalty must lie in [2^-32, 2^32] (1.0 disables, usually 1-2; beyond that range logits "
                f"would overflow), got {th!r}"
            )
        w = self.penalty_window
        if not (_is_int(w) and w >= 1):
            raise ValueError(f"penalty_window must be an integer >= 1, got {w!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        return self.penalty != 1.0


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # Half-precision softmax/cumsum would shift top-p and eta cut-offs.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating point tensor, got {logits.dtype}")


def _check_histories(histories: torch.Tensor, n: int) -> None:
    if histories.dim() != 2 or histories.shape[0] != n:
        raise ValueError(f"histories must be [N={n}, W], got shape {tuple(histories.shape)}")
    if histories.dtype.is_floating_point or histories.dtype == torch.bool:
        raise ValueError(f"histories must be an integer tensor, got {histories.dtype}")


def _last_tokens(histories: torch.Tensor, window: int) -> torch.Tensor:
    """Keep only the last ``window`` non-padding tokens of each row (others -> -1)."""
    if histories.shape[1] <= window:
        return histories
    valid = histories >= 0
    # Count real tokens from the right, so padding may sit anywhere in the row.
    from_right = valid.flip(-1).cumsum(-1).flip(-1)
    return histories.masked_fill(~valid | (from_right > window), -1)


def penalize(logits: torch.Tensor, histories: torch.Tensor, theta: float) -> torch.Tensor:
    """Repetition penalty, once per distinct token of each row's history.

    logits: [N, V]; histories: [N, W] integer, -1 (and any id outside [0, V)) ignored.
    A token's logit is divided by theta when positive and multiplied otherwise.
    Returns a new tensor in the compute dtype (float32, or float64 for float64 input).
    """
    _check_logits(logits)
    _check_histories(histories, logits.shape[0])
    scores = logits.to(_compute_dtype(logits), copy=True)
    if theta == 1.0 or histories.shape[1] == 0:
        return scores
    v = scores.shape[1]
    hist = histories.to(device=scores.device, dtype=torch.long)
    valid = (hist >= 0) & (hist < v)  # padding and out-of-vocab ids are ignored, like HF
    # Touch only the history's columns (O(N * W), not O(N * V)): gather, penalize,
    # scatter back. Invalid slots repeat a valid token of their row, so every write to a
    # column carries the same value (the penalty is applied to the original score, once).
    has_valid = valid.any(dim=1, keepdim=True)
    stand_in = hist.gather(1, valid.to(torch.int8).argmax(dim=1, keepdim=True))
    index = torch.where(valid, hist, torch.where(has_valid, stand_in, 0))
    current = scores.gather(1, index)
    penalized = torch.where(current < 0, current * theta, current / theta)
    return scores.scatter_(1, index, torch.where(has_valid, penalized, current))


def history_windows(tokens: torch.Tensor, ends: torch.Tensor, window: int) -> torch.Tensor:
    """Row r: the last ``window`` tokens of ``tokens[:ends[r]]``, left-padded with -1.

    tokens: [T] int64; ends: [N] int64 with 0 <= ends[r] <= T. Returns [N, window] int64.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D [T], got shape {tuple(tokens.shape)}")
    if ends.dim() != 1:
        raise ValueError(f"ends must be 1-D [N], got shape {tuple(ends.shape)}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    # A leading -1 sentinel at index 0 turns every before-the-start position into
    # padding by clamping, and makes an empty token stream safe to gather from.
    padded = torch.cat([tokens.new_full((1,), -1, dtype=torch.long), tokens.to(torch.long)])
    offsets = torch.arange(1 - window, 1, device=tokens.device, dtype=torch.long)
    idx = (ends.to(device=tokens.device, dtype=torch.long)[:, None] + offsets[None, :]).clamp_(min=0)
    return padded[idx]


def _temperature(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """scores / T. Where that would overflow (T tiny), each row is first shifted by
    its maximum, which leaves every softmax-based step unchanged and keeps the scores
    finite: the top token scores 0, the rest fall towards -inf."""
    if temperature < 1 and float(scores.abs().amax()) > torch.finfo(scores.dtype).max * temperature:
        scores = scores - scores.amax(dim=-1, keepdim=True)
    return scores / temperature


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    # Ties with the k-th score survive, exactly as in TopKLogitsWarper.
    return scores.masked_fill(scores < kth, _NEG_INF)


# Candidates first examined by top-p; the set grows 4x until it holds the nucleus.
_TOP_P_FIRST_CANDIDATES = 256


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """TopPLogitsWarper's rule — remove a token when the tokens ranked above it
    already hold at least `top_p` of the mass (so the top token always stays) —
    computed over the best candidates only: the nucleus lies within the k most likely
    tokens as soon as they hold `top_p`, so a partial top-k replaces sorting the whole
    vocabulary (docs/lab-notes/sampling.md#sampling-cost-top-p-without-sorting-the-vocabulary).
    Tokens whose score ties the last kept one all survive, as in top-k (a full sort
    would split such ties by its own order; bf16 logits tie often)."""
    probs = scores.softmax(dim=-1)
    vocab = scores.shape[-1]
    k = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        values, index = torch.topk(probs, k, dim=-1)  # descending
        if k == vocab or bool((values.sum(dim=-1) >= top_p).all()):
            break
        k = min(4 * k, vocab)
    mass_above = values.cumsum(dim=-1) - values
    last_kept = ((mass_above < top_p).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    cut = scores.gather(1, index.gather(1, last_kept))
    return scores.masked_fill(scores < cut, _NEG_INF)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    # min_p <= 1 means the top token always survives; no explicit keep-one needed.
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(remove, _NEG_INF)


def _eta(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    log_probs = scores.log_softmax(dim=-1)
    # Clamp -inf so removed tokens add 0 * finite, as torch.distributions.Categorical does.
    log_probs = log_probs.clamp(min=torch.finfo(scores.dtype).min)
    entropy = -(probs * log_probs).sum(dim=-1, keepdim=True)
    cutoff = torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)
    keep_top = scores >= scores.amax(dim=-1, keepdim=True)
    return scores.masked_fill((probs < cutoff) & ~keep_top, _NEG_INF)


def _penalized(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    _check_logits(logits)
    if not params.uses_history:
        return logits.to(_compute_dtype(logits), copy=True)
    if histories is None:
        raise ValueError(f"penalty={params.penalty} needs per-row histories, got None")
    _check_histories(histories, logits.shape[0])
    return penalize(logits, _last_tokens(histories, params.penalty_window), params.penalty)


def processed_logits(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """Penalty, then temperature, top-k, top-p, min-p, eta; removed tokens are -inf.

    Greedy params get the penalty only. Returns float32 (float64 for float64 input).
    """
    scores = _penalized(logits, histories, params)
    if params.is_greedy:
        return scores
    # Each step is skipped exactly when generate() would not install its warper.
    if params.temperature != 1.0:
        scores = _temperature(scores, params.temperature)
    if params.top_k:
        scores = _top_k(scores, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    if params.min_p is not None:
        scores = _min_p(scores, params.min_p)
    if params.eta is not None:
        scores = _eta(scores, params.eta)
    return scores


def processed_probs(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """The distribution the next token is drawn from; one-hot of the argmax if greedy."""
    ops = _native_truncation(logits, params)
    if ops is not None:
        scores = _penalized(logits, histories, params)
        if params.temperature != 1.0:
            scores = _temperature(scores, params.temperature)
        # A top_k beyond the vocabulary keeps every token (and must not overflow the op's int64).
        top_k = min(params.top_k or 0, scores.shape[-1])
        return ops.truncated_probs(scores, top_k, 1.0 if params.top_p is None else params.top_p,
                                   params.min_p or 0.0)
    scores = processed_logits(logits, histories, params)
    if params.is_greedy:
        one_hot = torch.zeros_like(scores)
        return one_hot.scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
    return scores.softmax(dim=-1)


def _native_truncation(logits: torch.Tensor, params: SamplingParams):
    """The native kernel for top-k / top-p / min-p (`kernels/truncated_sampling.cpp`:
    one pass over the vocabulary and a sort of the few tokens that can survive, where
    the PyTorch path makes ~10 passes:
    docs/lab-notes/sampling.md#sampled-tokens-the-truncated-distribution-and-the-draw-in-a-native-kernel-issues-adaptive-speculation-external-drafters-self-speculation),
    or None where the PyTorch path runs: greedy, no truncation, eta, float64 (the exact
    tests' dtype), another device, or no native library."""
    truncates = bool(params.top_k) or (params.top_p is not None and params.top_p < 1.0) or bool(params.min_p)
    if params.is_greedy or not truncates or params.eta is not None:
        return None
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return native_ops()


def greedy_tokens(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """Argmax after the penalty (ties -> lowest index). Returns [N] int64."""
    if not params.uses_history:
        _check_logits(logits)
        return row_argmax(logits)
    return _penalized(logits, histories, params).argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [N, V] (non-negative, any positive total).
    Returns [N] int64.

    Inverse transform sampling: one uniform u per row (float64, from `generator`),
    the first token whose cumulative mass exceeds u times the row's total. Exact up to
    float64 rounding, and a token of zero mass is never drawn (its interval is empty).
    `torch.multinomial` spends far longer on one draw over a 262k vocabulary — a
    sizeable share of a decoding step — than the cumulative sum
    (docs/lab-notes/sampling.md#drawing-the-sampled-token-inverse-cdf-instead-of-torchmultinomial-issue-runtime-speed)."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [N, V], got shape {tuple(probs.shape)}")
    # The native draw (`kernels/truncated_sampling.cpp`) adds the same float64 sums in the
    # same order, skipping all-zero blocks, which makes it far cheaper on a truncated row
    # (docs/lab-notes/sampling.md#sampled-tokens-the-truncated-distribution-and-the-draw-in-a-native-kernel-issues-adaptive-speculation-external-drafters-self-speculation).
    ops = native_ops() if probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64) else None
    if ops is None:
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        if not bool(((total > 0) & torch.isfinite(total)).all()) or bool((probs < 0).any()):
            raise ValueError(_NOT_A_DISTRIBUTION)
    draw_device = generator.device if generator is not None else probs.device
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=draw_device)
    if ops is not None:
        tokens = ops.draw_rows(probs.contiguous(), u.to(HOST).reshape(-1).contiguous())
        if bool((tokens < 0).any()):
            raise ValueError(_NOT_A_DISTRIBUTION)
        return tokens
    tokens = torch.searchsorted(cdf, u.to(probs.device) * total, right=True)
    # u * total can round up to the total itself: that draw belongs to the last token with mass.
    overflow = tokens >= probs.shape[1]
    if bool(overflow.any()):
        last_with_mass = probs.shape[1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1, keepdim=True)
        tokens = torch.where(overflow, last_with_mass, tokens)
    return tokens.squeeze(-1)
