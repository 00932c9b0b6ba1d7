"""Our token-id drafters as vLLM proposers (the `vllm` extra):

    LLM(model, speculative_config={"method": "custom_class",
                                   "model": "longspec.vllm.AutoLookupProposer",
                                   "num_speculative_tokens": 8})

`PromptLookupProposer` is prompt lookup; `AutoLookupProposer` is `auto`'s lookup
component sized by its acceptance table; `SuffixCacheProposer` adds a suffix cache of
earlier requests. vLLM verifies the drafts with its own
sampler: exactness there is vLLM's guarantee, not ours (docs/serving.md#scaling-out).
Nothing here imports vLLM.
"""

from longspec.vllm.proposer import AutoLookupProposer, PromptLookupProposer, SuffixCacheProposer

__all__ = ["AutoLookupProposer", "PromptLookupProposer", "SuffixCacheProposer"]
