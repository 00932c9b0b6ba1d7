"""Options shared by several commands: `KEY=VALUE` drafter options (`generate --option`,
`bench --option`) and `--device`."""

from __future__ import annotations

import json
from typing import Any


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default=None,
                        help="where the model computes: cpu (default), cuda or cuda:N; refused before loading "
                             "weights when the device is missing or cannot compute in --dtype")


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
