"""Which drafter options an HTTP request may set, with their types and bounds.

The CLI and the Python API take every option a drafter has (`methods.accepted_options`);
a request over HTTP takes only the options listed here. What loads files or models
(`checkpoint`, `heads`, `model`, ...) is the server's configuration
(`longspec serve --method-option METHOD:KEY=VALUE`), never a request field: a request
could otherwise read the server's disk or start downloads. Every bound keeps a request's
memory and work near what the default options cost; values outside them are refused
before the request is admitted, naming the option and its range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from longspec.speculation.presets.auto import COMPONENTS, POLICIES
from longspec.speculation.methods import METHODS, accepted_options


@dataclass(frozen=True)
class ServerLimits:
    """What the bounds that depend on the server scale with."""

    prompt_tokens: int  # the longest prompt the server admits


class OptionError(ValueError):
    """A request option that is not allowed or out of bounds."""


Bound = int | float | Callable[[ServerLimits], int]


def _resolve(bound: Bound, limits: ServerLimits) -> int | float:
    return bound(limits) if callable(bound) else bound


@dataclass(frozen=True)
class Integer:
    low: int
    high: Bound
    none_allowed: bool = False

    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        if value is None and self.none_allowed:
            return None
        high = _resolve(self.high, limits)
        if isinstance(value, bool) or not isinstance(value, int):
            raise OptionError(f"method_options.{name} must be an integer in [{self.low}, {high}], got {value!r}")
        if not self.low <= value <= high:
            raise OptionError(f"method_options.{name} must be in [{self.low}, {high}], got {value}")
        return value


@dataclass(frozen=True)
class Real:
    low: float
    high: float
    low_open: bool = False  # the low end itself is refused

    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        low_bracket = "(" if self.low_open else "["
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise OptionError(f"method_options.{name} must be a number in {low_bracket}{self.low}, {self.high}], "
                              f"got {value!r}")
        if value < self.low or value > self.high or (self.low_open and value == self.low):
            raise OptionError(f"method_options.{name} must be in {low_bracket}{self.low}, {self.high}], got {value}")
        return float(value)


@dataclass(frozen=True)
class Flag:
    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        if not isinstance(value, bool):
            raise OptionError(f"method_options.{name} must be true or false, got {value!r}")
        return value


@dataclass(frozen=True)
class Choice:
    choices: tuple[Any, ...]

    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        if isinstance(value, bool) or value not in self.choices:
            raise OptionError(f"method_options.{name} must be one of {list(self.choices)}, got {value!r}")
        return value


@dataclass(frozen=True)
class Widths:
    """Candidates per depth of a tree: a list of small integers whose tree stays small.
    `nodes` counts the tree the widths describe (a Cartesian product per depth, or
    one beam of each width)."""

    max_depth: int
    max_width: int
    max_nodes: int
    nodes: Callable[[Sequence[int]], int]

    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        if not isinstance(value, list) or not value or len(value) > self.max_depth:
            raise OptionError(f"method_options.{name} must be a list of 1 to {self.max_depth} integers, got {value!r}")
        for width in value:
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= self.max_width:
                raise OptionError(f"method_options.{name}: every width must be an integer in [1, {self.max_width}], "
                                  f"got {width!r}")
        nodes = self.nodes(value)
        if nodes > self.max_nodes:
            raise OptionError(f"method_options.{name}={value} describes a tree of {nodes} nodes; at most "
                              f"{self.max_nodes} over HTTP")
        return tuple(value)


@dataclass(frozen=True)
class Names:
    """A list (or comma-separated string) of distinct names from a fixed set."""

    choices: tuple[str, ...]

    def check(self, name: str, value: Any, limits: ServerLimits) -> Any:
        names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise OptionError(f"method_options.{name} must be a list of names from {list(self.choices)}, got {value!r}")
        unknown = [n for n in names if n not in self.choices]
        if unknown:
            raise OptionError(f"method_options.{name}: unknown {unknown}; choose from {list(self.choices)}")
        if len(set(names)) != len(names):
            raise OptionError(f"method_options.{name} names a component twice: {names}")
        return tuple(names)


def _cartesian_nodes(widths: Sequence[int]) -> int:
    nodes, level = 0, 1
    for width in widths:
        level *= width
        nodes += level
    return nodes


def _beam_nodes(widths: Sequence[int]) -> int:
    return sum(widths)


def _prompt(limits: ServerLimits) -> int:
    return limits.prompt_tokens


# Cache sizes of the self-drafting methods: a partial cache is never larger than the
# longest prompt the server takes.
_PARTIAL_CACHE = {
    "budget": Integer(1, _prompt, none_allowed=True),
    "budget_fraction": Real(0.0, 1.0, low_open=True),
    "min_budget": Integer(1, _prompt),
    "sinks": Integer(0, 1024),
    "forward_chunk": Integer(1, 512),
}
_HEAD_TREE = {
    "widths": Widths(max_depth=8, max_width=16, max_nodes=512, nodes=_cartesian_nodes),
    "k": Integer(0, 64),
    "ngram": Integer(1, 8),
}
_LONGSPEC = {
    "length": Integer(1, 16),
    "widths": Widths(max_depth=16, max_width=16, max_nodes=256, nodes=_beam_nodes),
    "temperature": Real(0.0, 10.0, low_open=True),
    "retrieval": Choice((None, "pld", "ngram")),
    "retrieval_nodes": Integer(1, 64),
    "retrieval_streak": Integer(0, 64, none_allowed=True),
    "seed": Integer(0, 2**63 - 1, none_allowed=True),
    "context_vocab": Flag(),
}

REQUEST_OPTIONS: dict[str, dict[str, Any]] = {
    "ar": {},
    "pld": {
        "num_tokens": Integer(1, 64), "min_ngram": Integer(1, 8), "max_ngram": Integer(1, 8),
        "max_candidates": Integer(1, 8), "continue_copies": Flag(), "longest_run": Flag(),
    },
    "ngram": {"n": Integer(1, 8), "k": Integer(1, 64)},
    "suffix": {"num_tokens": Integer(1, 64), "max_candidates": Integer(1, 8)},  # its cache is the server's
    "tokenswift": {**_PARTIAL_CACHE, **_HEAD_TREE, "dynamic_cache": Flag()},
    "tokenswift-onepass": {**_HEAD_TREE, "context_vocab": Flag()},
    "medusa": {**_HEAD_TREE, "context_vocab": Flag()},
    "magicdec": {**_PARTIAL_CACHE, "length": Integer(1, 32)},
    "triforce": {**_PARTIAL_CACHE, "length": Integer(1, 32)},
    **{name: dict(_LONGSPEC) for name in METHODS if name.startswith("longspec")},
    "draft-model": {"length": Integer(1, 16), "sample": Flag(), "temperature": Real(0.0, 10.0, low_open=True),
                    "prefill_chunk": Integer(1, 4096)},
    "mamba": {"widths": Widths(max_depth=16, max_width=16, max_nodes=512, nodes=_cartesian_nodes),
              "exploration": Real(0.0, 100.0)},
    "auto": {"components": Names(tuple(COMPONENTS)), "policy": Choice(tuple(POLICIES)), "probe_every": Integer(1, 4096)},
}


def server_only_options(method: str) -> list[str]:
    """The options of `method` that only the server's configuration may set."""
    return [name for name in accepted_options(method) if name not in REQUEST_OPTIONS[method]]


def check_request_options(method: str, options: Mapping[str, Any] | None, limits: ServerLimits) -> dict[str, Any]:
    """The request's options for `method`, checked and normalised (lists of widths become
    tuples); raises OptionError naming the first option that is not allowed."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise OptionError(f"method_options must be an object of drafter options, got {type(options).__name__}")
    rules = REQUEST_OPTIONS[method]
    checked = {}
    for name, value in options.items():
        if name not in rules:
            if name in accepted_options(method):
                raise OptionError(f"method_options.{name} is set by the server's configuration, not by requests "
                                  f"(`longspec serve --method-option {method}:{name}=...`)")
            allowed = ", ".join(rules) or "none"
            raise OptionError(f"method {method!r} has no option {name} (the options a request may set: {allowed})")
        checked[name] = rules[name].check(name, value, limits)
    return checked
