"""Argument checks drafters share."""

from __future__ import annotations


def check_positive_int(name: str, value: object, minimum: int) -> int:
    """`value` itself when it is an int >= `minimum` (bools refused), else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
