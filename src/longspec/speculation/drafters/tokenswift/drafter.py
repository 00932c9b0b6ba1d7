"""TokenSwift self-drafting: the target itself, run over a dynamic partial KV
cache, with γ residual heads on its last hidden state, plus n-gram token
reutilization; the engine verifies the tree against the full cache (lossless).

Each round the drafter forwards the tokens committed since its last forward (the
accepted ones and the bonus) through the target over its `PartialKVCache`, reads
γ + 1 distributions at the root (target head + heads 1..γ), and proposes the
Cartesian tree [top-1 of the target head, top-w of each extra head] (default
[1, 3, 3, 3]: 39 nodes) plus the ``k`` most frequent 4-gram continuations of the
head-0 token as extra chains, trimmed to the engine's node budget.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.shared.checks import check_positive_int
from longspec.speculation.drafters.shared.ngram_table import NgramTable
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.shared.partial_cache import PartialBudget, PartialKVCache, recording_queries
from longspec.speculation.drafters.tokenswift.tree import add_chains_within, cartesian_within
from longspec.speculation.tree import Tree

DEFAULT_HEADS = "tokenswift-gemma-3-270m.safetensors"  # in longspec/weights, for the embedded target


def default_heads_path() -> Path:
    return Path(str(resources.files("longspec") / "weights" / DEFAULT_HEADS))


def heads_for_target(heads: TokenSwiftHeads | None, source: str | Path | None, config) -> TokenSwiftHeads:
    """`heads` checked against the target `config`, or loaded (once) from `source`
    (None: the heads shipped for the embedded Gemma 3 270M) with the same check."""
    if heads is None:
        return TokenSwiftHeads.load(default_heads_path() if source is None else Path(source), config)
    heads.config.check_fits(config)
    return heads


class TokenSwiftDrafter(Drafter):
    """Options:
    heads: `TokenSwiftHeads`, a path to a heads file, or None for the shipped heads
        of the embedded Gemma 3 270M (other targets must pass their own).
    budget: full-attention slots of the partial cache; None scales it to the prompt
        (``budget_fraction`` of it, at least ``min_budget``).
    sinks: initial tokens always kept.
    k: n-gram continuations joined to the tree (0 disables token reutilization).
    widths: candidates per depth of the Cartesian tree (target head, then heads).
    dynamic_cache: False drafts over the whole context instead (ablation): a cache
        the size of the model's context window, never evicting.
    """

    def __init__(
        self,
        heads: TokenSwiftHeads | str | Path | None = None,
        *,
        budget: int | None = None,
        budget_fraction: float = 0.25,
        min_budget: int = 256,
        sinks: int = 64,
        k: int = 20,
        ngram: int = 4,
        widths: tuple[int, ...] = (1, 3, 3, 3),
        dynamic_cache: bool = True,
        forward_chunk: int = 64,
    ) -> None:
        self.heads_source = heads
        self.heads: TokenSwiftHeads | None = heads if isinstance(heads, TokenSwiftHeads) else None
        self.partial = PartialBudget(budget, budget_fraction, min_budget, sinks)
        self.k = k if k == 0 else check_positive_int("k", k, 0)
        self.ngram = check_positive_int("ngram", ngram, 2)
        self.widths = tuple(check_positive_int("widths", int(w), 1) for w in widths)
        if self.widths[0] != 1:
            raise ValueError("the first width is the target head's top-1 and must be 1")
        self.dynamic_cache = dynamic_cache
        self.forward_chunk = check_positive_int("forward_chunk", forward_chunk, 1)
        self.cache: PartialKVCache | None = None
        self.table = NgramTable(ngram)
        self._view = None
        self._root_logits: torch.Tensor | None = None
        self._root_hidden: torch.Tensor | None = None

    # ------------------------------------------------------------------ setup
    def check_target(self, config) -> None:
        """Load the heads (once) and raise if they do not fit `config` or the widths."""
        self.heads = heads_for_target(self.heads, self.heads_source, config)
        if len(self.widths) - 1 > self.heads.config.num_heads:
            raise ValueError(f"widths {self.widths} need {len(self.widths) - 1} heads; these have {self.heads.config.num_heads}")

    def _load_heads(self, model) -> TokenSwiftHeads:
        self.check_target(model.config)
        wide = torch.float64 if model.dtype == torch.float64 else torch.float32
        return self.heads.to(device=model.device, dtype=wide)

    def _budget_for(self, prompt_length: int, config) -> tuple[int, int]:
        """(budget, sinks) for this sequence."""
        if not self.dynamic_cache:
            return config.max_position_embeddings + self.forward_chunk, 0
        return self.partial.for_prompt(prompt_length, self.forward_chunk)

    def begin(self, context: DraftContext) -> None:
        view = context.target
        if view is None:
            raise ValueError("TokenSwift drafts with the target itself; the engine must pass a TargetView")
        model = view.decoder_for_self_drafting
        self._load_heads(model)
        self._view = view
        tokens = torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1)
        budget, sinks = self._budget_for(tokens.numel(), model.config)
        self.cache = PartialKVCache(model.config, budget, sinks, max_forward_tokens=self.forward_chunk,
                                    dtype=model.dtype, device=model.embed_weight.device)
        self.table = NgramTable(self.ngram)
        self.table.update(tokens)
        self.cache.warm_up(view.layer_kv, tokens, self._forward)

    def _forward(self, new: torch.Tensor) -> None:
        """Drafting forward(s) over tokens not yet in the partial cache."""
        model, cache = self._view.decoder_for_self_drafting, self.cache
        for begin in range(0, new.numel(), self.forward_chunk):
            piece = new[begin : begin + self.forward_chunk]
            positions = cache.length + torch.arange(piece.numel(), device=cache.device)
            last = slice(piece.numel() - 1, piece.numel())
            with recording_queries(model, cache):
                out = model(piece.unsqueeze(0), cache, positions=positions, logits_rows=last)
            cache.commit(self._view.layer_kv)
        self._root_logits, self._root_hidden = out.logits[0, -1], out.hidden[0, -1]

    # --------------------------------------------------------------- protocol
    def observe(self, committed: torch.Tensor) -> None:
        self.table.update(committed)

    def state_nbytes(self) -> int:
        """The partial KV cache (fixed by the budget) and the n-gram table."""
        return (self.cache.nbytes() if self.cache is not None else 0) + self.table.nbytes()

    def propose(self, context: DraftContext) -> Tree:
        if self.cache is None:
            raise RuntimeError("call begin() before propose()")
        tokens = torch.as_tensor(context.tokens, dtype=torch.long).reshape(-1)
        if tokens.numel() < self.cache.length:
            self.begin(context)  # a different (shorter) sequence: start over
        elif tokens.numel() > self.cache.length:
            self._forward(tokens[self.cache.length :])
        if self.table.length != tokens.numel():
            self.table = NgramTable(self.ngram)
            self.table.update(tokens)
        root = int(tokens[-1])
        heads = self.heads
        first = torch.argmax(self._root_logits).reshape(1)
        extra = len(self.widths) - 1
        candidates = [first]
        if extra:
            head_logits = heads.logits(self._view.decoder_for_self_drafting, self._root_hidden)[:extra]
            for width, logits in zip(self.widths[1:], head_logits):
                candidates.append(torch.topk(logits, width).indices)
        tree = cartesian_within(root, candidates, context.max_nodes)
        if self.k and tree.size > 1:
            head0 = int(first)
            chains = [[head0, *c.tolist()] for c in self.table.top_continuations(head0, self.k)]
            tree = add_chains_within(tree, chains, context.max_nodes)
        return tree
