"""`method="auto"` for the registry: which components and which policy, by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from longspec.speculation.drafters.adaptive.drafter import AdaptiveDrafter
from longspec.speculation.drafters.shared.policies import ThroughputPolicy, TreePolicy, UCBPolicy
from longspec.speculation.drafters.base import Drafter
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.presets.longspec import make_longspec
from longspec.speculation.drafters.mamba import MambaDrafter
from longspec.speculation.drafters.ngram import NgramDrafter
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.speculation.drafters.suffix_cache import SuffixCache, SuffixCacheDrafter

# auto's prompt lookup offers copies of up to 12 tokens that continue into their own
# draft (a loop shorter than the copy keeps being copied): the controller verifies
# only as much of a copy as its acceptance and the forward's cost pay for. Replayed,
# 12 tokens beat 10-token copies that stop at the sequence's end on every set of
# outputs; 16 or 24 tokens won more on the Spec-Bench/AIME loops but lost on the full
# preset, with trees sized from over-predicted deep nodes
# (docs/lab-notes/prompt-lookup.md#copies-that-continue-into-their-own-draft-the-cost-model-measured-under-load-issue-adaptive-speculation).
# It copies from the recent occurrence whose preceding tokens agree longest with the
# sequence's (`longest_run`), not from the most recent one: in a loop whose short
# n-grams recur at other phases, the most recent match broke off after a few tokens at
# the same points every period, and `auto`, verifying short trees there, could lock
# into those points
# (docs/lab-notes/prompt-lookup.md#a-lookup-that-locked-auto-into-the-wrong-points-of-a-loop).
AUTO_LOOKUP_TOKENS = 12
# The suffix cache's copies are longer: templated outputs (JSON records, boilerplate)
# repeat for dozens of tokens, and the controller verifies only what pays.
AUTO_SUFFIX_TOKENS = 16

COMPONENTS: dict[str, Callable[[], Drafter]] = {
    "pld": partial(PromptLookupDrafter, num_tokens=AUTO_LOOKUP_TOKENS, continue_copies=True, longest_run=True),
    "ngram": NgramDrafter,
    "longspec": make_longspec,  # the shipped draft (beam trees); left out on targets it does not fit
    # The shipped external drafters (opt-in), as chains.
    "mamba": MambaDrafter,
    "draft-model": partial(DraftModelDrafter, length=4),
    # Earlier requests' outputs (the model's shared cache, `SUFFIX`): built with that cache.
    "suffix": partial(SuffixCacheDrafter, num_tokens=AUTO_SUFFIX_TOKENS),
}
SUFFIX = "suffix"
POLICIES: dict[str, Callable[[], TreePolicy]] = {
    "throughput": ThroughputPolicy,  # expected tokens per second from the measured cost model (default)
    "ucb": UCBPolicy,  # UCB over node budgets (the Mamba-drafter paper's test-time search)
}
# Prompt lookup alone by default, by measurement on a 2-core CPU: beside it, n-gram
# reuse slowed auto on replayed Multi-News and LCC continuations (its nodes displace
# better lookup nodes; its bookkeeping doubles auto's own time), and the LongSpec
# draft's probes took a share of the decode time in most rows of the full preset while
# adding almost no accepted token
# (docs/lab-notes/auto-controller.md#copied-runs-auto-knows-how-long-a-prompt-lookup-copy-has-matched-issue-adaptive-speculation).
# Both stay one `components=` away.
DEFAULT_COMPONENTS = ("pld",)
# With the model's suffix cache (on by default: `LongSpecModel.suffix_cache`), the
# default adds it: it costs a lookup a round and proposes only where earlier requests
# wrote the same text.
DEFAULT_WITH_SUFFIX_CACHE = ("pld", SUFFIX)


def make_auto(
    *,
    components: Sequence[str] | str | None = None,
    policy: str = "throughput",
    probe_every: int = 16,
    suffix_cache: SuffixCache | None = None,
) -> AdaptiveDrafter:
    """auto over the named components (any of pld, ngram, longspec, mamba, draft-model,
    suffix; a comma-separated string works too; default pld, and suffix where a
    `suffix_cache` is given) with the named policy (throughput or ucb). `suffix_cache`:
    the model's shared cache (the engine passes it, never a request)."""
    if components is None:
        components = DEFAULT_WITH_SUFFIX_CACHE if suffix_cache is not None else DEFAULT_COMPONENTS
    names = [n.strip() for n in components.split(",")] if isinstance(components, str) else list(components)
    unknown = [n for n in names if n not in COMPONENTS]
    if unknown or not names:
        raise ValueError(f"unknown auto component(s) {unknown or names}; choose from {', '.join(COMPONENTS)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown auto policy {policy!r}; choose from {', '.join(POLICIES)}")
    built, missing = [], {}
    for name in names:
        if name == SUFFIX and suffix_cache is None:
            missing[name] = "no suffix cache: the model's is off (LongSpecModel suffix_cache_mb > 0 turns it on)"
            continue
        try:
            built.append((name, COMPONENTS[name](cache=suffix_cache) if name == SUFFIX else COMPONENTS[name]()))
        except FileNotFoundError as error:  # e.g. an installation without the shipped draft
            missing[name] = str(error).splitlines()[0]
    if not built:
        raise ValueError(f"no auto component could be built: {missing}")
    drafter = AdaptiveDrafter(built, policy=POLICIES[policy](), probe_every=probe_every)
    drafter.telemetry_state.unavailable.update(missing)
    return drafter
