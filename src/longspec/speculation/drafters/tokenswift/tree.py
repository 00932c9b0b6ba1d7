"""TokenSwift's draft tree: a static Cartesian tree of the heads' top candidates
plus n-gram chains, merged without duplicate siblings and kept within the
engine's node budget.

Why merging suffices for unbiased tie-breaking: the deterministic-candidate
verifier draws ONE token y ~ p at each visited node and moves to the child
carrying y. With no two siblings carrying the same token, that child is unique, so
the accepted path is a function of the draws alone — exactly the tokens AR
sampling would have drawn — and "several equally long accepted paths" cannot
occur. (Even with duplicate siblings, choosing among them by any rule that does
not look at later draws leaves the output unchanged in distribution: the emitted
token is y either way, and the next draw conditions on the same token path.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longspec.runtime.device import HOST
from longspec.speculation.tree import Tree


def cartesian_within(root: int, candidates: Sequence[torch.Tensor], max_nodes: int) -> Tree:
    """The Cartesian tree of ``candidates`` (one tensor per depth), cut to the
    deepest prefix of depths whose node count fits ``max_nodes``."""
    kept, nodes, level = [], 0, 1
    for cands in candidates:
        level *= int(cands.numel())
        if nodes + level > max_nodes:
            break
        nodes += level
        kept.append(cands)
    return Tree.cartesian(root, kept) if kept else Tree.chain(root, [])


def add_chains_within(tree: Tree, chains: Sequence[Sequence[int]], max_nodes: int) -> Tree:
    """Merge ``chains`` (token lists hanging from the root) into ``tree``, reusing
    existing nodes with the same (parent, token), until ``max_nodes`` speculative
    nodes are used: the chain that would exceed it is cut there, later ones dropped."""
    child_of = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())) if i}
    used = tree.size - 1
    kept: list[list[int]] = []
    for chain in chains:
        node, prefix = 0, []
        for token in chain:
            token = int(token)
            child = child_of.get((node, token))
            if child is None:
                if used >= max_nodes:
                    break
                used += 1
                child = child_of[(node, token)] = -used  # new node (index resolved by with_chains)
            prefix.append(token)
            node = child
        if prefix:
            kept.append(prefix)
        if used >= max_nodes:
            break
    if not kept:
        return tree
    return tree.with_chains([torch.tensor(c, dtype=torch.long, device=HOST) for c in kept])
