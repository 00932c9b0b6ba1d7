"""Named LongSpec methods for the registry: which strategy, which retrieval, and
which draft weights (the shipped Gemma 3 270M draft unless `checkpoint` is given).

Defaults for a CPU (see docs/lab-notes/longspec-draft.md#longspec-draft-issue-longspec):
verifying k tokens costs little more than 1 up to the knee measured there, so trees
stay within it.
"""

from __future__ import annotations

from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from longspec.speculation.drafters.longspec.checkpoint import load_draft
from longspec.speculation.drafters.longspec.drafter import LongSpecDrafter
from longspec.speculation.drafters.longspec.strategies import BeamStrategy, CapeStrategy, ChainStrategy, SampledChainStrategy
from longspec.speculation.drafters.ngram import NgramDrafter
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter

SHIPPED_DRAFT = "longspec-gemma-3-270m.safetensors"
# The paper's widths are (4, 16, 16, 16, 16) (68 nodes) for a GPU; on a CPU a
# verification of 16 tokens costs little more than one token and 64 tokens far more
# (docs/lab-notes/longspec-draft.md#this-session-retrieval-first-packed-draft-training-evidence),
# so the default tree stays near 18 nodes.
DEFAULT_BEAM_WIDTHS = (2, 4, 4, 4, 4)


def shipped_draft_path() -> Path:
    return Path(str(resources.files("longspec") / "weights" / SHIPPED_DRAFT))


def _strategy(kind: str, length: int, widths, temperature):
    strategies = {
        "chain": lambda: ChainStrategy(length),
        "cape": lambda: CapeStrategy(length),
        "beam": lambda: BeamStrategy(widths),
        "sampled-chain": lambda: SampledChainStrategy(length, temperature),
    }
    if kind not in strategies:
        raise ValueError(f"unknown LongSpec strategy {kind!r}; choose from {', '.join(strategies)}")
    return strategies[kind]()


def make_longspec(
    *,
    strategy: str = "beam",
    checkpoint: str | Path | None = None,
    length: int = 5,
    widths=DEFAULT_BEAM_WIDTHS,
    temperature: float = 1.0,
    retrieval: str | None = None,
    retrieval_nodes: int = 10,
    retrieval_streak: int | None = 0,
    seed: int | None = None,
    context_vocab: bool = True,
) -> LongSpecDrafter:
    """A LongSpec drafter. checkpoint: draft weights (.safetensors with its .json);
    default: the draft shipped for the embedded Gemma 3 270M (checked against the
    actual target when generation begins). context_vocab: score only the draft's tokens
    that the sequence used — on by default: a chain round costs a smaller share of a
    target forward, with the same or a higher tau
    (docs/lab-notes/longspec-draft.md#the-longspec-draft-scores-the-tokens-the-sequence-used-issue-longspec-draft-that-pays)."""
    path = Path(checkpoint) if checkpoint is not None else shipped_draft_path()
    if not path.is_file():
        hint = "pass checkpoint=PATH" if checkpoint is not None else "this installation lacks the shipped draft; pass checkpoint=PATH"
        raise FileNotFoundError(
            f"LongSpec draft weights not found at {path}: {hint} "
            "(train one for your target with `longspec train longspec --model ... --out DIR`)"
        )
    retrievers: dict[str | None, Any] = {
        None: lambda: None,
        "pld": lambda: PromptLookupDrafter(num_tokens=retrieval_nodes),
        "ngram": lambda: NgramDrafter(),
    }
    if retrieval not in retrievers:
        raise ValueError(f"unknown retrieval {retrieval!r}; choose from pld, ngram")
    return LongSpecDrafter(
        load_draft(path), _strategy(strategy, length, widths, temperature),
        retrieval=retrievers[retrieval](), retrieval_nodes=retrieval_nodes, retrieval_streak=retrieval_streak, seed=seed,
        context_vocab=context_vocab,
    )


LONGSPEC_METHODS = {
    "longspec": make_longspec,
    "longspec-chain": partial(make_longspec, strategy="chain"),
    "longspec-cape": partial(make_longspec, strategy="cape"),
    "longspec-sampled": partial(make_longspec, strategy="sampled-chain"),
    "longspec-ngram": partial(make_longspec, retrieval="pld"),
}
