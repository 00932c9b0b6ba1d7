"""The `logprobs` fields of OpenAI's responses, from the recorded log-probabilities
(`speculation/logprobs.py`).

Completions list tokens, their log-probabilities, each position's most likely tokens
(a dict by token text, so tokens that read alike share a key; it includes the chosen one) and each token's character offset in the
completion; chat lists one object per token with its UTF-8 bytes and its most likely
alternatives. Streamed responses carry the entries of each chunk's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from longspec.speculation.logprobs import TokenLogprob

TokenStrings = Callable[[Sequence[int]], list[str]]
FLOOR = -9999.0  # what JSON shows for -inf (a token the processed distribution removed), as vLLM does


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


class CompletionLogprobs:
    """One completion's `logprobs` objects, chunk by chunk (offsets run on across chunks)."""

    def __init__(self, token_strings: TokenStrings) -> None:
        self.token_strings = token_strings
        self.offset = 0

    def fields(self, entries: Sequence[TokenLogprob]) -> dict:
        strings = self.token_strings([e.token for e in entries] + [t for e in entries for t, _ in e.top])
        chosen, alternatives = strings[: len(entries)], iter(strings[len(entries) :])
        tops, offsets = [], []
        for entry, text in zip(entries, chosen):
            top: dict[str, float] = {}
            for _, logprob in entry.top:  # tokens that read alike share a key: the likelier one's
                top.setdefault(next(alternatives), _finite(logprob))
            top.setdefault(text, _finite(entry.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": chosen, "token_logprobs": [_finite(e.logprob) for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def prompt_fields(self, first_token: int, entries: Sequence[TokenLogprob]) -> dict:
        """An echoed prompt's fields: its first token has no log-probability (null, as
        OpenAI writes it), the others are `entries`."""
        first = self.token_strings([first_token])[0]
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(first)
        return joined(head, self.fields(entries))


def joined(*parts: dict) -> dict:
    """Completion `logprobs` objects one after the other (an echoed prompt, then its completion)."""
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def chat_logprobs(entries: Sequence[TokenLogprob], token_strings: TokenStrings) -> dict:
    strings = token_strings([e.token for e in entries] + [t for e in entries for t, _ in e.top])
    alternatives = iter(strings[len(entries) :])

    def item(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = [{**item(text, entry.logprob), "top_logprobs": [item(next(alternatives), lp) for _, lp in entry.top]}
               for entry, text in zip(entries, strings)]
    return {"content": content, "refusal": None}
