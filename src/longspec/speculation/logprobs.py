"""Log-probabilities of the generated tokens, from the verification forward's own rows.

A token committed in a round was predicted by a node of the verified tree (the
accepted path's nodes predict the next path token; the last one predicts the bonus),
so its log-probability is read from that node's logits: the target's own distribution
at that point, the same numbers plain decoding sees. Two distributions, as vLLM's
`logprobs_mode` offers them: "raw" (the default, as OpenAI's API reports: log-softmax
of the model's logits) and "processed" (of the distribution the token is drawn from:
after the bias, penalties, temperature and truncation, removed tokens at -inf; for a
greedy request, after the bias and penalties). Asking for them makes the round
compute the full output layer for the committed tokens' rows (the certified head
decides without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longspec.speculation.processors import NodeHistories, SamplingParams, processed_logits

MAX_TOP = 20  # OpenAI's limit on top_logprobs
MODES = ("raw", "processed")


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `top` most likely tokens at that point, most likely first


@dataclass
class LogprobRecorder:
    """Collects the log-probabilities of a sequence's tokens as its rounds commit."""

    top: int = 0
    mode: str = "raw"
    entries: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.top, bool) or not isinstance(self.top, int) or not 0 <= self.top <= MAX_TOP:
            raise ValueError(f"top logprobs must be an int in [0, {MAX_TOP}], got {self.top!r}")
        if self.mode not in MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def processed(self) -> bool:
        return self.mode == "processed"

    def record(self, logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams | None = None,
               histories: NodeHistories | None = None) -> None:
        """`logits` [k, V]: the rows that predicted `tokens` [k]; in "processed" mode,
        `params` and those rows' `histories` give the processed distribution."""
        if not tokens.numel():
            return
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        if self.processed:
            logits = processed_logits(logits, histories, params)
        logprobs = torch.log_softmax(logits.to(compute), dim=-1)
        chosen = logprobs.gather(1, tokens.to(logprobs.device).view(-1, 1)).view(-1).tolist()
        if self.top:
            values, indices = torch.topk(logprobs, self.top, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [()] * tokens.numel()
        self.entries.extend(TokenLogprob(int(t), lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops))
