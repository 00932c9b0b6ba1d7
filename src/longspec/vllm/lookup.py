"""The token-id logic of the vLLM proposers, without vLLM: per batch row, prompt
lookup's incremental index over the row's committed tokens, and (for `auto`'s
version) how much of each copy to propose from its acceptance table; optionally a
suffix cache of the sequences that left the batch, drafted from where the row's own
text has no copy."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from longspec.speculation.copied_tree import copied_runs
from longspec.speculation.drafters.adaptive.acceptance import CrossFittedAcceptance
from longspec.speculation.drafters.adaptive.merge import Source
from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.speculation.drafters.suffix_cache import SuffixCache, SuffixCacheDrafter
from longspec.speculation.drafters.shared.policies import ThroughputPolicy
from longspec.vllm.rows import RowStates


class CopyLength:
    """How many tokens of a copy to propose: `auto`'s rule for one lookup component.

    Each node's acceptance is the path product of the cross-fitted table's optimistic
    rates per (depth, copied run) (`CrossFittedAcceptance`, the copy prior included);
    `ThroughputPolicy` then picks the k that maximises expected tokens per step, a
    step verifying k drafted tokens costing 1 + token_cost * k plain steps. vLLM does
    not tell a proposer its forward times, so token_cost is a setting, not a
    measurement as in our engine. The table learns from every copy looked up, proposed
    or not: the tokens a row commits next say how far the copy would have matched."""

    def __init__(self, token_cost: float, min_gain: float = 0.01, sampled: bool = False) -> None:
        if token_cost < 0:
            raise ValueError(f"token_cost is a share of a step, >= 0, got {token_cost}")
        self.token_cost = token_cost
        self.table = CrossFittedAcceptance(1)
        self.table.note_copying(0)
        self.table.expect_sampling(sampled)
        self.policy = ThroughputPolicy(min_gain)

    def record(self, chain: Sequence[int], runs: Sequence[int], committed: Sequence[int]) -> None:
        """Verdicts of a copy's nodes from the tokens committed after its root, up to
        the first node that differs (deeper nodes are conditional on it)."""
        for depth, (token, run, actual) in enumerate(zip(chain, runs, committed), 1):
            accepted = token == actual
            self.table.record(Source(0, depth, 0, run), accepted)
            if not accepted:
                break

    def choose(self, runs: Sequence[int]) -> int:
        rates = self.table.deciding_rates()
        expected, path = [], 1.0
        for depth, run in enumerate(runs, 1):
            path *= float(rates[self.table.cell(Source(0, depth, 0, run), False)])
            expected.append(path)
        return self.policy.choose(expected, lambda k: 1.0 + self.token_cost * k)

    def end_round(self) -> None:
        self.table.end_round()


@dataclass
class _Sequence:
    drafter: PromptLookupDrafter
    chain: list[int] = field(default_factory=list)  # the last copy looked up, whole
    runs: list[int] = field(default_factory=list)  # its nodes' copied runs
    tokens: array | None = None  # the committed tokens, kept only for a suffix cache
    prompt_length: int = 0  # of them, the prompt's (what the row held before its first token)


class LookupRows:
    """Drafts for a vLLM batch: `propose` takes what vLLM hands a custom proposer and
    returns one token list per row (empty: nothing to propose)."""

    def __init__(self, k: int, max_model_len: int, make_drafter: Callable[[], PromptLookupDrafter],
                 length: CopyLength | None = None, cache: SuffixCache | None = None) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self.max_model_len = max_model_len
        self.length = length
        self.cache = cache
        self.cache_drafter = None if cache is None else SuffixCacheDrafter(cache, num_tokens=k)
        self.rows: RowStates[_Sequence] = RowStates(lambda: _Sequence(make_drafter()),
                                                    None if cache is None else self._remember)

    def propose(self, sampled: Sequence[Sequence[int]], num_tokens: Sequence[int],
                token_ids: np.ndarray) -> list[list[int]]:
        drafts: list[list[int]] = []
        claimed: set[int] = set()
        for i, new in enumerate(sampled):
            n = int(num_tokens[i])
            if not len(new) or n >= self.max_model_len:  # a prefill chunk, or no room left
                drafts.append([])
                continue
            drafts.append(self._row(i, token_ids[i, :n], new, claimed))
        self.rows.end_step(len(sampled))
        if self.length is not None:
            self.length.end_round()
        return drafts

    def _row(self, i: int, tokens: np.ndarray, new: Sequence[int], claimed: set[int]) -> list[int]:
        row, fresh = self.rows.claim(i, tokens, claimed)
        seq = row.state
        if self.length is not None and not fresh and seq.chain and row.length == len(tokens) - len(new):
            self.length.record(seq.chain, seq.runs, new)
        if self.cache is not None:
            if fresh:
                seq.tokens, seq.prompt_length = array("l"), len(tokens) - len(new)
            seq.tokens.extend(tokens[len(seq.tokens):].tolist())
        # The drafter's own protocol: it catches up on the tokens it has not seen.
        context = DraftContext(tokens=torch.from_numpy(tokens), max_nodes=self.k)
        tree = seq.drafter.propose(context)
        if tree.tokens.numel() == 1 and self.cache_drafter is not None:  # the row's own text has no copy
            tree = self.cache_drafter.propose(context)
        runs = copied_runs(tree)
        seq.chain = tree.tokens[1:].tolist()
        seq.runs = runs[1:].tolist() if runs is not None else []
        self.rows.seen(row, tokens)
        keep = len(seq.chain) if self.length is None else self.length.choose(seq.runs)
        return seq.chain[: min(keep, self.max_model_len - len(tokens))]

    def _remember(self, seq: _Sequence) -> None:
        """A sequence that left the batch into the suffix cache. A preempted request
        that comes back later is inserted again when it ends: duplicates only cost
        the cache room, and drafts never change what vLLM returns."""
        if seq.tokens is not None:
            self.cache.insert(seq.tokens[: seq.prompt_length], seq.tokens[seq.prompt_length :])
