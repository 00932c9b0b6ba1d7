"""`longspec serve --ray`: the server's app on Ray Serve replicas answers as `longspec
serve` and offline generation do (completions, chat, streaming, errors), and a replica
killed mid-load gives each in-flight request a response or a clean error, never a hang,
and is replaced. Two replicas of a tiny float32 checkpoint on a local 2-CPU Ray."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest
import torch

serve = pytest.importorskip("ray.serve")
import ray  # noqa: E402

from longspec.api import LongSpecModel  # noqa: E402
from longspec.cli.main import main  # noqa: E402
from longspec.runtime.loading import load_target  # noqa: E402
from longspec.serve import ServeOptions  # noqa: E402
from longspec.serve.ray_deployment import ReplicaSpec, app_builder, deployment  # noqa: E402
from longspec.speculation.engine import EngineOptions  # noqa: E402
from live_server import DEADLINE_S, Server  # noqa: E402
from tiny_models import save_checkpoint  # noqa: E402

NAME = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
PROMPTS = ["the cat sat on the mat. the cat", "a b c a b c a b", "hello hello hello"]
LONG = 1500  # tokens a killed replica's streams are still generating


def options() -> ServeOptions:
    return ServeOptions(model_name=NAME, method="pld", max_new_tokens=LONG, max_prompt_tokens=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ray-model"), chat_template=TEMPLATE, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model(checkpoint) -> LongSpecModel:
    return LongSpecModel(load_target(checkpoint, dtype=torch.float32), EngineOptions(progress=False))


@pytest.fixture(scope="module")
def local(model):
    running = Server(model, options())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def ray_url(checkpoint):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(model=str(checkpoint), dtype="float32", threads=1, suffix_cache_mb=1)
        serve.run(deployment(spec, options(), replicas=2), name="longspec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": NAME, **body}, timeout=DEADLINE_S)


def streamed(url: str, body: dict, path: str = "/v1/completions") -> str:
    text, done = "", False
    with httpx.stream("POST", url + path, json={"model": NAME, **body, "stream": True}, timeout=DEADLINE_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    assert done
    return text


def test_completions_and_chat_equal_longspec_serve_and_offline(ray_url, local, model):
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        served = post(ray_url, body).json()
        assert served == {**post(local.url, body).json(), "id": served["id"], "created": served["created"]}
        assert served["choices"][0]["text"] == model.generate(prompt, max_new_tokens=24, method="pld").text
        assert streamed(ray_url, body) == served["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 16, "temperature": 0, "seed": 3}
    served = post(ray_url, chat, "/v1/chat/completions").json()["choices"][0]["message"]["content"]
    assert served == post(local.url, chat, "/v1/chat/completions").json()["choices"][0]["message"]["content"]
    assert streamed(ray_url, chat, "/v1/chat/completions") == served


def test_errors_and_metrics_pass_through(ray_url):
    wrong = post(ray_url, {"prompt": "a", "max_tokens": LONG + 1})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "max_tokens"
    assert post(ray_url, {"prompt": "a"}, "/v1/nothing").status_code == 404
    assert httpx.get(ray_url + "/health", timeout=DEADLINE_S).json()["status"] == "ok"
    assert "longspec:request_errors" in httpx.get(ray_url + "/metrics", timeout=DEADLINE_S).text


def test_bad_settings_fail_before_work_naming_the_fix(capsys):
    with pytest.raises(ValueError, match="unknown args max_replicas"):
        app_builder({"max_replicas": 3})
    with pytest.raises(ValueError, match="does not exist"):
        ReplicaSpec(model="/no/such/checkpoint")
    with pytest.raises(ValueError, match="suffix"):
        ReplicaSpec(suffix_cache_mb=-1)
    with pytest.raises(ValueError, match="suffix"):
        app_builder({"suffix_cache_mb": -1})
    for flags, fix in ((["--replicas", "2"], "only with --ray"), (["--ray", "--max-connections", "9"], "http_options"),
                       (["--ray", "--autoscale", "3"], "MIN:MAX"), (["--ray", "--replicas", "4096"], "lower --replicas"),
                       (["--ray", "--suffix-cache-mb", "-1"], "suffix")):
        assert main(["serve", "--model", "/no/such/checkpoint", *flags]) == 2
        assert fix in capsys.readouterr().err


def replica_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]}


def test_killed_replica_fails_its_requests_cleanly_and_is_replaced(ray_url, model):
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS[:2]]
    started = concurrent.futures.ThreadPoolExecutor(len(prompts) + 2)
    first_chunk = {p: concurrent.futures.Future() for p in prompts}

    def one(prompt: str):
        body = {"model": NAME, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text = ""
        try:
            with httpx.stream("POST", ray_url + "/v1/completions", json=body, timeout=DEADLINE_S) as reply:
                if reply.status_code != 200:
                    first_chunk[prompt].set_result(None)
                    return ("status", reply.status_code)
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        first_chunk[prompt].done() or first_chunk[prompt].set_result(None)
                        text += json.loads(line[6:])["choices"][0]["text"]
                    elif line == "data: [DONE]":
                        return ("done", text)
                return ("cut", text)  # the stream ended without [DONE]: the client sees it broken off
        except httpx.TransportError as error:  # a dropped connection; a timeout would be a hang
            assert not isinstance(error, httpx.TimeoutException), "a request hung"
            return ("dropped", text)
        finally:
            first_chunk[prompt].done() or first_chunk[prompt].set_result(None)

    def unary(prompt: str):  # not streamed: a 200 or an error status
        body = {"model": NAME, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        try:
            reply = httpx.post(ray_url + "/v1/completions", json=body, timeout=DEADLINE_S)
        except httpx.TransportError as error:
            assert not isinstance(error, httpx.TimeoutException), "a request hung"
            return ("dropped", "")
        return ("done", reply.json()["choices"][0]["text"]) if reply.status_code == 200 else ("status", reply.status_code)

    before = replica_names()
    whole = [f"{PROMPTS[2]} {i}" for i in range(2)]
    futures = [started.submit(unary, p) for p in whole] + [started.submit(one, p) for p in prompts]
    prompts = whole + prompts
    concurrent.futures.wait(first_chunk.values(), timeout=DEADLINE_S)
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    outcomes = [f.result(timeout=2 * DEADLINE_S) for f in futures]
    started.shutdown()
    assert any(kind != "done" for kind, _ in outcomes), f"the kill hit no request: {outcomes}"
    for prompt, (kind, text) in zip(prompts, outcomes):
        assert kind in ("done", "cut", "dropped") or (kind == "status" and text >= 500), (kind, text)
        if kind == "done":  # a survivor's stream is whole and exact
            assert text == model.generate(prompt, max_new_tokens=LONG, method="pld", ignore_eos=True).text
    deadline = time.monotonic() + 2 * DEADLINE_S
    while not (len(replica_names()) == 2 and victim not in replica_names()
               and serve.status().applications["longspec"].status == "RUNNING"):
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    for _ in range(4):  # both replicas answer
        assert post(ray_url, {"prompt": "hello", "max_tokens": 4, "temperature": 0}).status_code == 200
