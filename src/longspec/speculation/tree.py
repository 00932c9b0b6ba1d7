"""Speculation trees: node tokens, parent index per node, depth per node.

Node 0 is always the root: the last committed token, whose K/V is not yet in the
target cache. Nodes 1..n-1 are speculative; ``parents[i] < i`` (topological order),
so a chain is simply ``parents = [-1, 0, 1, 2, ...]``. Everything else (RoPE
positions, the ancestor mask, root-to-node paths) is derived from these arrays with
loops over depth at most, never over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [n] int64, tokens[0] is the root token
    parents: torch.Tensor  # [n] int64, parents[0] == -1
    depths: torch.Tensor  # [n] int64, depths[0] == 0
    # Optional drafter distribution per node: draft_probs[i] is the distribution q
    # the drafter sampled node i's children from (rows of leaves are unused).
    draft_probs: torch.Tensor | None = None
    # True when children were *sampled* from draft_probs (multi-draft rejection
    # applies); False when they are deterministic candidates (top-k, beams, n-grams).
    children_sampled: bool = False

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if n < 1:
            raise ValueError("a tree needs at least its root node")
        if self.parents.shape != (n,) or self.depths.shape != (n,):
            raise ValueError("tokens, parents and depths must be 1-D of the same length")
        _check_parents(self.parents)
        if self.children_sampled and self.draft_probs is None:
            raise ValueError("a tree with sampled children must carry draft_probs")

    # ------------------------------------------------------------------ builders
    @staticmethod
    def from_parents(tokens: torch.Tensor, parents: torch.Tensor, **kwargs) -> "Tree":
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long)
        _check_parents(parents)  # before walking them: a cycle would never end
        return Tree(tokens, parents, _depths_from_parents(parents), **kwargs)

    @staticmethod
    def chain(root: int, tokens: torch.Tensor | list[int], **kwargs) -> "Tree":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = tokens.numel() + 1
        all_tokens = torch.cat([torch.tensor([root], dtype=torch.long), tokens])
        parents = torch.arange(-1, n - 1, dtype=torch.long)
        return Tree(all_tokens, parents, torch.arange(n, dtype=torch.long), **kwargs)

    @staticmethod
    def cartesian(root: int, candidates_per_depth: list[torch.Tensor]) -> "Tree":
        """Every node at depth d gets the same candidates_per_depth[d] children
        (TokenSwift's static [1,3,3,3] tree is ``[top1, top3, top3, top3]``)."""
        tokens = [torch.tensor([root], dtype=torch.long)]
        parents = [torch.tensor([-1], dtype=torch.long)]
        level = torch.tensor([0], dtype=torch.long)  # node indices of the previous depth
        next_index = 1
        for cands in candidates_per_depth:
            cands = torch.as_tensor(cands, dtype=torch.long).reshape(-1)
            k = cands.numel()
            level_parents = level.repeat_interleave(k)
            tokens.append(cands.repeat(level.numel()))
            parents.append(level_parents)
            level = torch.arange(next_index, next_index + level_parents.numel(), dtype=torch.long)
            next_index += level_parents.numel()
        return Tree.from_parents(torch.cat(tokens), torch.cat(parents))

    def with_chains(self, chains: list[torch.Tensor]) -> "Tree":
        """Append token chains below the root, reusing existing nodes that already
        spell a chain's prefix so that no two siblings carry the same token.

        Only for trees of deterministic candidates (merging sampled children would
        change the distribution they were drawn from)."""
        if self.children_sampled:
            raise ValueError("cannot merge extra chains into a tree of sampled children")
        tokens = self.tokens.tolist()
        parents = self.parents.tolist()
        child_of: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
        for chain in chains:
            node = 0
            for token in torch.as_tensor(chain, dtype=torch.long).tolist():
                key = (node, token)
                if key not in child_of:
                    child_of[key] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child_of[key]
        draft_probs = None
        if self.draft_probs is not None:
            extra = len(tokens) - self.size
            pad = self.draft_probs.new_zeros((extra, self.draft_probs.shape[1]))
            draft_probs = torch.cat([self.draft_probs, pad])
        return Tree.from_parents(torch.tensor(tokens), torch.tensor(parents), draft_probs=draft_probs)

    # --------------------------------------------------------------- derived views
    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(-1, self.size - 1)).all())

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] is True when j is i itself or one of its ancestors."""
        n = self.size
        mask = torch.zeros((n, n), dtype=torch.bool)
        rows = torch.arange(n)
        pointer = rows.clone()
        parents = self.parents.clamp(min=0)
        for _ in range(self.max_depth + 1):
            mask[rows, pointer] = True
            pointer = parents[pointer]
        return mask

    def path_to(self, node: int) -> torch.Tensor:
        """Node indices from the root to ``node`` inclusive."""
        depth = int(self.depths[node])
        path = torch.empty(depth + 1, dtype=torch.long)
        for d in range(depth, -1, -1):
            path[d] = node
            node = int(self.parents[node])
        return path

    def children(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()


def _check_parents(parents: torch.Tensor) -> None:
    n = parents.numel()
    if n < 1 or int(parents[0]) != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    if n > 1 and bool(((parents[1:] >= torch.arange(1, n)) | (parents[1:] < 0)).any()):
        raise ValueError("parents must precede their children (0 <= parents[i] < i)")


def _depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    depths = torch.zeros(n, dtype=torch.long)
    pointer = parents.clone()
    alive = pointer >= 0
    while bool(alive.any()):
        depths += alive.long()
        pointer = torch.where(alive, parents[pointer.clamp(min=0)], pointer)
        alive = pointer >= 0
    return depths
