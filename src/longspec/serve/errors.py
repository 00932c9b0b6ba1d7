"""The server's refusals as OpenAI-style errors: the status a client expects, the field
at fault, a code, and the headers that tell a client what to do (`Retry-After`)."""

from __future__ import annotations

from collections.abc import Mapping

RETRY_AFTER_S = 1  # what a 429 or 503 asks a client to wait: rows free up in a few rounds


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = dict(headers or {})


def busy(message: str) -> RequestError:
    """429: at the concurrency limit, worth retrying soon."""
    return RequestError(429, message, kind="rate_limit_error", code="too_many_requests",
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str) -> RequestError:
    """503: the generation thread has stopped; nothing is served until a restart."""
    return RequestError(503, message, kind="server_error", code="service_unavailable")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
