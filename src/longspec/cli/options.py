"""`KEY=VALUE` drafter options on the command line (`generate --option`, `bench --option`)."""

from __future__ import annotations

import json
from typing import Any


def parse_option(spec: str, example: str) -> tuple[str, Any]:
    """'KEY=VALUE' -> (KEY, VALUE), VALUE read as JSON when it parses (5, 0.5, true,
    [2,4]) and as a string otherwise (a path)."""
    key, eq, raw = spec.partition("=")
    if not (eq and key):
        raise ValueError(f"--option {spec!r}: write {example}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
