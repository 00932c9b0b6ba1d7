"""Connections that send nothing cannot lock clients out.

uvicorn closes an idle kept-alive connection, but not one that never finishes its
request line and headers, and its connection limit counts such sockets: 256 idle or
trickling connections used to turn every request away for a minute. This protocol
gives each connection `header_timeout_s` to deliver a request's headers (from its
opening, and again after each response), and at the connection limit it makes room by
closing the connections that are only waiting for headers, oldest first, instead of
refusing the newcomer. Requests being served are never closed; when every connection is
busy the newcomer gets a 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from longspec.serve.errors import RETRY_AFTER_S, error_body

HEADER_TIMEOUT_S = 10.0


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened = time.monotonic()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_timer.cancel()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    @property
    def waiting_for_headers(self) -> bool:
        """No request of this connection is being served: before its first request's
        headers, or between requests."""
        return self.cycle is None or self.cycle.response_complete

    def _headers_overdue(self) -> None:
        if self.waiting_for_headers and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        idle = sorted((c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                       and c.waiting_for_headers and not c.transport.is_closing()), key=lambda c: c.opened)
        excess = len(self.connections) - self.max_connections
        for connection in idle[:excess]:
            connection.transport.close()
        if excess > len(idle):
            body = json.dumps(error_body(f"the server holds its limit of {self.max_connections} connections, every "
                                         "one serving a request; retry shortly", "server_error",
                                         code="service_unavailable")).encode()
            self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                                 b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (RETRY_AFTER_S, len(body), body))
            self.transport.close()


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int | None = None) -> type:
    """The protocol class for uvicorn's `http=` with these limits."""
    if not header_timeout_s > 0:
        raise ValueError(f"the header timeout must be > 0 seconds, got {header_timeout_s}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


def raise_open_file_limit() -> int:
    """The soft limit on open files raised to the hard one (idle sockets are files: at
    1,024 the accept loop stalls); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def uvicorn_config(app, *, host: str, port: int, max_connections: int | None = 4096,
                   header_timeout_s: float = HEADER_TIMEOUT_S, log_level: str = "warning"):
    """uvicorn's configuration as `longspec serve` runs it. Idle keep-alive connections
    close after 5 s, headers are capped at 64 KiB (h11 on incomplete data; `guard.py`
    on complete ones). No WebSocket protocol: no route takes one, and loading it cost
    the start a fifth of a second."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                          h11_max_incomplete_event_size=64 << 10, ws="none",
                          http=guarded_protocol(header_timeout_s, max_connections))
