"""One node budget for the rows of a batched verification forward, chosen jointly.

Every row's tree is verified in one forward, so a row's nodes are paid for at the
batch's width: past the machine's compute knee a forward costs in proportion to its
total node count, and a deep level of one row's tree can cost more than it returns
while a shallow level of another row's is nearly free tokens. So the depths of all
rows' trees are chosen together: each row's levels are ranked by expected accepted
tokens per verified node, across rows, and the batch keeps the prefix of that ranking
that maximises expected tokens per second of the forward (the measured `ForwardCost`
of that many tokens).

A level's expected tokens come from the row's own history (`ReachHistory`), including
what the committed tokens say of the levels that were cut. Its acceptance is kept by
depth or, for a tree copied from earlier text (prompt lookup), by the copied run its
nodes extend (`CopiedTree.copied_runs`, `tree_levels`): a copy that has matched for 30 tokens
keeps matching, one that matched for 2 rarely does, whatever the depth. Cutting a tree below a depth
is lossless — the verifiers check whatever tree they are given — and the accepted path
stays inside the tree the drafter proposed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.tree import Tree


@dataclass(frozen=True)
class ReachPrior:
    """Beta prior on the chance that a level is accepted once the level above it was:
    `accepted` successes in `rounds` pseudo-rounds. The default (2 in 3) is optimistic
    enough that a new row's first levels are tried; a row's history outweighs it
    after a few rounds."""

    accepted: float = 2.0
    rounds: float = 3.0

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.rounds or self.rounds <= 0:
            raise ValueError(f"need 0 <= accepted <= rounds and rounds > 0, got {self.accepted}, {self.rounds}")


# Copied runs longer than this share the last level (acceptance no longer changes with the run).
MAX_LEVEL = 32


def tree_levels(tree: Tree) -> list[int]:
    """The level of each of the tree's depths 1..max_depth: the depth itself or, when the
    drafter copied the tree (`copied_runs`), the longest copied run among its nodes at
    that depth (at most `MAX_LEVEL`)."""
    if tree.max_depth == 0:
        return []
    if not isinstance(tree, CopiedTree):
        return list(range(1, tree.max_depth + 1))
    runs = torch.zeros(tree.max_depth + 1, dtype=torch.long).scatter_reduce(0, tree.depths, tree.copied_runs, "amax")
    return runs[1:].clamp(1, MAX_LEVEL).tolist()


class ReachHistory:
    """A row's acceptance by level (`tree_levels`), including the levels a joint budget cut.

    Kept as conditional counts: of the rounds whose tree reached the depth before a
    level's and held a node at that level, how many accepted it. A level that was cut is judged by the
    committed tokens: when every verified level was accepted, the bonus token is what
    the target chose below them (under greedy exactly what verifying the cut child
    would have accepted; under sampling a draw from p, as the tree verifier's), and the
    tokens committed in the next rounds judge the cut levels below it, so the budget
    can grow back. A request is short next to what a drafter's acceptance
    takes to learn, so a row's estimates lean on the history of every row of the same
    drafter (`conditionals(prior=...)`)."""

    def __init__(self, prior: ReachPrior = ReachPrior()) -> None:
        self.prior = prior
        self.tried: list[int] = []  # [level - 1]: rounds in which the level's outcome was seen
        self.accepted: list[int] = []
        # A cut tree still matching the committed tokens: (tree, its levels, node reached, its depth).
        self._walk: tuple[Tree, list[int], int, int] | None = None

    def record(self, proposed: Tree, verified_depth: int, committed: Sequence[int]) -> list[tuple[int, bool]]:
        """One round: the drafter's whole tree, the depth verified after cutting, and
        the tokens committed (accepted nodes, then the bonus). Returns the outcomes
        learned, (level - 1, accepted) each, for a pooled history to `add`."""
        outcomes = self._follow(committed)
        depth = proposed.max_depth
        if depth:
            levels = tree_levels(proposed)
            reached, node = walk_down(proposed, 0, committed)
            if reached <= verified_depth:  # every level's outcome is known
                outcomes += [(levels[d] - 1, d < reached) for d in range(min(depth, reached + 1))]
            else:  # the committed tokens walked below the cut: follow the rest next round
                outcomes += [(levels[d] - 1, True) for d in range(reached)]
                self._walk = (proposed, levels, node, reached)
        self.add(outcomes)
        return outcomes

    def add(self, outcomes: Sequence[tuple[int, bool]]) -> None:
        for d, accepted in outcomes:
            while d >= len(self.tried):
                self.tried.append(0)
                self.accepted.append(0)
            self.tried[d] += 1
            self.accepted[d] += accepted

    def _follow(self, committed: Sequence[int]) -> list[tuple[int, bool]]:
        """Judge the cut levels of an earlier tree by the tokens committed since."""
        if self._walk is None:
            return []
        tree, levels, node, depth = self._walk
        self._walk = None
        below, child = walk_down(tree, node, committed)
        outcomes = [(levels[depth + d] - 1, True) for d in range(below)]
        if below < len(committed) and bool((tree.parents == child).any()):
            outcomes.append((levels[depth + below] - 1, False))  # the next token left the tree
        elif below == len(committed) and bool((tree.parents == child).any()):
            self._walk = (tree, levels, child, depth + below)  # still inside: keep following
        return outcomes

    def conditionals(self, levels: Sequence[int], prior: Sequence[float] | None = None) -> list[float]:
        """P(accepted | the depth above accepted) for each of a tree's `levels`
        (`tree_levels`): posterior means, the prior's mean for levels[i] being
        `prior[i]` (e.g. what every row of the same drafter measured) or, without one,
        `self.prior`'s, weighing `self.prior.rounds` rounds."""
        out = []
        for i, level in enumerate(levels):
            tried = self.tried[level - 1] if level <= len(self.tried) else 0
            hits = self.accepted[level - 1] if level <= len(self.accepted) else 0
            mean = prior[i] if prior is not None else self.prior.accepted / self.prior.rounds
            out.append((hits + mean * self.prior.rounds) / (tried + self.prior.rounds))
        return out

    def reach(self, levels: Sequence[int], prior: Sequence[float] | None = None) -> list[float]:
        """P(each depth is accepted) for a tree's `levels`: products of the conditionals
        (non-increasing with depth)."""
        out, product = [], 1.0
        for conditional in self.conditionals(levels, prior):
            product *= conditional
            out.append(product)
        return out


def walk_down(tree: Tree, node: int, tokens: Sequence[int]) -> tuple[int, int]:
    """How many of `tokens` walk down the tree from `node`, and the node they reach."""
    depth = 0
    parents, values = tree.parents, tree.tokens
    for token in tokens:
        child = torch.nonzero((parents == node) & (values == int(token))).flatten()
        if child.numel() == 0:
            break
        node, depth = int(child[0]), depth + 1
    return depth, node


def level_sizes(tree: Tree) -> list[int]:
    """Speculative nodes at depths 1..max_depth."""
    return torch.bincount(tree.depths, minlength=tree.max_depth + 1)[1:].tolist()


def joint_depths(trees: Sequence[Tree], reach: Sequence[Sequence[float]], seconds: Callable[[float], float],
                 fixed: Sequence[bool] = ()) -> list[int]:
    """The depth to keep of each row's tree so that expected accepted tokens (bonus
    included) per second of the shared forward is largest. `reach[b][d - 1]`: row b's
    chance of accepting depth d; `seconds(n)`: the forward's cost with n tokens in all;
    `fixed[b]`: row b's tree is kept whole (its drafter sized it from the cost itself),
    its nodes still counted in the forward."""
    fixed = list(fixed) or [False] * len(trees)
    depths = [tree.max_depth if keep else 0 for tree, keep in zip(trees, fixed)]
    sizes = [level_sizes(tree) for tree in trees]
    tokens = sum(1 + sum(size[:depth]) for size, depth in zip(sizes, depths))
    expected = sum(1 + sum(r[:depth]) for r, depth in zip(reach, depths))
    best_rate, best = expected / seconds(tokens), list(depths)
    # Each row offers its next level; the best tokens per node goes next.
    offers = [(-reach[b][0] / sizes[b][0], b) for b in range(len(trees)) if not fixed[b] and sizes[b]]
    heapq.heapify(offers)
    while offers:
        _, b = heapq.heappop(offers)
        d = depths[b]
        tokens += sizes[b][d]
        expected += reach[b][d]
        depths[b] = d + 1
        rate = expected / seconds(tokens)
        if rate > best_rate:
            best_rate, best = rate, list(depths)
        if depths[b] < len(sizes[b]):
            heapq.heappush(offers, (-reach[b][d + 1] / sizes[b][d + 1], b))
    return best


def cut_to_depth(tree: Tree, depth: int) -> Tree:
    """The tree's nodes at depth <= `depth`."""
    if depth >= tree.max_depth:
        return tree
    return tree.restricted(torch.nonzero(tree.depths <= depth).flatten())
