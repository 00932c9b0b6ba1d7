"""What an adversary sends below the request: idle and trickling sockets, bodies built
to make the parser slow, oversized headers, doubled credentials. The event loop keeps
answering /health quickly throughout, idle sockets never lock a good client out, and
nothing a client sends becomes a 500."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions
from hostile import HOSTILE_BODIES
from live_server import DEADLINE_S, KEY, Server
from tiny_models import save_checkpoint

NAME = "tiny"
HEALTH_BUDGET_S = 0.1  # the event loop's answer to /health, whatever else arrives


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LongSpecModel:
    directory = save_checkpoint(tmp_path_factory.mktemp("connections-model"))
    return LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))


def good_request(server: Server, **headers) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2},
                      headers=headers, timeout=DEADLINE_S)


def open_idle(server: Server, count: int, first_bytes: bytes = b"") -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
        if first_bytes:
            sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_a_thousand_idle_sockets_do_not_stop_a_good_request(model):
    server = Server(model, ServeOptions(model_name=NAME, method="ar"))
    sockets = []
    try:
        sockets = open_idle(server, 500) + open_idle(server, 500, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert good_request(server).status_code == 200
    finally:
        for sock in sockets:
            sock.close()
        server.stop()


def test_at_the_connection_limit_idle_sockets_make_room(model):
    server = Server(model, ServeOptions(model_name=NAME, method="ar"), max_connections=32)
    sockets = []
    try:
        sockets = open_idle(server, 100, b"GET /health HTTP/1.1\r\n")  # a request line, headers never finished
        for _ in range(3):
            assert good_request(server).status_code == 200
        assert closed_by_server(sockets[0], within_s=5)  # the oldest went first
    finally:
        for sock in sockets:
            sock.close()
        server.stop()


def test_a_connection_that_never_finishes_its_headers_is_closed(model):
    server = Server(model, ServeOptions(model_name=NAME, method="ar"), header_timeout_s=1.0)
    try:
        (silent,) = open_idle(server, 1)
        (trickling,) = open_idle(server, 1, b"POST /v1/completions HTTP/1.1\r\n")
        trickling.sendall(b"Ho")
        assert closed_by_server(silent, within_s=5) and closed_by_server(trickling, within_s=5)
        assert good_request(server).status_code == 200  # a real client is not hurried
    finally:
        server.stop()


def _health_latencies(url: str, stop_at: float) -> list[float]:
    latencies = []
    with httpx.Client(timeout=DEADLINE_S) as client:
        while time.monotonic() < stop_at:
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    return latencies




@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_bodies_get_400_while_health_stays_fast(model, name):
    server = Server(model, ServeOptions(model_name=NAME, method="ar"))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            watching = pool.submit(_health_latencies, server.url, time.monotonic() + 1.5)
            time.sleep(0.2)
            response = httpx.post(server.url + "/v1/completions", content=HOSTILE_BODIES[name],
                                  headers={"content-type": "application/json"}, timeout=DEADLINE_S)
            latencies = watching.result()
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "sys." not in message and "int()" not in message and "codec" not in message, message
        assert max(latencies) < HEALTH_BUDGET_S, sorted(latencies)[-3:]
    finally:
        server.stop()


def test_oversized_headers_and_two_authorizations_are_refused(model):
    server = Server(model, ServeOptions(model_name=NAME, method="ar", api_key=KEY))
    try:
        key = {"authorization": f"Bearer {KEY}"}
        assert good_request(server, **key).status_code == 200
        big = good_request(server, **key, **{"x-padding": "p" * (70 << 10)})
        assert big.status_code == 431 and "64" in big.json()["error"]["message"]
        doubled = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2},
                             headers=[("authorization", f"Bearer {KEY}"), ("authorization", "Bearer other")],
                             timeout=DEADLINE_S)
        assert doubled.status_code == 400 and "Authorization headers" in doubled.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_failed_generation_counts_once(model, monkeypatch, stream):
    from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter

    def propose(self, context):
        raise RuntimeError("lookup index corrupted")

    monkeypatch.setattr(PromptLookupDrafter, "propose", propose)
    server = Server(model, ServeOptions(model_name=NAME, method="pld"))
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=DEADLINE_S,
                              json={"model": NAME, "prompt": "hi hi hi", "max_tokens": 5, "stream": stream})
        assert "lookup index corrupted" in response.text
        assert response.status_code == (200 if stream else 500)  # a stream's status is sent before the failure
        assert server.metric('longspec:request_errors_total{status="500"}') == 1
    finally:
        server.stop()
