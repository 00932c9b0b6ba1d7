"""A real `longspec serve` app on uvicorn on a free loopback port, in a thread, for
the server tests (the official `openai` client talks to it)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import uvicorn

from longspec.api import LongSpecModel
from longspec.serve import ServeOptions, create_app
from longspec.serve.connections import uvicorn_config

KEY = "sk-test-key"
DEADLINE_S = 60


class Server:
    """A real uvicorn server on a free loopback port, in a thread."""

    def __init__(self, model: LongSpecModel, options: ServeOptions, **connections) -> None:
        """`connections`: `uvicorn_config`'s connection limits (header timeout, max connections)."""
        self.app = create_app(model, options)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(self.app, host="127.0.0.1", port=self.port, log_level="error",
                                                    **connections))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=DEADLINE_S, **kwargs)

    def metric(self, name: str, headers=None) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=DEADLINE_S).text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
        return sum(values)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=DEADLINE_S)
