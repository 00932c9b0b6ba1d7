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


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth_problem(text: str, limit: int) -> str | None:
    """A message when `text` nests arrays or objects deeper than `limit`, found without
    parsing (a recursive parser would overflow its stack on hostile nesting): the
    brackets outside string literals, counted."""
    depth = 0
    for bracket in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > limit:
            return f"the body nests arrays or objects more than {limit} levels deep"
    return None


def parse_json(raw: bytes, limits: RequestLimits):
    """The body as JSON, refused with the reason (not UTF-8, not JSON, nested too deeply)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LimitError(400, f"the body is not UTF-8 (byte {error.start})", "invalid_body") from None
    problem = json_depth_problem(text, limits.max_json_depth)
    if problem:
        raise LimitError(400, problem, "invalid_body")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise LimitError(400, f"the body is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})",
                         "invalid_body") from None
