"""Trees copied from earlier text (prompt lookup, n-grams), with what the copy says of
each node: the length of the copied run it extends (the tokens up to and including its
parent that equal the tokens before its source). A copy that has matched for 30 tokens
keeps matching far more often than one that matched for 2, so a controller (`auto`)
and the batched joint budget read it as evidence of acceptance. The verifiers see an
ordinary `Tree`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longspec.runtime.device import HOST
from longspec.speculation.tree import MalformedTreeError, Tree


@dataclass(frozen=True)
class CopiedTree(Tree):
    copied_runs: torch.Tensor | None = None  # [n] int64 on the host; required (a default only for field order)

    def _optional_problem(self) -> str | None:
        runs = self.copied_runs
        if (not isinstance(runs, torch.Tensor) or runs.dtype != torch.long or runs.shape != self.tokens.shape
                or runs.device != HOST):
            return f"copied_runs must be a host int64 tensor of one value per node ({self.size}), got {runs!r}"
        return super()._optional_problem()

    @classmethod
    def of(cls, tree: Tree, runs: torch.Tensor | list[int]) -> "CopiedTree":
        """`tree` with one copied run per node (0 at the root)."""
        if not isinstance(runs, torch.Tensor):
            runs = torch.tensor(runs, dtype=torch.long, device=HOST)
        # `tree` was checked when it was built: only the runs are checked here (a drafter
        # builds a tree every round; the engine checks every invariant once, `checked_proposal`).
        copied = object.__new__(cls)
        for name, value in vars(tree).items():
            object.__setattr__(copied, name, value)
        object.__setattr__(copied, "copied_runs", runs)
        problem = copied._optional_problem()
        if problem:
            raise MalformedTreeError(problem)
        return copied


    def restricted(self, keep: torch.Tensor) -> "CopiedTree":
        return CopiedTree.of(super().restricted(keep), self.copied_runs[keep])


def copied_runs(tree: Tree) -> torch.Tensor | None:
    """The tree's copied runs, or None when its drafter does not copy."""
    return tree.copied_runs if isinstance(tree, CopiedTree) else None
