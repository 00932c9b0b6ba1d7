"""Plain ASGI middleware in front of every route: the request's header block within
`MAX_HEADER_BYTES` (431), one `Authorization` header at most (two could be read
differently by a proxy and by us), and with a key configured, 'Authorization: Bearer
KEY' on every path but /health (401). Everything else passes through untouched,
disconnects and streams included."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from longspec.serve.errors import error_body
from longspec.serve.metrics import ServerMetrics

MAX_HEADER_BYTES = 64 << 10  # what the docs promise; the HTTP parser's own cap is on incomplete data only


class RequestGuard:
    def __init__(self, app, *, key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.expected = None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                status, body = refusal
                self.metrics.errors.labels(status=str(status)).inc()
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, dict] | None:
        headers = scope["headers"]
        size = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
        if size > MAX_HEADER_BYTES:
            return 431, error_body(f"the request's headers take {size:,} bytes, more than this server's limit of "
                                   f"{MAX_HEADER_BYTES >> 10} KiB", code="headers_too_large")
        given = [value for name, value in headers if name == b"authorization"]
        if len(given) > 1:
            return 400, error_body(f"the request has {len(given)} Authorization headers: send one",
                                   code="duplicate_authorization")
        if self.expected is not None and scope["path"] != "/health":
            if not secrets.compare_digest(given[0] if given else b"", self.expected):
                return 401, error_body("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                       "authentication_error", code="invalid_api_key")
        return None
