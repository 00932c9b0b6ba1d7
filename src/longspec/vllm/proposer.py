"""The vLLM `custom_class` proposers. vLLM builds the class with its `VllmConfig`,
calls `load_model(model)` once and `propose(...)` after every step; nothing here
imports vLLM (the config is read by attribute), so the classes are tested without it.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, ClassVar

import numpy as np

from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.speculation.drafters.suffix_cache import SuffixCache
from longspec.vllm.lookup import CopyLength, LookupRows

# The proposers alive in this process (vLLM builds them inside its engine): their
# counters are what a benchmark reads of the plugin's own time.
LIVE: weakref.WeakSet = weakref.WeakSet()


class PromptLookupProposer:
    """Prompt lookup (`method="pld"`'s drafter): the continuation of the most recent
    earlier occurrence of the longest matching 1- to 3-token suffix, up to
    `num_speculative_tokens` tokens, from an index updated incrementally per row."""

    lookup_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        options = {"num_tokens": self.k, **self.lookup_options}
        self.rows = LookupRows(self.k, int(vllm_config.model_config.max_model_len),
                               lambda: PromptLookupDrafter(**options), self._copy_length(), self._suffix_cache())
        # The plugin's own cost, read by benchmarks (benchmarks/serving/vllm_plugin.py).
        self.calls = 0
        self.seconds = 0.0
        self.drafted = 0
        LIVE.add(self)

    def _copy_length(self) -> CopyLength | None:
        return None  # propose every token looked up

    def _suffix_cache(self) -> SuffixCache | None:
        return None  # the row's own text only

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass  # drafts come from the token ids: no model

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        start = time.perf_counter()
        drafts = self.rows.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.drafted += sum(map(len, drafts))
        return drafts


class AutoLookupProposer(PromptLookupProposer):
    """`auto`'s lookup component (copies that continue into their own draft, from the
    occurrence whose preceding tokens agree longest) with its acceptance table sizing
    each copy (`CopyLength`). `token_cost`: a drafted token's verification cost as a
    share of a decode step; subclass to set it for your hardware (near 0 on a GPU).
    Copies are at most `num_speculative_tokens` long (12 in our engine's `auto`)."""

    lookup_options: ClassVar[dict[str, Any]] = {"continue_copies": True, "longest_run": True}
    token_cost = 0.05
    sampled = False  # the requests sample (temperature > 0): a lower copy prior

    def _copy_length(self) -> CopyLength | None:
        return CopyLength(self.token_cost, sampled=self.sampled)



class SuffixCacheProposer(AutoLookupProposer):
    """`AutoLookupProposer` plus a suffix cache across requests (our `suffix` method's
    index): the sequences that left vLLM's batch are remembered (their prompt's tail
    and output, at most `cache_megabytes`, oldest evicted first), and a row whose own
    text has no copy drafts what followed its suffix in them — repeated templated or
    agentic traffic. One cache per proposer, i.e. per vLLM engine process; subclass to
    set `cache_megabytes`."""

    cache_megabytes: ClassVar[float] = 64

    def _suffix_cache(self) -> SuffixCache | None:
        return SuffixCache.of_megabytes(self.cache_megabytes)
