"""Token reutilization (TokenSwift-style): draft from the n-grams of the text so far.
`NgramDrafter` turns the `NgramTable`'s top continuations of the root token into a
speculation tree."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.shared.chains import chains_tree
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.drafters.shared.ngram_table import NgramTable
from longspec.speculation.tree import Tree


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
        self.n = check_positive_int("n", n, 2)
        self.k = check_positive_int("k", k, 1)
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
