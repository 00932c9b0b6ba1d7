"""Named decoding methods: the one place where a method name becomes a drafter.

Each entry builds a fresh drafter from keyword options (None means plain
autoregressive decoding). Later drafters register here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from longspec.speculation.drafters import NgramDrafter, PromptLookupDrafter
from longspec.speculation.drafters.base import Drafter
from longspec.speculation.drafters.longspec.presets import LONGSPEC_METHODS
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter


def _autoregressive(**options: Any) -> None:
    if options:
        raise ValueError(f"method 'ar' takes no drafter options, got {sorted(options)}")
    return None


METHODS: dict[str, Callable[..., Drafter | None]] = {
    "ar": _autoregressive,
    "pld": PromptLookupDrafter,
    "ngram": NgramDrafter,
    "tokenswift": TokenSwiftDrafter,
    **LONGSPEC_METHODS,
}


def make_drafter(method: str, **options: Any) -> Drafter | None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    try:
        return METHODS[method](**options)
    except TypeError as error:
        raise ValueError(f"invalid options for method {method!r}: {error}") from error
