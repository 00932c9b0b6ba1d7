"""Speculation trees: node tokens, parent index per node, depth per node.

Node 0 is always the root: the last committed token, whose K/V is not yet in the
target cache. Nodes 1..n-1 are speculative; ``parents[i] < i`` (topological order),
so a chain is simply ``parents = [-1, 0, 1, 2, ...]``. Everything else (RoPE
positions, the ancestor mask, root-to-node paths) is derived from these arrays with
loops over depth at most, never over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from longspec.runtime.device import HOST


class MalformedTreeError(ValueError):
    """A tree breaks one of its invariants; the message names the node and the rule."""


# How far a row of draft probabilities may sum from 1 and still count as normalised:
# float64 rows are normalised to rounding; lower precisions accumulate more error.
_ROW_SUM_TOLERANCE = {torch.float64: 1e-9}
_ROW_SUM_TOLERANCE_DEFAULT = 1e-3


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
        problem = self.structure_problem()
        if problem:
            raise MalformedTreeError(problem)

    # ---------------------------------------------------------------- validation
    def structure_problem(self) -> str | None:
        """The first broken structural invariant, or None. Vectorised: no loop over nodes."""
        tokens, parents, depths = self.tokens, self.parents, self.depths
        for name, array in (("tokens", tokens), ("parents", parents), ("depths", depths)):
            if not isinstance(array, torch.Tensor) or array.dtype != torch.long or array.ndim != 1:
                return f"{name} must be a 1-D int64 tensor"
            if array.device != HOST:
                return f"{name} must be on the host (CPU), got {array.device}: build trees with Tree.from_parents/chain"
        n = tokens.numel()
        if n < 1:
            return "a tree needs at least its root node"
        if parents.numel() != n or depths.numel() != n:
            return f"tokens, parents and depths must have the same length (got {n}, {parents.numel()}, {depths.numel()})"
        if n == 1:  # the root alone (plain decoding): every round of a drafter that found nothing
            parent, depth = parents.tolist(), depths.tolist()
        else:
            # NumPy views of the host tensors: on trees of a few dozen nodes its operations
            # cost a fraction of PyTorch's, and every round validates at least one tree
            # (docs/lab-notes/auto-controller.md#what-changed).
            parent, depth = parents.numpy(), depths.numpy()
        if parent[0] != -1 or depth[0] != 0:
            return f"node 0 must be the root (parent -1, depth 0), got parent {int(parent[0])}, depth {int(depth[0])}"
        if n == 1:
            return self._optional_problem()
        problem = _parents_problem(parent)
        if problem:
            return problem
        wrong_depth = _first_index(depth[1:] != depth[parent[1:]] + 1)
        if wrong_depth is not None:
            i = wrong_depth + 1
            return (f"node {i} has depth {int(depth[i])} but its parent {int(parent[i])} has depth "
                    f"{int(depth[parent[i]])} (a node's depth is its parent's + 1)")
        return self._optional_problem()

    def _optional_problem(self) -> str | None:
        """The first broken rule of the optional fields' shapes, or None."""
        if self.children_sampled and self.draft_probs is None:
            return "a tree with sampled children must carry draft_probs"
        return None

    def problem(self, vocab_size: int) -> str | None:
        """Every invariant the verifiers rely on, for a target of `vocab_size` tokens:
        the structure, token ids in range, and draft probabilities (when present) as one
        row per node over the vocabulary, finite and non-negative, each row either
        normalised or all zero (unused), with every sampled child's token having q > 0
        under its parent's row. Returns the first broken rule, or None."""
        problem = self.structure_problem()
        if problem:
            return problem
        if self.size == 1:
            bad_token = None if 0 <= self.tokens.tolist()[0] < vocab_size else 0
        else:
            tokens = self.tokens.numpy()
            bad_token = _first_index((tokens < 0) | (tokens >= vocab_size))
        if bad_token is not None:
            return f"node {bad_token} carries token {int(self.tokens[bad_token])}, outside the vocabulary [0, {vocab_size})"
        q = self.draft_probs
        if q is None:
            return None
        if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.shape != (self.size, vocab_size):
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            return f"draft_probs must be a float tensor of shape [nodes, vocabulary] = [{self.size}, {vocab_size}], got {shape}"
        # Two passes over [n, V]: a NaN or infinity makes its row's sum non-finite.
        sums = q.sum(dim=1, dtype=torch.float64)
        bad_row = _first(~torch.isfinite(sums) | (q.amin(dim=1) < 0))
        if bad_row is not None:
            return f"node {bad_row}: draft_probs row has negative or non-finite entries"
        tolerance = _ROW_SUM_TOLERANCE.get(q.dtype, _ROW_SUM_TOLERANCE_DEFAULT)
        bad_row = _first(((sums - 1).abs() > tolerance) & (sums != 0))
        if bad_row is not None:
            return f"node {bad_row}: draft_probs row sums to {float(sums[bad_row]):.6g}, not 1 (nor 0 for an unused row)"
        if self.children_sampled and self.size > 1:
            child_q = q[self.parents[1:].to(q.device), self.tokens[1:].to(q.device)]
            bad_child = _first(child_q <= 0)
            if bad_child is not None:
                i = bad_child + 1
                return (f"node {i} was sampled from its parent {int(self.parents[i])}'s draft distribution but carries "
                        f"token {int(self.tokens[i])}, which that distribution gives probability 0")
        return None

    def check(self, vocab_size: int) -> None:
        """Raise MalformedTreeError naming the first broken invariant (see `problem`)."""
        problem = self.problem(vocab_size)
        if problem:
            raise MalformedTreeError(problem)

    # ------------------------------------------------------------------ builders
    @staticmethod
    def from_parents(tokens: torch.Tensor, parents: torch.Tensor, **kwargs) -> "Tree":
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=HOST)
        parents = torch.as_tensor(parents, dtype=torch.long, device=HOST)
        problem = _parents_problem(parents.numpy()) if parents.ndim == 1 else "parents must be a 1-D tensor"
        if problem:  # before walking them: a cycle would never end
            raise MalformedTreeError(problem)
        return Tree(tokens, parents, _depths_from_parents(parents), **kwargs)

    @staticmethod
    def chain(root: int, tokens: torch.Tensor | list[int], **kwargs) -> "Tree":
        if isinstance(tokens, list):  # one tensor of the three arrays (every plain decoding round builds a chain)
            n = len(tokens) + 1
            arrays = torch.tensor([[root, *tokens], range(-1, n - 1), range(n)], dtype=torch.long, device=HOST)
            return Tree.assembled(*arrays.unbind(), **kwargs)
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=HOST).reshape(-1)
        all_tokens = torch.cat([torch.tensor([root], dtype=torch.long, device=HOST), tokens])
        n = all_tokens.numel()
        parents = torch.arange(-1, n - 1, dtype=torch.long, device=HOST)
        return Tree.assembled(all_tokens, parents, torch.arange(n, dtype=torch.long, device=HOST), **kwargs)

    @staticmethod
    def assembled(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, **optional) -> "Tree":
        """A tree from arrays its builder made consistent by construction: 1-D host
        int64 of one length, the root first, parents before their children, depths
        counted from them. Only the optional fields are checked here: the engine checks
        every invariant of a drafter's tree once before the target sees it
        (`checked_proposal`), and a second check of the same arrays is paid for several
        trees a round (the `auto` controller builds four;
        docs/lab-notes/auto-controller.md#what-changed)."""
        tree = object.__new__(Tree)
        values = {**_OPTIONAL_DEFAULTS, **optional, "tokens": tokens, "parents": parents, "depths": depths}
        for name, value in values.items():
            object.__setattr__(tree, name, value)
        problem = tree._optional_problem()
        if problem:
            raise MalformedTreeError(problem)
        return tree

    @staticmethod
    def cartesian(root: int, candidates_per_depth: list[torch.Tensor]) -> "Tree":
        """Every node at depth d gets the same candidates_per_depth[d] children
        (TokenSwift's static [1,3,3,3] tree is ``[top1, top3, top3, top3]``)."""
        tokens = [torch.tensor([root], dtype=torch.long, device=HOST)]
        parents = [torch.tensor([-1], dtype=torch.long, device=HOST)]
        level = torch.tensor([0], dtype=torch.long, device=HOST)  # node indices of the previous depth
        next_index = 1
        for cands in candidates_per_depth:
            cands = torch.as_tensor(cands, dtype=torch.long, device=HOST).reshape(-1)
            k = cands.numel()
            level_parents = level.repeat_interleave(k)
            tokens.append(cands.repeat(level.numel()))
            parents.append(level_parents)
            level = torch.arange(next_index, next_index + level_parents.numel(), dtype=torch.long, device=HOST)
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
            for token in torch.as_tensor(chain, dtype=torch.long, device=HOST).tolist():
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
        return Tree.from_parents(tokens, parents, draft_probs=draft_probs)

    # --------------------------------------------------------------- derived views
    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def is_chain(self) -> bool:
        # A node is never deeper than its index (parents precede children), so the last node
        # at depth n - 1 has every other node on its path: parents[i] = i - 1.
        return int(self.depths[-1]) == self.size - 1

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] is True when j is i itself or one of its ancestors."""
        n = self.size
        mask = torch.zeros((n, n), dtype=torch.bool, device=HOST)
        rows = torch.arange(n, device=HOST)
        pointer = rows.clone()
        parents = self.parents.clamp(min=0)
        for _ in range(self.max_depth + 1):
            mask[rows, pointer] = True
            pointer = parents[pointer]
        return mask

    def path_to(self, node: int) -> torch.Tensor:
        """Node indices from the root to ``node`` inclusive."""
        depth = int(self.depths[node])
        path = torch.empty(depth + 1, dtype=torch.long, device=HOST)
        for d in range(depth, -1, -1):
            path[d] = node
            node = int(self.parents[node])
        return path

    def children(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()

    def restricted(self, keep: torch.Tensor) -> "Tree":
        """The nodes at the ascending indices `keep` (the root and every kept node's
        parent among them): parents precede children, so they keep their order."""
        new_index = torch.full((self.size,), -1, dtype=torch.long, device=self.parents.device)
        new_index[keep] = torch.arange(keep.numel(), device=keep.device)
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        draft_probs = None if self.draft_probs is None else self.draft_probs[keep]
        return Tree(self.tokens[keep], parents, self.depths[keep], draft_probs=draft_probs,
                    children_sampled=self.children_sampled)


def _first(flags: torch.Tensor) -> int | None:
    """Index of the first True in a 1-D bool tensor, or None."""
    hits = torch.nonzero(flags)
    return int(hits[0, 0]) if hits.numel() else None


def _first_index(flags: np.ndarray) -> int | None:
    """Index of the first True in a 1-D bool array, or None."""
    return int(flags.argmax()) if flags.any() else None


def _parents_problem(parents: np.ndarray) -> str | None:
    """`parents`: a 1-D int64 array."""
    n = parents.size
    if n < 1 or parents[0] != -1:
        return "node 0 must be the root (parent -1)"
    bad = _first_index((parents[1:] >= np.arange(1, n)) | (parents[1:] < 0))
    if bad is not None:
        i = bad + 1
        return f"node {i} has parent {int(parents[i])}; parents must precede their children (0 <= parent < {i})"
    return None


_OPTIONAL_DEFAULTS = {f.name: f.default for f in fields(Tree) if f.name not in ("tokens", "parents", "depths")}


def _depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    depths = torch.zeros(n, dtype=torch.long, device=HOST)
    pointer = parents.clone()
    alive = pointer >= 0
    while bool(alive.any()):
        depths += alive.long()
        pointer = torch.where(alive, parents[pointer.clamp(min=0)], pointer)
        alive = pointer >= 0
    return depths
