"""Token reutilization (TokenSwift-style): draft from the n-grams of the text so far.

`NgramTable` counts every n-gram of the observed text and answers "which n-1 tokens
most often followed token t?". `NgramDrafter` turns the top answers for the root
token into a speculation tree.

Identity and ordering of table entries are kept in one place: per first token, a
dict maps the continuation (the n-gram's last n-1 tokens, a tuple) to its mutable
``[count, last_seen]`` record. An update touches exactly one record, found by its
key; the ranking is computed from the records at query time. No separate ordered
structure exists that could drift out of sync with the counts (the failure mode of
a frequency list whose sort key and equality disagree, where an update removes the
wrong entry and leaves a stale duplicate behind).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from longspec.runtime.device import HOST
from longspec.speculation.drafters.base import DraftContext, Drafter, container_nbytes
from longspec.speculation.tree import Tree


def _as_token_list(tokens: torch.Tensor | Sequence[int]) -> list[int]:
    return torch.as_tensor(tokens, dtype=torch.long).reshape(-1).tolist()


def _check_positive_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


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
    `copied_runs` then give each node the longest run among the chains through it."""
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
        node_runs = [0, *(int(runs[0]) + depth for depth in range(len(trimmed[0])))]
        return Tree.chain(root, trimmed[0], copied_runs=torch.tensor(node_runs, dtype=torch.long, device=HOST))
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
    return replace(tree, copied_runs=torch.tensor(node_runs, dtype=torch.long, device=HOST))


class NgramTable:
    """Counts of every n-gram of a growing token stream.

    ``update(tokens)`` appends tokens to the stream; the table keeps the last n-1
    tokens so that n-grams straddling two updates are counted exactly once.
    ``last_seen`` of an n-gram is the stream position of the first token of its
    most recent occurrence (unique per n-gram, so rankings have no ties).

    Costs: ``update`` is O(c) dict operations for c new tokens; ``top_continuations``
    is O(m log k) for the m distinct n-grams starting with the queried token.
    """

    def __init__(self, n: int = 4) -> None:
        self.n = _check_positive_int("n", n, 2)
        # first token -> {continuation (n-1 tuple) -> [count, last_seen]}
        self._table: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._tail: list[int] = []  # last n-1 tokens of the stream
        self._length = 0  # tokens seen so far
        self._distinct = 0

    @property
    def length(self) -> int:
        """Number of tokens observed so far."""
        return self._length

    @property
    def last_token(self) -> int | None:
        return self._tail[-1] if self._tail else None

    def __len__(self) -> int:
        """Number of distinct n-grams counted."""
        return self._distinct

    def update(self, tokens: torch.Tensor | Sequence[int]) -> None:
        new = _as_token_list(tokens)
        if not new:
            return
        n = self.n
        buf = self._tail + new
        offset = self._length - len(self._tail)  # stream position of buf[0]
        table = self._table
        for i in range(len(buf) - n + 1):
            first = buf[i]
            cont = tuple(buf[i + 1 : i + n])
            per_first = table.get(first)
            if per_first is None:
                per_first = table[first] = {}
            record = per_first.get(cont)
            if record is None:
                per_first[cont] = [1, offset + i]
                self._distinct += 1
            else:
                record[0] += 1
                record[1] = offset + i
        self._tail = buf[-(n - 1) :]
        self._length += len(new)

    def nbytes(self) -> int:
        """Bytes of the table (at most one record per distinct n-gram seen)."""
        return container_nbytes((self._table, self._tail))

    def count(self, ngram: Sequence[int]) -> int:
        ngram = tuple(int(t) for t in ngram)
        if len(ngram) != self.n:
            raise ValueError(f"ngram must have {self.n} tokens, got {len(ngram)}")
        record = self._table.get(ngram[0], {}).get(ngram[1:])
        return 0 if record is None else record[0]

    def items(self) -> Iterator[tuple[tuple[int, ...], int, int]]:
        """Every counted n-gram as ``(ngram, count, last_seen)`` (no fixed order)."""
        for first, per_first in self._table.items():
            for cont, (count, last_seen) in per_first.items():
                yield (first, *cont), count, last_seen

    def top_continuations(self, first_token: int, k: int) -> list[torch.Tensor]:
        """Up to ``k`` chains of n-1 tokens that followed ``first_token``, most
        frequent first, ties broken by most recent occurrence."""
        if k <= 0:
            return []
        per_first = self._table.get(int(first_token))
        if not per_first:
            return []
        best = heapq.nlargest(k, per_first.items(), key=lambda item: (item[1][0], item[1][1]))
        return [torch.tensor(cont, dtype=torch.long, device=HOST) for cont, _ in best]


class NgramDrafter(Drafter):
    """Drafts the ``k`` most frequent continuations of the root token seen so far
    in the sequence (prompt and output), merged into one tree.

    ``begin`` counts the prompt (O(L)), ``observe`` counts the committed tokens
    (O(c)), ``propose`` costs O(m log k + k·n) for the m distinct n-grams that start
    with the root token, independent of the sequence length.

    The drafter keeps its own copy of the stream; if ``propose`` is handed a context
    whose length differs from what it has observed, it catches up from the context
    (appending the new tail, or recounting from scratch when the context is shorter
    or its token at the last observed position differs).
    """

    def __init__(self, n: int = 4, k: int = 20) -> None:
        self.n = _check_positive_int("n", n, 2)
        self.k = _check_positive_int("k", k, 1)
        self.table = NgramTable(self.n)

    def begin(self, context: DraftContext) -> None:
        self.table = NgramTable(self.n)
        self.table.update(context.tokens)

    def observe(self, committed: torch.Tensor) -> None:
        self.table.update(committed)

    def state_nbytes(self) -> int:
        return self.table.nbytes()

    def _sync(self, tokens: torch.Tensor) -> None:
        seen = self.table.length
        total = tokens.numel()
        if total < seen or (seen and int(tokens[seen - 1]) != self.table.last_token):
            self.table = NgramTable(self.n)
            seen = 0
        if total > seen:
            self.table.update(tokens[seen:])

    def propose(self, context: DraftContext) -> Tree:
        tokens = torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1)
        self._sync(tokens)
        root = int(tokens[-1])
        chains = self.table.top_continuations(root, self.k)
        return chains_tree(root, [c.tolist() for c in chains], context.max_nodes)
