"""The verdict on proposed nodes that a round did not verify, read off the tokens the
sequence commits afterwards.

A node is accepted exactly when its token is the one the target commits at its depth,
given that its parent was: under greedy decoding that token is the target's argmax,
and under sampling it is one draw from the target's distribution p whichever tree was
verified (verification is lossless), so "the committed token equals the node's" has
probability p(node), the node's acceptance probability under the one-draw rule. The
committed continuation therefore measures every proposed node — also those `auto`
left out of the verified tree and those of rounds with speculation off — without a
forward. Without it, only verified nodes are ever measured: a depth the controller
stopped verifying after a few unlucky rounds keeps its low rate for good (censoring),
and a controller that switched speculation off learns nothing until a probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UnverifiedNodes:
    """One round's proposed tree and the nodes of it still waiting for a verdict."""

    tokens: list[int]  # per tree node (0 = the round's root)
    parents: list[int]
    depths: list[int]
    pending: list[int]  # unverified nodes not yet decided
    continuation: list[int] = field(default_factory=list)  # tokens committed after the root so far

    def resolve(self, committed: list[int]) -> list[tuple[int, bool]]:
        """Take the tokens a round committed; (node, accepted) for each pending node
        whose depth they reach and whose parent is on the committed path (a node below
        a rejected parent is never tested, as in verification). Decided nodes leave
        `pending`."""
        self.continuation.extend(committed)
        known = len(self.continuation)
        decided, waiting = [], []
        for node in self.pending:
            depth = self.depths[node]
            if depth > known:
                waiting.append(node)
            elif self._on_path(self.parents[node]):
                decided.append((node, self.tokens[node] == self.continuation[depth - 1]))
        self.pending = waiting
        return decided

    def _on_path(self, node: int) -> bool:
        """The root, or a node whose every token down from the root was committed."""
        while node > 0:
            if self.tokens[node] != self.continuation[self.depths[node] - 1]:
                return False
            node = self.parents[node]
        return True
