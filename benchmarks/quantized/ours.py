"""Our side of each row, one measurement per call: rates from `GenerationStats`
(decode excludes prefill and the one-time setup a first call reports)."""

from __future__ import annotations

import time

import torch

from longspec.speculation.cost_model import measure_forward_cost


def decode(model, ids: list[int], *, new_tokens: int, method: str = "ar", temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0) -> dict:
    """One generation after `ids`: decode and prefill tokens/s, and what the drafters did."""
    sampled = {} if temperature == 0 else {"top_p": top_p, "seed": seed}
    result = model.generate(ids, max_new_tokens=new_tokens, method=method, temperature=temperature,
                            ignore_eos=True, **sampled)
    s = result.stats
    return {"decode_tokens_per_s": s.decode_tokens_per_s, "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "new_tokens": s.new_tokens, "tau": s.tau, "target_forwards": s.target_forwards,
            "accepted_tokens": s.accepted_tokens, "tokens": result.token_ids}


def chain_parents(k: int) -> torch.Tensor:
    """A root and k nodes in a chain: the causal forward llama.cpp runs for k + 1 tokens."""
    return torch.tensor([-1] + list(range(k)), dtype=torch.long)


def verification_seconds(model, *, context: int, tokens: int) -> float:
    """One verification forward of `tokens` chained tokens over `context` committed positions
    (random keys: the cost is the number of keys read, not their values), as the engine
    runs it; one timed forward after a warm-up."""
    cost = measure_forward_cost(model.model, context=context, ks=(1, tokens), repeats=1, parents_for=chain_parents)
    return cost.seconds_for(tokens)


def warm_up(model, ids: list[int]) -> float:
    """Kernels, caches and the forward-cost curve `auto` prices trees with at this prompt's
    length, before any timing; its seconds."""
    start = time.perf_counter()
    for method in ("ar", "auto"):
        model.generate(ids, max_new_tokens=8, method=method, ignore_eos=True)
    return time.perf_counter() - start
