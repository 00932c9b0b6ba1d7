"""Which request a vLLM batch row holds.

vLLM hands a custom proposer rows of token ids (`token_ids_cpu[i, :num_tokens[i]]`) and
the tokens each row committed this step, never request ids; a row can change hands
(a request finishes and another takes its slot) or move (vLLM condenses its batch).
A row's state is kept while the row still shows the same committed sequence (its
first tokens and the token where the state stopped); otherwise another row's state
that fits is taken over, or a fresh one is started. A wrong guess costs drafts only:
vLLM verifies every drafted token against its own model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

State = TypeVar("State")

# Tokens of a sequence kept as its identity: the prompt's start tells requests apart,
# and comparing it is one short memcmp per row and step.
PREFIX_TOKENS = 64


@dataclass
class Row(Generic[State]):
    prefix: np.ndarray  # the sequence's first tokens
    length: int  # committed tokens seen when the row was last proposed for
    last: int  # the token at length - 1
    state: State = field(default=None)

    def fits(self, tokens: np.ndarray) -> bool:
        """`tokens` (a row's committed sequence) continue the sequence this state saw."""
        n = len(self.prefix)
        return (0 < self.length <= len(tokens) and int(tokens[self.length - 1]) == self.last
                and np.array_equal(tokens[:n], self.prefix))


class RowStates(Generic[State]):
    """Per-row states of one proposer, made by `make` for each new sequence."""

    def __init__(self, make: Callable[[], State], ended: Callable[[State], None] | None = None) -> None:
        self.make = make
        self.ended = ended  # called with each state whose sequence left the batch (finished, or preempted)
        self.rows: dict[int, Row[State]] = {}
        self.displaced: list[Row[State]] = []  # states whose row another sequence took this step

    def claim(self, row: int, tokens: np.ndarray, claimed: set[int]) -> tuple[Row[State], bool]:
        """The state of the sequence `tokens` now in `row`, and whether it is new.
        `claimed`: the rows already handed out this step (a moved state is taken
        only from a row that is not)."""
        held = self.rows.pop(row, None)
        if held is not None and not held.fits(tokens):
            self.displaced.append(held)
            held = None
        if held is None:
            held = self._moved(row, tokens, claimed)
        fresh = held is None
        if fresh:
            held = Row(np.array(tokens[:PREFIX_TOKENS], copy=True), 0, -1, self.make())
        self.rows[row] = held
        claimed.add(row)
        return held, fresh

    def _moved(self, row: int, tokens: np.ndarray, claimed: set[int]) -> Row[State] | None:
        for i, candidate in enumerate(self.displaced):
            if candidate.fits(tokens):
                return self.displaced.pop(i)
        for other, candidate in self.rows.items():
            if other not in claimed and candidate.fits(tokens):
                return self.rows.pop(other)
        return None

    def seen(self, row: Row[State], tokens: np.ndarray) -> None:
        """The state has now seen all of `tokens`."""
        row.length, row.last = len(tokens), int(tokens[-1])

    def end_step(self, rows: int) -> None:
        """Forget the rows past the batch (vLLM's batch shrank) and the states no row took."""
        gone = [self.rows.pop(i) for i in [i for i in self.rows if i >= rows]] + self.displaced
        self.displaced = []
        if self.ended is not None:
            for row in gone:
                self.ended(row.state)
