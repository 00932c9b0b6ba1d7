"""Distinct-n: the share of distinct n-grams among all n-grams of a text — the
repetition measure TokenSwift reports beside speed."""

from __future__ import annotations

from collections.abc import Sequence


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """|distinct n-grams| / |n-grams| of ``tokens`` (0.0 when shorter than n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    tokens = [int(t) for t in tokens]
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total
