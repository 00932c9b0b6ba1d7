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


class PromptScorer:
    """The log-probability of each prompt token after the first, under the model's own
    ("raw") distribution, as evaluation harnesses read them (`echo` with `logprobs`).

    The prompt runs through a cache of its own as the engine reads a prompt (prefill's
    products), a piece at a time (`step`), so that a server can interleave the pieces
    with other requests' rounds. A prompt within one piece gets exactly the numbers of
    one forward over it; a longer one, those of the same forward in pieces (attention
    over the pieces before it), equal to the last bits only where the kernels' rows do
    not depend on the piece. Logits exist a few rows at a time ([rows, V] for a whole
    prompt would take gigabytes)."""

    def __init__(self, model, ids: torch.Tensor, top: int = 0, piece: int = 1024) -> None:
        if ids.dim() != 1 or not ids.numel():
            raise ValueError("a prompt to score is a non-empty 1-D tensor of token ids")
        self.model, self.ids, self.piece = model, ids, piece
        self.recorder = LogprobRecorder(top=top, mode="raw")
        self.cache = model.new_cache(ids.numel(), max_forward_tokens=piece)
        self.scored = 0  # prompt positions run so far
        self._rows = max(1, (1 << 24) // model.config.vocab_size)  # logits rows at once: ~64 MB in float32

    @property
    def done(self) -> bool:
        return self.scored >= self.ids.numel() - 1

    @property
    def entries(self) -> list[TokenLogprob]:
        """Entries for prompt tokens 1.. (token 0 has no prediction)."""
        return self.recorder.entries

    @torch.inference_mode()
    def step(self) -> bool:
        """Run the next piece; True when every token is scored."""
        if self.done:
            return True
        begin = self.scored
        end = min(begin + self.piece, self.ids.numel() - 1)  # the last token predicts nothing asked for
        piece = self.ids[begin:end].unsqueeze(0)
        hidden = self.model(piece, self.cache, positions=self.cache.next_positions(end - begin), with_logits=False,
                            prefill=True).hidden[0]
        self.cache.commit()
        for row in range(0, end - begin, self._rows):
            rows = slice(row, min(row + self._rows, end - begin))
            self.recorder.record(self.model.logits(hidden[rows]), self.ids[begin + 1 + rows.start : begin + 1 + rows.stop])
        self.scored = end
        return self.done

    def run(self) -> list[TokenLogprob]:
        while not self.step():
            pass
        return self.entries
