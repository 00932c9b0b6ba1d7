"""Self-speculation baselines: the target drafts for itself over a bounded cache.

* `MagicDecDrafter` (method `magicdec`): a StreamingLLM cache — the first `sinks`
  tokens plus the most recent ones, rolling: each newly committed token replaces the
  oldest non-sink token (MagicDec's self-speculation; LongSpec and TokenSwift compare
  against it).
* `TriForceDrafter` (method `triforce`): TokenSwift's dynamic partial cache — the
  sinks plus the tokens the latest query attends to most, re-selected from the
  verifier's full K/V when the replacements run out (TokenSwift's "TriForce*").

Each round the drafter runs the committed tokens its cache has not seen (the
accepted ones and the bonus) through the target over its partial cache, then drafts
a chain of `length` tokens greedily: token i comes from one more forward of the chain
so far, which the cache forgets afterwards. The candidates are deterministic, so
under sampling the engine's one-draw-per-node rule keeps the output exactly the
target's distribution.

What it costs: every drafted token is a forward of the whole target. Where a forward
is bound by reading the weights (a small target, a CPU), a partial cache saves
almost nothing, and a round costs about `length` forwards plus the verification:
these methods then run below plain decoding, whatever they accept. They pay where
reading the KV cache dominates a forward (a large target at 100k tokens, big
batches): the setting of the papers.
"""

from __future__ import annotations

import contextlib

import torch

from longspec.runtime.device import HOST
from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.shared.own_cache import OwnCacheDrafter
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.drafters.shared.partial_cache import PartialBudget, PartialKVCache, recording_queries
from longspec.speculation.tree import Tree


class MagicDecDrafter(OwnCacheDrafter):
    """Options:
    length: γ, tokens drafted per round.
    budget: full-attention slots of the partial cache (sinks included); None scales
        it to the prompt (``budget_fraction`` of it, at least ``min_budget``).
    sinks: initial tokens always kept.
    forward_chunk: most tokens per drafting forward (catching up after a long round).
    """

    # False: StreamingLLM (recency); True: importance from the latest query (TriForce*).
    scores_by_importance = False

    def __init__(
        self,
        *,
        length: int = 4,
        budget: int | None = None,
        budget_fraction: float = 0.25,
        min_budget: int = 256,
        sinks: int = 4,
        forward_chunk: int = 64,
    ) -> None:
        self.length = check_positive_int("length", length, 1)
        self.partial = PartialBudget(budget, budget_fraction, min_budget, sinks)
        self.forward_chunk = check_positive_int("forward_chunk", forward_chunk, 1)
        if self.forward_chunk < self.length:
            raise ValueError(f"forward_chunk ({forward_chunk}) must hold a drafted chain of length {length}")
        self.cache: PartialKVCache | None = None
        self._view = None
        self._root_logits: torch.Tensor | None = None

    def begin(self, context: DraftContext) -> None:
        view = context.target
        if view is None:
            raise ValueError(f"{type(self).__name__} drafts with the target itself; the engine must pass a TargetView")
        model = view.decoder_for_self_drafting
        self._view = view
        tokens = torch.as_tensor(context.tokens, dtype=torch.long, device=HOST).reshape(-1)
        budget, sinks = self.partial.for_prompt(tokens.numel(), self.forward_chunk)
        self.cache = PartialKVCache(model.config, budget, sinks, max_forward_tokens=self.forward_chunk,
                                    dtype=model.dtype, device=model.device)
        self.cache.warm_up(view.layer_kv, tokens, self._forward)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Tree:
        self.begun_cache()
        tokens = torch.as_tensor(context.tokens, dtype=torch.long, device=HOST).reshape(-1)
        if tokens.numel() < self.cache.length:
            self.begin(context)  # a different (shorter) sequence: start over
        elif tokens.numel() > self.cache.length:
            self._forward(tokens[self.cache.length :])
        length = min(self.length, int(context.max_nodes))
        if length <= 0:
            return Tree.chain(context.root, [])
        chain = [int(torch.argmax(self._root_logits))]
        model, cache = self._view.decoder_for_self_drafting, self.cache
        while len(chain) < length:
            ids = torch.tensor(chain, dtype=torch.long, device=HOST)
            positions = cache.length + torch.arange(len(chain), device=cache.device)
            out = model(ids.unsqueeze(0), cache, positions=positions, logits_rows=slice(-1, None))
            cache.drop_pending()
            chain.append(int(torch.argmax(out.logits[0, -1])))
        return Tree.chain(context.root, chain)

    def _forward(self, new: torch.Tensor) -> None:
        """Commit tokens not yet in the partial cache; keep the logits after the last."""
        model, cache = self._view.decoder_for_self_drafting, self.cache
        for begin in range(0, new.numel(), self.forward_chunk):
            piece = new[begin : begin + self.forward_chunk]
            positions = cache.length + torch.arange(piece.numel(), device=cache.device)
            recording = recording_queries(model, cache) if self.scores_by_importance else contextlib.nullcontext()
            with recording:
                out = model(piece.unsqueeze(0), cache, positions=positions, logits_rows=slice(-1, None))
            cache.commit(self._view.layer_kv)
        self._root_logits = out.logits[0, -1]


class TriForceDrafter(MagicDecDrafter):
    __doc__ = MagicDecDrafter.__doc__
    scores_by_importance = True
