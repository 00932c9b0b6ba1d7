"""Drafting from the suffix cache: the continuations that followed the sequence's
current suffix in earlier requests (`index.SuffixCache`), as copied chains."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.shared.chains import chains_tree
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.drafters.suffix_cache.index import SuffixCache
from longspec.speculation.tree import Tree


class SuffixCacheDrafter(Drafter):
    """Proposes up to `max_candidates` continuations (each at most `num_tokens`) of the
    committed sequence's suffix from the shared cache it is given; a tree whose nodes
    carry their copied runs (`CopiedTree`), so `auto` weighs a long match as evidence.

    It reads only its context and the cache; it keeps no per-sequence state (the
    request's own text is prompt lookup's), and never writes the cache: the engine
    inserts a request once it finished (`LongSpecModel`)."""

    def __init__(self, cache: SuffixCache | None = None, num_tokens: int = 10, max_candidates: int = 1) -> None:
        if cache is not None and not isinstance(cache, SuffixCache):
            raise ValueError(f"cache must be a SuffixCache (the model's: LongSpecModel.suffix_cache), "
                             f"got {type(cache).__name__}")
        # Without a cache (a model whose cache is off) it proposes nothing.
        self.cache = cache
        self.num_tokens = check_positive_int("num_tokens", num_tokens, 1)
        self.max_candidates = check_positive_int("max_candidates", max_candidates, 1)

    def begin(self, context: DraftContext) -> None:
        """Nothing per sequence: the cache is shared."""

    def observe(self, committed: torch.Tensor) -> None:
        """Nothing: `propose` reads the suffix from its context."""

    def propose(self, context: DraftContext) -> Tree:
        root = context.root
        limit = min(self.num_tokens, int(context.max_nodes))
        if self.cache is None or limit <= 0:
            return Tree.chain(root, [])
        tokens = context.tokens
        suffix = tokens[max(tokens.numel() - self.cache.max_run, 0):].tolist()
        found = self.cache.lookup(suffix, limit, self.max_candidates)
        return chains_tree(root, [chain for chain, _ in found], context.max_nodes, runs=[run for _, run in found])
