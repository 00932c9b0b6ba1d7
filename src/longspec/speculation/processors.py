"""Logits processors: pure, batched functions of (logits, per-row history, params).

Speculative verification must score every tree node with exactly the distribution
plain autoregressive decoding would have used at that point, or decoding is no
longer lossless. The engine therefore applies these functions to all nodes at
once, each row carrying the node's own token history (its ancestor path), and
autoregressive decoding uses the same functions with a single row.

The chain, in order: the logit bias (OpenAI's `logit_bias`), the repetition penalty
(transformers' RepetitionPenaltyLogitsProcessor), the presence and frequency penalties
(OpenAI's and vLLM's, over the tokens generated so far), then transformers' warpers
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper and
EtaLogitsWarper (all with ``min_tokens_to_keep=1``).

On the CPU, truncated distributions (top-k, top-p, min-p) of float32/bf16 logits and
every draw run through native kernels (`runtime/kernels/truncated_sampling.cpp`); the
PyTorch code here is their reference and runs everywhere else (float64 included).

Histories are ``[N, W]`` int64 with ``-1`` as padding: each row a node's recent
tokens (the repetition penalty's window) followed by its own path. The presence and
frequency penalties read another history per node, its generated tokens and path
(`NodeHistories.outputs`). Padding may sit anywhere: only a row's non-padding tokens
and their order matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    typical_p: locally typical sampling's mass in (0, 1]: keep the tokens whose
        surprise is nearest the distribution's entropy until they hold it; None (or
        1.0) disables.
    penalty: contextual (repetition) penalty theta > 0, usually >= 1; 1.0 disables.
    penalty_window: only the last W tokens of a row's history are penalized.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logit of every
        token already generated, once and once per occurrence (OpenAI's definition).
    logit_bias: token id -> bias in [-100, 100], added to that token's logit.
    constrained: a grammar allows some tokens at each row (`NodeHistories.allowed`,
        speculation/grammar.py); the others are removed before any decision.
    """

    # `help` and `type`: the CLI's option for the field (`cli/main.py` offers every field that has them).
    temperature: float = field(default=0.0, metadata={"type": float, "help": "0 = greedy (default)"})
    top_k: int | None = field(default=None, metadata={"type": int, "help": "keep the k most likely tokens"})
    top_p: float | None = field(default=None, metadata={"type": float, "help": "nucleus mass in (0, 1]"})
    min_p: float | None = field(default=None, metadata={"type": float, "help": "drop tokens below min_p * p_max"})
    eta: float | None = field(default=None, metadata={"type": float, "help": "eta-sampling epsilon in (0, 1)"})
    typical_p: float | None = field(default=None, metadata={
        "type": float, "help": "locally typical sampling's mass in (0, 1] (1 = off)"})
    penalty: float = field(default=1.0, metadata={"type": float,
                                                   "help": "contextual repetition penalty theta (1 = off)"})
    penalty_window: int = field(default=1024, metadata={"type": int, "help": "penalize tokens of the last W tokens"})
    presence_penalty: float = field(default=0.0, metadata={
        "type": float, "help": "in [-2, 2]: subtracted once from every generated token's logit (OpenAI's)"})
    frequency_penalty: float = field(default=0.0, metadata={
        "type": float, "help": "in [-2, 2]: subtracted per occurrence of a generated token (OpenAI's)"})
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs; a dict is accepted
    constrained: bool = False

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
        typical = self.typical_p
        if typical is not None and not (_is_real(typical) and 0 < typical <= 1):
            raise ValueError(f"typical_p must be in (0, 1], got {typical!r}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must lie in [-2, 2] (0 disables), got {value!r}")
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(bias or ())
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                    and _is_real(pair[1]) and -100.0 <= pair[1] <= 100.0):
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {pair!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if not isinstance(self.constrained, bool):
            raise ValueError(f"constrained must be a bool, got {self.constrained!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether each node's recent tokens are needed (the repetition penalty)."""
        return self.penalty != 1.0

    @property
    def counts_outputs(self) -> bool:
        """Whether each node's generated tokens are needed (presence, frequency)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_whole_distribution(self) -> bool:
        """Whether a warper's cut needs every token's probability (eta and typical
        sampling: the entropy): the certified head's draws and the native truncation
        kernel, which see only the likely tokens, then step aside."""
        return self.eta is not None or (self.typical_p is not None and self.typical_p < 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether processors change logits before the warpers (bias, penalties, a
        grammar's mask): a decision then reads the adjusted logits, not the head's argmax."""
        return self.uses_history or self.counts_outputs or bool(self.logit_bias) or self.constrained


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
    """TopPLogitsWarper's rule (`top_p_cut`) computed over the best candidates only: the
    nucleus lies within the k most likely tokens as soon as they hold `top_p`, so a
    partial top-k replaces sorting the whole vocabulary
    (docs/lab-notes/sampling.md#sampling-cost-top-p-without-sorting-the-vocabulary).
    Tokens whose score ties the last kept one all survive, as in top-k (a full sort
    would split such ties by its own order; bf16 logits tie often)."""
    best = scores.amax(dim=-1, keepdim=True).double()
    total = torch.exp(scores.double() - best).sum(dim=-1, keepdim=True)
    vocab = scores.shape[-1]
    k = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        ranked = torch.topk(scores, k, dim=-1).values  # descending
        held = torch.exp(ranked.double() - best).sum(dim=-1, keepdim=True)
        if k == vocab or bool((held >= top_p * total).all()):
            break
        k = min(4 * k, vocab)
    return scores.masked_fill(scores < top_p_cut(ranked, total, top_p), _NEG_INF)


def top_p_cut(ranked: torch.Tensor, total: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's rule, stated once for every sampler (this module's, the native kernel's,
    the certified head's): a token stays when the tokens scoring strictly above it hold
    less than `top_p` of the row's mass, decided as  sum_{s_j > s_i} w_j < top_p * total
    in float64, with w = exp(score - best) over the scores as the samplers hold them
    (float32 logit / T), and `total` the sum of w over every token the warpers before it
    left. So the best token always stays, and tokens tied with the last kept one stay
    too. The samplers sum in different orders, which can move a decision only at a
    threshold within float64 rounding of a sum.

    `ranked`: [N, k] scores, best first, holding at least the nucleus; `total`: [N, 1]
    float64. Returns [N, 1]: the lowest score kept."""
    weights = torch.exp(ranked.double() - ranked[:, :1].double())
    running = torch.cumsum(weights, dim=-1)  # a running sum in rank order, as the native kernel's
    above = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=-1)
    last_kept = ((above < top_p * total).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return ranked.gather(1, last_kept)


def min_p_kept(scores: torch.Tensor, top: torch.Tensor | float, min_p: float) -> torch.Tensor:
    """Min-p's rule, stated once for every sampler (this module's, the native kernel's,
    the certified head's): a token stays when p_i >= min_p p_max, decided as
    score_i - score_max >= ln(min_p) in float64 over the scores as the samplers hold
    them (float32 logit / T). One expression in one precision, so a threshold that falls
    between float32's and float64's resolution is decided alike by all of them."""
    if min_p <= 0:  # 0 keeps every token
        return torch.ones_like(scores, dtype=torch.bool)
    top = top.double() if isinstance(top, torch.Tensor) else top
    return scores.double() - top >= math.log(min_p)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    # min_p <= 1 means the top token always survives; no explicit keep-one needed.
    kept = min_p_kept(scores, scores.amax(dim=-1, keepdim=True), min_p)
    return scores.masked_fill(~kept, _NEG_INF)


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """TypicalLogitsWarper's rule: rank tokens by how far their surprise lies from the
    entropy, keep them in that order until they hold `mass` (the first always stays)."""
    log_probs = scores.log_softmax(dim=-1)
    entropy = -(log_probs.exp() * log_probs).nansum(dim=-1, keepdim=True)
    distance, order = torch.sort((-log_probs - entropy).abs(), dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)
    remove_sorted = distance > distance.gather(-1, last)
    remove_sorted[..., :1] = False
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), _NEG_INF)


def _eta(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    log_probs = scores.log_softmax(dim=-1)
    # Clamp -inf so removed tokens add 0 * finite, as torch.distributions.Categorical does.
    log_probs = log_probs.clamp(min=torch.finfo(scores.dtype).min)
    entropy = -(probs * log_probs).sum(dim=-1, keepdim=True)
    cutoff = torch.clamp(math.sqrt(epsilon) * torch.exp(-entropy), max=epsilon)
    keep_top = scores >= scores.amax(dim=-1, keepdim=True)
    return scores.masked_fill((probs < cutoff) & ~keep_top, _NEG_INF)


@dataclass(frozen=True)
class NodeHistories:
    """What the history-reading processors see at each row (tree node): `recent`
    [N, W] the repetition penalty's window, `outputs` [N, G] the tokens generated so
    far and the node's path (presence and frequency), -1 padding in both; `allowed`
    [N, V] bool, the tokens a grammar allows after the node's path."""

    recent: torch.Tensor | None = None
    outputs: torch.Tensor | None = None
    allowed: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> "NodeHistories":
        return NodeHistories(*(None if t is None else t[start:stop] for t in (self.recent, self.outputs, self.allowed)))

    def select(self, rows: torch.Tensor) -> "NodeHistories":
        return NodeHistories(*(None if t is None else t[rows.to(t.device)]
                               for t in (self.recent, self.outputs, self.allowed)))


def _split(histories) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(recent, outputs, allowed) of what a caller passed: NodeHistories, or a recent-history tensor."""
    if isinstance(histories, NodeHistories):
        return histories.recent, histories.outputs, histories.allowed
    return histories, None, None


def apply_counts(scores: torch.Tensor, outputs: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """scores[i, t] -= frequency * c + presence * (c > 0), c the count of t in row i of
    `outputs` (-1 and ids outside the vocabulary ignored). In place; returns scores."""
    v = scores.shape[1]
    hist = outputs.to(device=scores.device, dtype=torch.long)
    valid = (hist >= 0) & (hist < v)
    counts = torch.zeros_like(scores).scatter_add_(1, torch.where(valid, hist, 0), valid.to(scores.dtype))
    return scores.sub_(frequency * counts + presence * (counts > 0).to(scores.dtype))


def _penalized(
    logits: torch.Tensor, histories, params: SamplingParams
) -> torch.Tensor:
    """The bias, the repetition penalty, the presence and frequency penalties, and a
    grammar's mask."""
    _check_logits(logits)
    if not params.adjusts_logits:
        return logits.to(_compute_dtype(logits), copy=True)
    recent, outputs, allowed = _split(histories)
    if params.constrained and (allowed is None or allowed.shape != logits.shape):
        raise ValueError(f"a constrained request needs each row's allowed tokens [{logits.shape[0]}, "
                         f"{logits.shape[1]}], got {None if allowed is None else tuple(allowed.shape)}")
    if params.uses_history:
        if recent is None:
            raise ValueError(f"penalty={params.penalty} needs per-row histories, got None")
        _check_histories(recent, logits.shape[0])
    if params.counts_outputs:
        if outputs is None:
            raise ValueError("presence_penalty / frequency_penalty need each row's generated tokens, got None")
        _check_histories(outputs, logits.shape[0])
    scores = logits.to(_compute_dtype(logits), copy=True)
    if params.logit_bias:
        tokens = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=scores.device)
        if int(tokens.max()) >= scores.shape[1]:
            raise ValueError(f"logit_bias names token {int(tokens.max())}, outside the vocabulary "
                             f"[0, {scores.shape[1]})")
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype, device=scores.device)
        scores[:, tokens] += bias
    if params.uses_history:
        scores = penalize(scores, _last_tokens(recent, params.penalty_window), params.penalty)
    if params.counts_outputs:
        scores = apply_counts(scores, outputs, params.presence_penalty, params.frequency_penalty)
    if params.constrained:
        scores.masked_fill_(~allowed.to(scores.device), float("-inf"))
    return scores


def processed_logits(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """Penalty, then temperature, top-k, top-p, min-p, typical, eta (transformers' order);
    removed tokens are -inf.

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
    if params.typical_p is not None and params.typical_p < 1.0:
        scores = _typical(scores, params.typical_p)
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
    or None where the PyTorch path runs: greedy, no truncation, a warper that reads the
    whole distribution, float64 (the exact tests' dtype), another device, or no native library."""
    truncates = bool(params.top_k) or (params.top_p is not None and params.top_p < 1.0) or bool(params.min_p)
    if params.is_greedy or not truncates or params.reads_whole_distribution:
        return None
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return native_ops()


def greedy_tokens(
    logits: torch.Tensor, histories: torch.Tensor | None, params: SamplingParams
) -> torch.Tensor:
    """Argmax after the bias and penalties (ties -> lowest index). Returns [N] int64."""
    if not params.adjusts_logits:
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
