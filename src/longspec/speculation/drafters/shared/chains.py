"""Trees from token chains: chains merged below one root (shared prefixes become one
path, no duplicate siblings), cut to a node budget. Used by the drafters that
propose continuations (n-grams, prompt lookup) and by composing drafters."""

from __future__ import annotations

from collections.abc import Sequence
import torch

from longspec.runtime.device import HOST
from longspec.speculation.copied_tree import CopiedTree
from longspec.speculation.tree import Tree


def trim_chains(chains: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Truncate ``chains`` so that merging them below one root (sharing common
    prefixes, as `Tree.with_chains` does) creates at most ``budget`` nodes.

    Chains are taken in order; the one that exhausts the budget is cut at that
    point and the chains after it are dropped.
    """
    out: list[list[int]] = []
    seen: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    used = 0
    for chain in chains:
        if used >= budget:
            break
        node, kept = 0, []
        for token in chain:
            token = int(token)
            key = (node, token)
            child = seen.get(key)
            if child is None:
                if used >= budget:
                    break
                used += 1
                child = seen[key] = used
            kept.append(token)
            node = child
        if kept:
            out.append(kept)
    return out


def chains_tree(root: int, chains: Sequence[Sequence[int]], max_nodes: int,
                runs: Sequence[int] | None = None) -> Tree:
    """A tree of ``chains`` merged below ``root`` (no duplicate siblings), with at
    most ``max_nodes`` speculative nodes; root-only when nothing is left. ``runs``
    (copying drafters): per chain, the copied run its first token extends; the tree's
    `CopiedTree.copied_runs` then give each node the longest run among the chains through it."""
    if runs is not None:
        if len(runs) != len(chains):
            raise ValueError(f"one run per chain: {len(runs)} runs for {len(chains)} chains")
        runs = [run for chain, run in zip(chains, runs) if len(chain)]  # trimming drops empty chains
    trimmed = trim_chains(chains, max(int(max_nodes), 0))
    if not trimmed:
        return Tree.chain(root, [])
    if len(trimmed) == 1:
        if runs is None:
            return Tree.chain(root, trimmed[0])
        return CopiedTree.of(Tree.chain(root, trimmed[0]), [0, *(int(runs[0]) + depth for depth in range(len(trimmed[0])))])
    tree = Tree.chain(root, []).with_chains([torch.tensor(c, dtype=torch.long, device=HOST) for c in trimmed])
    if runs is None:
        return tree
    node_runs = [0] * tree.size
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())) if i}
    for chain, run in zip(trimmed, runs):  # trimming keeps the chains' order and drops only a tail
        node = 0
        for depth, token in enumerate(chain):
            node = child_of[(node, token)]
            node_runs[node] = max(node_runs[node], int(run) + depth)
    return CopiedTree.of(tree, node_runs)
