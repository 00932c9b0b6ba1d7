"""A request's own failure stays its own: an exception in one row's drafter (begin,
propose, observe) or in its sampling fails that row alone, with its cause; the other
rows finish with exactly the tokens they get alone. Through a live server: the failing
request gets an error naming its cause, a neighbour streaming beside it completes with
its offline output and a [DONE], and a dead generation thread turns /health and new
requests into 503s instead of hanging them."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
import torch

from live_server import DEADLINE_S, KEY, Server
from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.engine import EngineOptions, SpeculativeEngine
from longspec.speculation.processors import SamplingParams
from tiny_models import random_ids, save_checkpoint, tiny_decoder

OPTIONS = EngineOptions(progress=False, max_tree_nodes=8, prefill_chunk=16)


class Failing(PromptLookupDrafter):
    """Prompt lookup that raises in `where` ("begin", "propose" or "observe") on its
    `at`-th call there."""

    def __init__(self, where: str, at: int = 3) -> None:
        super().__init__(num_tokens=4)
        self.where, self.at, self.calls = where, at, 0

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError(f"drafter broke in {where}")

    def begin(self, context):
        self._tick("begin")
        super().begin(context)

    def propose(self, context):
        self._tick("propose")
        return super().propose(context)

    def observe(self, committed):
        self._tick("observe")
        super().observe(committed)


def alone(model, prompt, **kwargs) -> torch.Tensor:
    return torch.cat(list(SpeculativeEngine(model, OPTIONS).generate(prompt, **kwargs)))


@pytest.mark.parametrize("where,at", [("begin", 1), ("propose", 3), ("observe", 2)])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_failing_drafter_fails_its_row_alone(family, where, at):
    model = tiny_decoder(family, dtype=torch.float64)
    prompts = [random_ids(6, seed=s)[0].repeat(3) for s in range(3)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=3, row_capacity=256))
    handles = [
        engine.submit(prompts[0], max_new_tokens=30, drafter=PromptLookupDrafter(num_tokens=4)),
        engine.submit(prompts[1], max_new_tokens=30, drafter=Failing(where, at)),
        engine.submit(prompts[2], max_new_tokens=30, params=seeded, generator=torch.Generator().manual_seed(5),
                      drafter=PromptLookupDrafter(num_tokens=4)),
    ]
    engine.run()
    failed = handles[1]
    assert failed.finished and failed.stats.stop_reason == "error"
    assert isinstance(failed.error, RuntimeError) and f"broke in {where}" in str(failed.error)
    assert torch.equal(handles[0].tokens, alone(model, prompts[0], max_new_tokens=30))
    assert torch.equal(handles[2].tokens, alone(model, prompts[2], max_new_tokens=30, params=seeded,
                                                generator=torch.Generator().manual_seed(5)))
    assert engine.cache.bytes_in_use() == 0  # every row released, the failed one too


def test_a_failure_in_sampling_fails_its_row_alone(monkeypatch):
    """The verifier raising for one row (as a sampling op would on values it cannot take)."""
    from longspec.speculation import decode_round

    model = tiny_decoder("qwen3", dtype=torch.float64)
    prompts = [random_ids(9, seed=s)[0] for s in (1, 2)]
    broken = SamplingParams(temperature=0.7, top_k=7)
    original = decode_round.verify

    def verify(tree, logits, histories, params, generator):
        if params is broken:
            raise RuntimeError("the sampling op refused its input")
        return original(tree, logits, histories, params, generator)

    monkeypatch.setattr(decode_round, "verify", verify)
    engine = BatchEngine(model, OPTIONS, BatchOptions(max_rows=2, row_capacity=128))
    good = engine.submit(prompts[0], max_new_tokens=20, drafter=PromptLookupDrafter())
    bad = engine.submit(prompts[1], max_new_tokens=20, params=broken, generator=torch.Generator().manual_seed(1))
    engine.run()
    assert bad.stats.stop_reason == "error" and "refused its input" in str(bad.error)
    monkeypatch.setattr(decode_round, "verify", original)
    assert torch.equal(good.tokens, alone(model, prompts[0], max_new_tokens=20))


def test_one_sequence_still_raises_at_once():
    model = tiny_decoder("llama", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="broke in propose"):
        alone(model, random_ids(6, seed=1)[0].repeat(3), max_new_tokens=30, drafter=Failing("propose", 2))


# ------------------------------------------------------------------ through the server
NAME = "tiny"
PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LongSpecModel:
    directory = save_checkpoint(tmp_path_factory.mktemp("row-failures"), max_position_embeddings=1 << 14)
    return LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))


def test_a_request_whose_drafter_fails_does_not_fail_its_neighbour(model, monkeypatch):
    """The failing request is chosen by its prompt (a marker the patched drafter looks for)."""
    marker = model.encode("#").tolist()[0]
    original = PromptLookupDrafter.propose

    def propose(self, context):
        if marker in context.tokens.tolist():
            raise RuntimeError("lookup index corrupted")
        return original(self, context)

    monkeypatch.setattr(PromptLookupDrafter, "propose", propose)
    server = Server(model, ServeOptions(model_name=NAME, method="pld", max_batch=4, max_new_tokens=400))
    try:
        expected = model.generate(PROMPT, method="ar", max_new_tokens=300, ignore_eos=False).text

        def neighbour() -> tuple[str, bool]:
            text, done = [], False
            with httpx.stream("POST", server.url + "/v1/completions", timeout=DEADLINE_S,
                              json={"model": NAME, "prompt": PROMPT, "max_tokens": 300, "temperature": 0,
                                    "stream": True}) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        text.append(event["choices"][0]["text"])
            return "".join(text), done

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(neighbour)
            failing = httpx.post(server.url + "/v1/completions", timeout=DEADLINE_S,
                                 json={"model": NAME, "prompt": "# " + PROMPT, "max_tokens": 50, "temperature": 0})
            text, done = streaming.result(timeout=DEADLINE_S)
        assert failing.status_code == 500 and "lookup index corrupted" in failing.json()["error"]["message"]
        assert done and text == expected
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_a_dead_generation_thread_fails_health_and_new_requests_with_503(model, monkeypatch):
    server = Server(model, ServeOptions(model_name=NAME, method="ar", api_key=KEY))
    try:
        worker = server.app.state.state["worker"]

        def die(*args, **kwargs):
            raise SystemError("the generation loop broke")

        monkeypatch.setattr(worker, "_admit", die)
        worker._thread.join(DEADLINE_S)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        refused = httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                             json={"model": NAME, "prompt": PROMPT, "max_tokens": 5}, timeout=DEADLINE_S)
        assert refused.status_code == 503 and "restart the server" in refused.json()["error"]["message"]
    finally:
        server.stop()
