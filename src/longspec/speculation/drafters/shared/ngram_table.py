"""`NgramTable` counts every n-gram of the observed text and answers "which n-1
tokens most often followed token t?" (TokenSwift's token reutilization; the n-gram
drafter and TokenSwift's drafters use it).

Identity and ordering of table entries are kept in one place: per first token, a
dict maps the continuation (the n-gram's last n-1 tokens, a tuple) to its mutable
``[count, last_seen]`` record. An update touches exactly one record, found by its
key; the ranking is computed from the records at query time. No separate ordered
structure exists that could drift out of sync with the counts (the failure mode of
a frequency list whose sort key and equality disagree, where an update removes the
wrong entry and leaves a stale duplicate behind).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import torch

from longspec.runtime.device import HOST
from longspec.speculation.drafters.base import container_nbytes
from longspec.speculation.drafters.shared.checks import check_positive_int


def _as_token_list(tokens: torch.Tensor | Sequence[int]) -> list[int]:
    return torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()


class NgramTable:
    """Counts of every n-gram of a growing token stream.

    ``update(tokens)`` appends tokens to the stream; the table keeps the last n-1
    tokens so that n-grams straddling two updates are counted exactly once.
    ``last_seen`` of an n-gram is the stream position of the first token of its
    most recent occurrence (unique per n-gram, so rankings have no ties).

    Costs: ``update`` is O(c) dict operations for c new tokens; ``top_continuations``
    is O(m log k) for the m distinct n-grams starting with the queried token.
    """

    def __init__(self, n: int = 4) -> None:
        self.n = check_positive_int("n", n, 2)
        # first token -> {continuation (n-1 tuple) -> [count, last_seen]}
        self._table: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._tail: list[int] = []  # last n-1 tokens of the stream
        self._length = 0  # tokens seen so far
        self._distinct = 0

    @property
    def length(self) -> int:
        """Number of tokens observed so far."""
        return self._length

    @property
    def last_token(self) -> int | None:
        return self._tail[-1] if self._tail else None

    def __len__(self) -> int:
        """Number of distinct n-grams counted."""
        return self._distinct

    def update(self, tokens: torch.Tensor | Sequence[int]) -> None:
        new = _as_token_list(tokens)
        if not new:
            return
        n = self.n
        buf = self._tail + new
        offset = self._length - len(self._tail)  # stream position of buf[0]
        table = self._table
        for i in range(len(buf) - n + 1):
            first = buf[i]
            cont = tuple(buf[i + 1 : i + n])
            per_first = table.get(first)
            if per_first is None:
                per_first = table[first] = {}
            record = per_first.get(cont)
            if record is None:
                per_first[cont] = [1, offset + i]
                self._distinct += 1
            else:
                record[0] += 1
                record[1] = offset + i
        self._tail = buf[-(n - 1) :]
        self._length += len(new)

    def nbytes(self) -> int:
        """Bytes of the table (at most one record per distinct n-gram seen)."""
        return container_nbytes((self._table, self._tail))

    def count(self, ngram: Sequence[int]) -> int:
        ngram = tuple(int(t) for t in ngram)
        if len(ngram) != self.n:
            raise ValueError(f"ngram must have {self.n} tokens, got {len(ngram)}")
        record = self._table.get(ngram[0], {}).get(ngram[1:])
        return 0 if record is None else record[0]

    def items(self) -> Iterator[tuple[tuple[int, ...], int, int]]:
        """Every counted n-gram as ``(ngram, count, last_seen)`` (no fixed order)."""
        for first, per_first in self._table.items():
            for cont, (count, last_seen) in per_first.items():
                yield (first, *cont), count, last_seen

    def top_continuations(self, first_token: int, k: int) -> list[torch.Tensor]:
        """Up to ``k`` chains of n-1 tokens that followed ``first_token``, most
        frequent first, ties broken by most recent occurrence."""
        if k <= 0:
            return []
        per_first = self._table.get(int(first_token))
        if not per_first:
            return []
        best = heapq.nlargest(k, per_first.items(), key=lambda item: (item[1][0], item[1][1]))
        return [torch.tensor(cont, dtype=torch.long, device=HOST) for cont, _ in best]
