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

COMPONENTS: dict[str, Callable[[], Drafter]] = {
    "pld": partial(PromptLookupDrafter, num_tokens=AUTO_LOOKUP_TOKENS, continue_copies=True, longest_run=True),
    "ngram": NgramDrafter,
    "longspec": make_longspec,  # the shipped draft (beam trees); left out on targets it does not fit
    # The shipped external drafters (opt-in), as chains.
    "mamba": MambaDrafter,
    "draft-model": partial(DraftModelDrafter, length=4),
}
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


def make_auto(
    *,
    components: Sequence[str] | str = DEFAULT_COMPONENTS,
    policy: str = "throughput",
    probe_every: int = 16,
) -> AdaptiveDrafter:
    """auto over the named components (any of pld, ngram, longspec, mamba, draft-model;
    a comma-separated string works too) with the named policy (throughput or ucb)."""
    names = [n.strip() for n in components.split(",")] if isinstance(components, str) else list(components)
    unknown = [n for n in names if n not in COMPONENTS]
    if unknown or not names:
        raise ValueError(f"unknown auto component(s) {unknown or names}; choose from {', '.join(COMPONENTS)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown auto policy {policy!r}; choose from {', '.join(POLICIES)}")
    built, missing = [], {}
    for name in names:
        try:
            built.append((name, COMPONENTS[name]()))
        except FileNotFoundError as error:  # e.g. an installation without the shipped draft
            missing[name] = str(error).splitlines()[0]
    if not built:
        raise ValueError(f"no auto component could be built: {missing}")
    drafter = AdaptiveDrafter(built, policy=POLICIES[policy](), probe_every=probe_every)
    drafter.telemetry_state.unavailable.update(missing)
    return drafter
