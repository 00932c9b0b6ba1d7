"""What a request may weigh, checked before the server does work for it: the body's
bytes and the time to send them, JSON nesting, the number of messages, the length of
stop strings and of a token-id prompt. Each refusal names the limit and the flag that
sets it (`longspec serve --help`)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the CLI reads the defaults without the serve extra installed
    from fastapi import Request


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 8 << 20  # a 128k-token prompt as text is ~0.5 MB; as token ids ~1 MB
    body_timeout_s: float = 30.0  # to send the whole body (slow clients hold a connection and a task)
    max_messages: int = 512
    max_stop_chars: int = 256  # streamed text is held back by the longest stop string less one character
    max_json_depth: int = 32  # OpenAI's request shapes nest a few levels

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_stop_chars", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")


class LimitError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


async def read_body(request: "Request", limits: RequestLimits) -> bytes:
    """The body, refused (413) past `max_body_bytes` — by its Content-Length before
    reading, or while reading it — and (408) when it takes longer than
    `body_timeout_s` to arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise LimitError(413, f"the body has {int(declared):,} bytes, more than this server's limit of "
                              f"{limits.max_body_bytes:,} (--max-body-bytes)", "request_too_large")
    deadline = time.monotonic() + limits.body_timeout_s
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout=max(deadline - time.monotonic(), 0.0))
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise LimitError(408, f"the body did not arrive within {limits.body_timeout_s:g} s", "request_timeout") from None
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise LimitError(413, f"the body exceeds this server's limit of {limits.max_body_bytes:,} bytes "
                                  "(--max-body-bytes)", "request_too_large")
        chunks.append(chunk)


# A string literal, or an unterminated one to the end of the text: possessive, so each
# character is read once (a backtracking pattern re-scans from every quote of an
# unterminated string, quadratic in the body: a 96 KB body held the event loop 57 s).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")], _DEPTH_STEP[list(b"]}")] = 1, -1
MAX_NUMBER_DIGITS = 64  # no field takes more (a seed is at most 20 digits); past it, int() costs quadratic time


def json_depth_problem(text: str, limit: int) -> str | None:
    """A message when `text` nests arrays or objects deeper than `limit`, found without
    parsing (a recursive parser would overflow its stack on hostile nesting): the
    brackets outside string literals, counted in linear time."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub("", text).encode("utf-8", "surrogatepass"))
    if not brackets:
        return None
    depth = np.cumsum(_DEPTH_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64)
    if int(depth.max()) > limit:
        return f"the body nests arrays or objects more than {limit} levels deep"
    return None


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise LimitError(400, f"the body has a number of {len(digits.lstrip('-')):,} digits; no field takes more than "
                              f"{MAX_NUMBER_DIGITS}", "invalid_body")
    return int(digits)


def parse_json(raw: bytes, limits: RequestLimits):
    """The body as JSON, refused with the reason (not UTF-8, not JSON, nested too deeply,
    an integer of absurd length, a string that is not Unicode). Seconds of work for a
    large body: call it off the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LimitError(400, f"the body is not UTF-8 (byte {error.start})", "invalid_body") from None
    problem = json_depth_problem(text, limits.max_json_depth)
    if problem:
        raise LimitError(400, problem, "invalid_body")
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as error:
        raise LimitError(400, f"the body is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})",
                         "invalid_body") from None
    except RecursionError:  # unreachable past the depth check; kept so that no nesting becomes a 500
        raise LimitError(400, "the body nests too deeply", "invalid_body") from None
    lone = _lone_surrogate(data)
    if lone is not None:
        raise LimitError(400, f"the body has a string with a lone UTF-16 surrogate (\\u{lone:04x}), which is not "
                              "Unicode text: escape characters outside the Basic Multilingual Plane as surrogate pairs",
                         "invalid_body")
    return data


def _lone_surrogate(data) -> int | None:
    """The first unpaired surrogate in the body's strings (JSON escapes may spell one;
    no tokenizer can encode it), or None."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings = (item,)
        elif isinstance(item, dict):
            strings = item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for string in strings:
            match = _SURROGATE.search(string)
            if match:
                return ord(match.group())
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")
