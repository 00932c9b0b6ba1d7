"""Union of several drafters' trees rooted at the same token: a trie over their
root-to-node paths, each merged node remembering which drafters proposed it, at
which depth, as which sibling (its rank among its parent's children) and, for
copying drafters, the copied run it extends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from longspec.runtime.device import HOST
from longspec.speculation.copied_tree import CopiedTree, copied_runs
from longspec.speculation.tree import Tree


class Source(NamedTuple):  # a tuple: a round creates one per proposed node
    drafter: int  # index of the proposing drafter
    depth: int  # 1 = a child of the root
    rank: int  # 0 = the drafter's first candidate under that parent
    run: int = 0  # the copied run the node extends (`CopiedTree.copied_runs`); 0: the drafter does not copy


@dataclass
class MergedTree:
    tree: Tree
    sources: list[list[Source]]  # per merged node (the root's is empty)
    # The tree's arrays as lists: the controller reads them node by node.
    tokens: list[int]
    parents: list[int]
    depths: list[int]


def merge_trees(root: int, trees: Sequence[tuple[int, Tree]]) -> MergedTree:
    """Merge (drafter index, tree) pairs; equal paths become one node. Deterministic
    candidates only: the merged tree carries no draft probabilities."""
    if len(trees) == 1 and trees[0][1].draft_probs is None:
        single = _single_chain(*trees[0])
        if single is not None:
            return single
    tokens, parents, depths = [root], [-1], [0]
    sources: list[list[Source]] = [[]]
    index: dict[tuple[int, int], int] = {}
    for drafter, tree in trees:
        if tree.children_sampled:
            raise ValueError(f"drafter {drafter} sampled its children from q; only deterministic candidates can be "
                             "merged into one tree (docs/design.md#verification-precisely)")
        mapped = [0] * tree.size
        seen_children: dict[int, int] = {}
        tree_tokens, tree_parents = tree.tokens.tolist(), tree.parents.tolist()
        runs = copied_runs(tree).tolist() if isinstance(tree, CopiedTree) else [0] * tree.size
        for node in range(1, tree.size):
            parent = mapped[tree_parents[node]]
            rank = seen_children.get(tree_parents[node], 0)
            seen_children[tree_parents[node]] = rank + 1
            key = (parent, tree_tokens[node])
            merged = index.get(key)
            if merged is None:
                merged = len(tokens)
                index[key] = merged
                tokens.append(tree_tokens[node])
                parents.append(parent)
                depths.append(depths[parent] + 1)
                sources.append([])
            sources[merged].append(Source(drafter, depths[merged], rank, runs[node]))
            mapped[node] = merged
    return MergedTree(_tree(tokens, parents, depths), sources, tokens, parents, depths)


def _single_chain(drafter: int, tree: Tree) -> MergedTree | None:
    """One drafter's chain (a lookup's copy, the common round) merged with nothing: the
    tree as it is, None if it is not a chain."""
    if tree.children_sampled:
        return None  # merge_trees refuses it, naming the rule
    n = tree.size
    parents = tree.parents.tolist()
    if parents != list(range(-1, n - 1)):
        return None
    runs = copied_runs(tree).tolist() if isinstance(tree, CopiedTree) else [0] * n
    sources = [[]] + [[Source(drafter, depth, 0, runs[depth])] for depth in range(1, n)]
    return MergedTree(tree, sources, tree.tokens.tolist(), parents, list(range(n)))


def subtree(merged: MergedTree, keep: Sequence[int]) -> tuple[Tree, list[int]]:
    """The merged tree restricted to `keep` (node indices closed under parents).
    Returns it and the kept indices, in order (the root first, parents before
    children)."""
    keep = sorted(set(keep) | {0})
    if len(keep) == len(merged.tokens):  # every node: the merged tree itself
        return merged.tree, keep
    position = {node: i for i, node in enumerate(keep)}
    parents = [-1] + [position[merged.parents[node]] for node in keep[1:]]
    return _tree([merged.tokens[n] for n in keep], parents, [merged.depths[n] for n in keep]), keep


def _tree(tokens: list[int], parents: list[int], depths: list[int]) -> Tree:
    """A tree of lists consistent by construction (parents precede children, depths
    counted from them), as one tensor's rows."""
    arrays = torch.tensor([tokens, parents, depths], dtype=torch.long, device=HOST)
    return Tree.assembled(*arrays.unbind())
