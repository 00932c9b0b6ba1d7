"""Rounds a drafter leaves to plain decoding (its optional `plain_rounds()`, see
drafters/base.py): an engine decodes them as autoregressive decoding does, without a
draft context, a tree check, `propose` or `observe`, then tells the drafter of them
all at once: their tokens, and the target's states of their roots
(`TargetView.last_hidden`, one row a round). Where a decode step is short (a GPU's),
what a round through a drafter costs the host is then paid once for them all; in a
batch, once per row for them all."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.base import Drafter, TargetView


def checked_plain_rounds(drafter: Drafter, plain_rounds) -> int:
    """The drafter's `plain_rounds()`, which must be a count."""
    rounds = plain_rounds()
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"drafter {type(drafter).__name__}.plain_rounds() returned {rounds!r}; "
                         "it must return how many coming rounds to leave to plain decoding (an int >= 0)")
    return rounds


class PlainRounds:
    """One sequence's plain rounds: whether the next round is one, and what the drafter
    is told after each round. A sequence that ends among plain rounds tells the drafter
    all of them but the last round, as a sequence told round by round never hears of
    its last round."""

    def __init__(self, drafter: Drafter | None, enabled: bool = True) -> None:
        self.drafter = drafter
        self._ask = drafter.plain_rounds if enabled and drafter is not None else None
        self.left = 0  # plain rounds still to decode, this one included
        self._tokens: list[torch.Tensor] = []
        self._hidden: list[torch.Tensor] = []

    def now(self) -> bool:
        """Whether the coming round is plain decoding (without a drafter, always)."""
        if self._ask is not None and not self.left:
            self.left = checked_plain_rounds(self.drafter, self._ask)
        return self.drafter is None or self.left > 0

    def told(self, new: torch.Tensor, stop_reason: str, view: TargetView) -> torch.Tensor | None:
        """After a round that committed `new` (its root's states already in
        `view.last_hidden`): the tokens to tell the drafter now, `view.last_hidden`
        then holding their roots' states; None when it is told nothing now."""
        if self.drafter is None:
            return None
        if not self.left:
            return None if stop_reason else new
        if not stop_reason:
            self._tokens.append(new)
            self._hidden.append(view.last_hidden)
        self.left -= 1
        if not self._tokens or (self.left and not stop_reason):
            return None
        view.last_hidden, tokens = torch.cat(self._hidden), torch.cat(self._tokens)
        self._tokens, self._hidden = [], []
        return tokens
