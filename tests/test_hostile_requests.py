"""Hostile requests (tests/hostile.py) against a live server on loopback: each gets its
status and a message naming the problem, none reveals the server's files, and a
greedy stream running beside each one completes with exactly the tokens it gets alone.
Clients that vanish free their rows (non-streaming ones too); the API key guards the
schema; the CLI runs without the serve extra."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from hostile import BODY_LIMIT, BODY_TIMEOUT_S, CASES, MODEL, PROMPT_LIMIT, reveals_server_paths, send
from live_server import DEADLINE_S, KEY, Server
from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.serve.limits import RequestLimits
from longspec.speculation.engine import EngineOptions
from tiny_models import save_checkpoint

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
NEIGHBOUR_PROMPT = "the cat sat on the mat. the cat sat on the"
NEIGHBOUR_TOKENS = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LongSpecModel:
    directory = save_checkpoint(tmp_path_factory.mktemp("hostile"), chat_template=TEMPLATE,
                                max_position_embeddings=1 << 14)
    return LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))


@pytest.fixture(scope="module")
def server(model):
    running = Server(model, ServeOptions(model_name=MODEL, method="pld", max_prompt_tokens=PROMPT_LIMIT,
                                         max_new_tokens=512, max_concurrent=64,
                                         limits=RequestLimits(max_body_bytes=BODY_LIMIT, body_timeout_s=BODY_TIMEOUT_S)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def neighbour_text(model) -> str:
    return model.generate(NEIGHBOUR_PROMPT, method="pld", max_new_tokens=NEIGHBOUR_TOKENS, ignore_eos=False).text


def stream_neighbour(url: str) -> tuple[str, bool]:
    text, done = [], False
    with httpx.stream("POST", url + "/v1/completions", timeout=DEADLINE_S,
                      json={"model": MODEL, "prompt": NEIGHBOUR_PROMPT, "max_tokens": NEIGHBOUR_TOKENS,
                            "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text), done


def test_there_are_at_least_forty_hostile_requests():
    assert len(CASES) >= 40 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_hostile_request_gets_its_status_and_its_neighbour_is_untouched(server, neighbour_text, case):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        neighbour = pool.submit(stream_neighbour, server.url)
        status, text, _ = send(server.url, case, timeout_s=DEADLINE_S)
        streamed, done = neighbour.result(timeout=DEADLINE_S)
    assert status == case.status, text[:500]
    if case.status != 405 or text:
        assert case.fragment in text, text[:500]
        if text.strip().startswith("{"):
            assert "error" in json.loads(text), text[:500]
    assert not reveals_server_paths(text), text[:500]
    assert done and streamed == neighbour_text
    assert httpx.get(server.url + "/health", timeout=DEADLINE_S).json()["status"] == "ok"


def wait_until_idle(server: Server) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while httpx.get(server.url + "/health", timeout=DEADLINE_S).json()["requests_in_flight"]:
        assert time.monotonic() < deadline, "a request whose client left is still running"
        time.sleep(0.05)


def test_a_non_streaming_request_whose_client_left_is_cancelled(model):
    long_running = Server(model, ServeOptions(model_name=MODEL, method="ar", max_new_tokens=15000))
    try:
        with pytest.raises(httpx.ReadTimeout):  # seconds of generation; the client leaves after one
            httpx.post(long_running.url + "/v1/completions", timeout=1.0,
                       json={"model": MODEL, "prompt": NEIGHBOUR_PROMPT, "max_tokens": 15000, "temperature": 0,
                             "stop": "never"})
        wait_until_idle(long_running)
        assert long_running.metric("longspec:request_cancelled_total") == 1
        assert long_running.metric("longspec:request_success_total") == 0
    finally:
        long_running.stop()


def test_the_schema_is_behind_the_key_and_an_empty_key_is_refused(model):
    with pytest.raises(ValueError, match="empty"):
        ServeOptions(model_name=MODEL, api_key="  ")
    guarded = Server(model, ServeOptions(model_name=MODEL, api_key=KEY))
    try:
        assert httpx.get(guarded.url + "/openapi.json").status_code == 401
        assert httpx.get(guarded.url + "/openapi.json", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(guarded.url + "/docs", headers={"authorization": f"Bearer {KEY}"}).status_code == 404
    finally:
        guarded.stop()


def test_the_api_key_comes_from_one_source(tmp_path, monkeypatch):
    from longspec.cli.serve import API_KEY_VARIABLE, resolve_api_key

    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert resolve_api_key(None, str(key_file)) == "sk-from-file"
    assert resolve_api_key("sk-flag", None) == "sk-flag"
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv(API_KEY_VARIABLE, "sk-env")
    assert resolve_api_key(None, None) == "sk-env"
    with pytest.raises(ValueError, match="given 2 ways"):
        resolve_api_key("sk-flag", None)
    monkeypatch.delenv(API_KEY_VARIABLE)
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, str(key_file))


def test_the_cli_runs_without_the_serve_extra():
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
            "from longspec.cli.main import main; main(['--help'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, result.stderr


def test_the_served_document_drives_schemathesis_to_no_5xx_and_no_undocumented_response(server):
    """Property-based requests generated from the served OpenAPI document (bounded):
    every answer is documented (status, content type, body schema) and none is a 5xx."""
    command = shutil.which("schemathesis")
    if command is None:
        pytest.skip("schemathesis is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "serving"))
    from serve_hostile import SCHEMA_CHECKS

    result = subprocess.run([command, "run", server.url + "/openapi.json", *SCHEMA_CHECKS, "--max-examples", "10",
                             "--request-timeout", str(DEADLINE_S), "--seed", "1"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-6000:]
