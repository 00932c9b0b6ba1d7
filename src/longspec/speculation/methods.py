"""Named decoding methods: the one place where a method name becomes a drafter.

Each entry builds a fresh drafter from keyword options (None means plain
autoregressive decoding). Later drafters register here too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.presets.auto import make_auto
from longspec.speculation.drafters.base import Drafter
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.mamba import MambaDrafter
from longspec.speculation.presets.longspec import LONGSPEC_METHODS
from longspec.speculation.drafters.self_speculation import MagicDecDrafter, TriForceDrafter
from longspec.speculation.drafters.suffix_cache import SuffixCache, SuffixCacheDrafter
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter
from longspec.speculation.drafters.tokenswift.medusa import MedusaDrafter
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter


def _autoregressive(**options: Any) -> None:
    if options:
        raise ValueError(f"method 'ar' takes no drafter options, got {sorted(options)}")
    return None


# The method of `generate`, `stream`, the CLI and the server when none is named: on the full
# preset it beats prompt lookup's geometric mean, stays close to the best fixed method and
# above plain decoding in every row (docs/benchmarks.md#a-the-full-preset-auto-against-fixed-methods),
# with the same tokens as plain decoding.
DEFAULT_METHOD = "auto"

METHODS: dict[str, Callable[..., Drafter | None]] = {
    "ar": _autoregressive,
    "pld": PromptLookupDrafter,
    "ngram": NgramDrafter,
    "tokenswift": TokenSwiftDrafter,
    "tokenswift-onepass": OnePassTokenSwiftDrafter,
    "medusa": MedusaDrafter,
    "magicdec": MagicDecDrafter,
    "triforce": TriForceDrafter,
    **LONGSPEC_METHODS,
    "draft-model": DraftModelDrafter,
    "mamba": MambaDrafter,
    "auto": make_auto,
    "suffix": SuffixCacheDrafter,  # the model's cache of earlier requests (`SHARED`)
}
# What a model holds for all its requests, handed to the factories that take it by
# `make_drafter`: never a user's option. Each factory's name for it.
SHARED = {"auto": "suffix_cache", "suffix": "cache"}


def accepted_options(method: str) -> list[str]:
    """The keyword options a method's drafter takes (what `--option KEY=VALUE` accepts)."""
    if method == "ar":
        return []
    parameters = inspect.signature(METHODS[method]).parameters.values()
    return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.name not in ("self", SHARED.get(method))]


def make_drafter(method: str, *, suffix_cache: SuffixCache | None = None, **options: Any) -> Drafter | None:
    """A fresh drafter for `method` with the user's `options`; `suffix_cache`: the
    model's cache of earlier requests, for the methods that draft from it."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    accepted = accepted_options(method)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"method {method!r} has no option {', '.join(unknown)}; its options are: "
                         + (", ".join(accepted) if accepted else "none"))
    if suffix_cache is not None and not isinstance(suffix_cache, SuffixCache):
        raise ValueError(f"suffix_cache must be a SuffixCache, got {type(suffix_cache).__name__}")
    shared = {SHARED[method]: suffix_cache} if method in SHARED else {}
    try:
        return METHODS[method](**options, **shared)
    except (TypeError, ValueError) as error:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ValueError(f"invalid options for method {method!r} ({given}): {error}") from None
