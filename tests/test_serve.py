"""`longspec serve` on loopback with the official `openai` client: completions and
chat, sync and streaming, equal to offline generation; malformed requests get the
right status and the server keeps serving; the API key; the concurrency limit;
clients that disconnect mid-stream leave nothing in flight; 16 concurrent clients.
A tiny checkpoint with a character tokenizer keeps all of it to seconds."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
import torch

from longspec.api import LongSpecModel
from longspec.runtime.loading import load_target
from longspec.serve import ServeOptions, create_app
from longspec.speculation.engine import EngineOptions
from live_server import DEADLINE_S, KEY, Server
from tiny_models import save_checkpoint

NAME = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LongSpecModel:
    directory = save_checkpoint(tmp_path_factory.mktemp("serve-model"), chat_template=TEMPLATE,
                                max_position_embeddings=1 << 16)  # long streams: seconds, not milliseconds
    return LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))


@pytest.fixture(scope="module")
def server(model):
    running = Server(model, ServeOptions(model_name=NAME, method="pld", max_concurrent=64, max_new_tokens=LONG,
                                         max_prompt_tokens=1000))
    yield running
    running.stop()


PROMPT = "the cat sat on the mat. the cat sat on the"
LONG = 60_000  # tokens: a stream that lasts far longer than any test step


def offline(model, prompt_ids, **kwargs):
    return model.generate(prompt_ids, method="pld", ignore_eos=False, **kwargs)


# ------------------------------------------------------------------ happy paths
def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_greedy_completion_equals_offline_generation_sync_and_streaming(server, model):
    client = server.client()
    reference = offline(model, model.encode(PROMPT), max_new_tokens=40, temperature=0.0)
    result = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    assert result.choices[0].text == reference.text
    assert result.usage.completion_tokens == len(reference.token_ids)
    assert result.usage.prompt_tokens == len(PROMPT)
    assert result.choices[0].finish_reason == ("length" if len(reference.token_ids) == 40 else "stop")
    pieces, usage = [], None
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == reference.text
    assert usage.completion_tokens == len(reference.token_ids)
    # Token ids as the prompt, too.
    ids = model.encode(PROMPT).tolist()
    assert client.completions.create(model=NAME, prompt=ids, max_tokens=40, temperature=0).choices[0].text == reference.text


def test_chat_equals_offline_generation_sync_and_streaming(server, model):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say cat cat cat"}]
    reference = offline(model, model.encode_chat(messages), max_new_tokens=30, temperature=0.0)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert reply.choices[0].message.content == reference.text and reply.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_and_per_request_method(server, model):
    client = server.client()
    runs = [client.completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.9, seed=7,
                                      extra_body={"method": method, "method_options": options}).choices[0].text
            for method, options in (("ar", None), ("pld", {"num_tokens": 4}), ("ngram", {"k": 3}))]
    assert runs[0] == runs[1] == runs[2]  # deterministic candidates make one draw per token: one seed, one output
    assert runs[0] == offline(model, model.encode(PROMPT), max_new_tokens=30, temperature=0.9, top_p=0.9, seed=7).text


def test_metrics_report_speculation(server):
    client = server.client()
    client.completions.create(model=NAME, prompt=PROMPT * 3, max_tokens=30, temperature=0)
    assert server.metric("longspec:generation_tokens_total") > 0
    assert server.metric("longspec:spec_decode_num_draft_tokens_total") > 0
    assert server.metric("longspec:spec_decode_num_accepted_tokens_per_pos_total") > 0
    assert server.metric("longspec:time_to_first_token_seconds_count") > 0
    assert server.metric("longspec:num_requests_running") == 0


# -------------------------------------------------------------------- refusals
BAD_REQUESTS = [
    # (name, content type, body, status, message fragment)
    ("truncated JSON", "application/json", b'{"model": "tiny", "prompt": "hi"', 400, "not valid JSON"),
    ("not an object", "application/json", b'["tiny", "hi"]', 400, "must be a JSON object"),
    ("non-UTF-8 body", "application/json", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "not UTF-8"),
    ("wrong content type", "text/plain", b'{"model": "tiny", "prompt": "hi"}', 415, "Content-Type: application/json"),
    ("missing prompt", "application/json", {"model": NAME}, 400, "prompt: Field required"),
    ("missing model", "application/json", {"prompt": "hi"}, 400, "model: Field required"),
    ("temperature as text", "application/json", {"model": NAME, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("negative temperature", "application/json", {"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("negative max_tokens", "application/json", {"model": NAME, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("fractional max_tokens", "application/json", {"model": NAME, "prompt": "hi", "max_tokens": 4.5}, 400, "max_tokens"),
    ("huge max_tokens", "application/json", {"model": NAME, "prompt": "hi", "max_tokens": 10**9}, 400,
     f"exceeds this server's limit of {LONG}"),
    ("top_p zero", "application/json", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("unknown method", "application/json", {"model": NAME, "prompt": "hi", "method": "magic"}, 400, "unknown method 'magic'"),
    ("bad method option", "application/json", {"model": NAME, "prompt": "hi", "method": "pld",
                                                "method_options": {"bogus": 1}}, 400, "has no option bogus"),
    ("oversize prompt", "application/json", {"model": NAME, "prompt": "x" * 1500}, 400, "1500 tokens, more than this server's limit of 1000"),
    ("unknown field", "application/json", {"model": NAME, "prompt": "hi", "temprature": 1}, 400, "temprature: Extra inputs"),
    ("n above the limit", "application/json", {"model": NAME, "prompt": "hi", "n": 9}, 400,
     "n=9 exceeds this server's limit of 8 choices"),
    ("n of zero", "application/json", {"model": NAME, "prompt": "hi", "n": 0}, 400, "n: Input should be greater"),
    ("logprobs above 20", "application/json", {"model": NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs as a flag", "application/json", {"model": NAME, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("prompt forms mixed", "application/json", {"model": NAME, "prompt": ["a", [1, 2]]}, 400,
     "the prompt must be a string, a list of token ids, a list of strings, or a list of token-id lists"),
    ("an empty prompt in a batch", "application/json", {"model": NAME, "prompt": ["a", ""]}, 400,
     "prompt 1 of the batch is empty"),
    ("max_tokens 0 without echo", "application/json", {"model": NAME, "prompt": "hi", "max_tokens": 0}, 400,
     "allowed with echo: true"),
    ("logit_bias key in another script's digits", "application/json",
     {"model": NAME, "prompt": "hi", "logit_bias": {"\u0663": 5}}, 400, "keys are token ids"),
    ("logit_bias beyond the vocabulary", "application/json", {"model": NAME, "prompt": "hi", "logit_bias": {"999999": 1}},
     400, "outside the vocabulary"),
    ("empty stop", "application/json", {"model": NAME, "prompt": "hi", "stop": [""]}, 400, "stop strings must be non-empty"),
    ("unknown model", "application/json", {"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
    ("out-of-vocabulary ids", "application/json", {"model": NAME, "prompt": [1, 999999]}, 400, "token ids must lie"),
    ("top_k beyond int64", "application/json", {"model": NAME, "prompt": "hi", "temperature": 1, "top_k": 2**63}, 400,
     "top_k"),
    # Drafter options over HTTP: paths and model ids are the server's configuration; the rest is bounded.
    *[(f"{method} {option} from the request", "application/json",
       {"model": NAME, "prompt": "hi", "method": method, "method_options": {option: value}}, 400,
       "set by the server's configuration")
      for method, option, value in [("longspec", "checkpoint", "/etc/passwd"), ("mamba", "model", "someone/some-repo"),
                                    ("draft-model", "model", "/etc"), ("tokenswift", "heads", "/etc/passwd"),
                                    ("medusa", "heads", "/nonexistent/heads")]],
    ("widths above the vocabulary", "application/json", {"model": NAME, "prompt": "hi", "method": "tokenswift",
                                                         "method_options": {"widths": [1, 300000]}}, 400,
     "every width must be an integer in [1, 16]"),
    ("a tree of 4369 nodes", "application/json", {"model": NAME, "prompt": "hi", "method": "tokenswift-onepass",
                                                  "method_options": {"widths": [1, 16, 16, 16]}}, 400, "4369 nodes"),
    ("a partial cache beyond the prompt limit", "application/json",
     {"model": NAME, "prompt": "hi", "method": "magicdec", "method_options": {"budget": 10**9}}, 400,
     "budget must be in [1, 1000]"),
    ("auto components repeated", "application/json",
     {"model": NAME, "prompt": "hi", "method": "auto", "method_options": {"components": ["pld"] * 1000}}, 400,
     "names a component twice"),
    ("n-gram order", "application/json", {"model": NAME, "prompt": "hi", "method": "ngram",
                                          "method_options": {"n": 10**6}}, 400, "n must be in [1, 8]"),
    ("option as text", "application/json", {"model": NAME, "prompt": "hi", "method": "pld",
                                            "method_options": {"num_tokens": "5"}}, 400, "must be an integer"),
    ("options not an object", "application/json", {"model": NAME, "prompt": "hi", "method": "pld",
                                                   "method_options": [1, 2]}, 400, "method_options"),
]


@pytest.mark.parametrize("name,content_type,body,status,fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_malformed_requests_get_the_right_status_and_the_server_keeps_serving(server, name, content_type, body, status,
                                                                                 fragment):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + "/v1/completions", content=data, headers={"content-type": content_type},
                          timeout=DEADLINE_S)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert error["type"]
    assert "/etc" not in response.text and "/nonexistent" not in response.text  # nothing of the server's disk
    ok = server.client().completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_server_configured_drafter_options_apply_and_are_checked_at_startup(model):
    """Options the server sets (paths among them) sit under the request's bounded ones;
    a wrong one stops the server before it serves."""
    configured = Server(model, ServeOptions(model_name=NAME, method="pld", method_options={"pld": {"num_tokens": 2}}))
    try:
        reference = model.generate(PROMPT, method="pld", method_options={"num_tokens": 2}, max_new_tokens=20)
        text = configured.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
        assert text.choices[0].text == reference.text
        overridden = configured.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                                            extra_body={"method_options": {"num_tokens": 5}})
        assert overridden.choices[0].text == reference.text
    finally:
        configured.stop()
    with pytest.raises(FileNotFoundError, match="not found"):
        create_app(model, ServeOptions(model_name=NAME, method_options={"longspec": {"checkpoint": "/nonexistent.st"}}))
    with pytest.raises(ValueError, match="unknown method"):
        ServeOptions(model_name=NAME, method_options={"magic": {}})


def test_chat_refusals(server):
    for body, fragment in [({"model": NAME, "messages": []}, "messages"),
                           ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
                           ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                             "max_completion_tokens": 3}, "not both"),
                           ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                            "top_logprobs: needs logprobs: true"),
                           ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                             "top_logprobs": 21}, "top_logprobs")]:
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=DEADLINE_S)
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


# ---------------------------------------------------------- key, limit, faults
def test_api_key_guards_every_endpoint_but_health(model):
    guarded = Server(model, ServeOptions(model_name=NAME, api_key=KEY))
    try:
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(guarded.url + path).status_code == 401
            assert httpx.get(guarded.url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(guarded.url + "/v1/completions", json={"model": NAME, "prompt": "hi"}).status_code == 401
        assert httpx.get(guarded.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            guarded.client(key="wrong").models.list()
        assert guarded.client().completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        guarded.stop()


def test_exposure_warnings():
    from longspec.cli.serve import exposure_warnings, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    assert exposure_warnings("127.0.0.1", None) == []
    warned = " ".join(exposure_warnings("0.0.0.0", None))
    assert "0.0.0.0" in warned and "no --api-key" in warned
    assert not any("--api-key" in w for w in exposure_warnings("0.0.0.0", KEY))


def _start_streams(url: str, count: int, max_tokens: int) -> list[httpx.Response]:
    """`count` streaming requests, each read up to its first event."""
    client = httpx.Client(timeout=DEADLINE_S)
    streams = []
    for _ in range(count):
        request = client.build_request("POST", url + "/v1/completions",
                                       json={"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                                             "temperature": 0, "method": "ar"})
        streams.append(client.send(request, stream=True))
    return streams


def read_first_event(stream: httpx.Response, keep: list) -> None:
    """Read a stream's first line, keeping the line iterator alive: a collected iterator
    closes its response, which the server (rightly) takes as a disconnect."""
    lines = stream.iter_lines()
    keep.append(lines)
    assert next(lines).startswith("data: ")


def wait_idle(server: Server) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        busy = (server.metric("longspec:num_requests_running"), server.metric("longspec:num_requests_waiting"),
                server.metric("longspec:kv_cache_bytes"))
        if busy == (0, 0, 0) and httpx.get(server.url + "/health").json()["requests_in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"still busy after the clients left: {busy}"
        time.sleep(0.05)


def test_concurrency_limit_gives_429(model):
    limited = Server(model, ServeOptions(model_name=NAME, max_concurrent=1, method="ar", max_new_tokens=LONG))
    try:
        (first,) = _start_streams(limited.url, 1, LONG)
        keep: list = []
        read_first_event(first, keep)  # generating
        with pytest.raises(openai.RateLimitError, match="limit of 1 concurrent"):
            limited.client().completions.create(model=NAME, prompt="hi", max_tokens=2)
        first.close()
        wait_idle(limited)
        assert limited.client().completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        limited.stop()


def test_requests_are_batched_and_a_row_is_refused_before_prefill(model):
    """Four long streams generate at once (one row each, sharing forwards) while a
    fifth waits for a row; a request too large for a row is refused with the numbers."""
    batched = Server(model, ServeOptions(model_name=NAME, method="ar", max_batch=4, max_new_tokens=LONG,
                                         max_prompt_tokens=100))
    try:
        streams = _start_streams(batched.url, 5, LONG)
        keep: list = []
        for stream in streams[:4]:
            read_first_event(stream, keep)  # all four are generating: none waits behind another
        deadline = time.monotonic() + DEADLINE_S
        while (batched.metric("longspec:num_requests_running"), batched.metric("longspec:num_requests_waiting")) != (4, 1):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert batched.metric("longspec:kv_cache_bytes") > 0
        for stream in streams:
            stream.close()
        wait_idle(batched)
    finally:
        batched.stop()


def test_fifty_clients_disconnecting_mid_stream_leave_nothing_in_flight(server):
    cancelled_before = server.metric("longspec:request_cancelled_total")
    streams = _start_streams(server.url, 50, LONG)
    keep: list = []
    read_first_event(streams[0], keep)  # the first one really is generating; the others wait behind it
    for stream in streams:
        stream.close()
    wait_idle(server)
    assert server.metric("longspec:request_cancelled_total") - cancelled_before == 50
    assert server.client().completions.create(model=NAME, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_sixteen_concurrent_clients_all_complete_with_offline_outputs(server, model):
    prompts = [f"{PROMPT} {i} {i} {i}" for i in range(16)]
    expected = {p: offline(model, model.encode(p), max_new_tokens=24, temperature=0.0).text for p in prompts}

    def client_session(prompt: str) -> list[str]:
        client = server.client()
        return [client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
                for _ in range(3)]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = dict(zip(prompts, pool.map(client_session, prompts, timeout=DEADLINE_S * 4)))
    for prompt, texts in results.items():
        assert texts == [expected[prompt]] * 3
    wait_idle(server)


def test_chat_content_parts_and_the_developer_role(server, model):
    client = server.client()
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say cat cat"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "say cat cat"}]}]
    reference = offline(model, model.encode_chat(plain), max_new_tokens=20, temperature=0.0)
    reply = client.chat.completions.create(model=NAME, messages=parts, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == reference.text
    image = {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    refused = httpx.post(server.url + "/v1/chat/completions", json=image, timeout=DEADLINE_S)
    assert refused.status_code == 400 and "'image_url' are not supported" in refused.json()["error"]["message"]


def test_ignore_eos_generates_to_max_tokens(tmp_path):
    """A model whose greedy output hits EOS at once: without ignore_eos the completion
    stops there, with it the completion runs to max_tokens."""
    directory = save_checkpoint(tmp_path / "eos", max_position_embeddings=1 << 12)
    probe = LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))
    first = probe.generate(PROMPT, method="ar", max_new_tokens=1).token_ids[0]
    directory = save_checkpoint(tmp_path / "eos", max_position_embeddings=1 << 12, eos_token_id=first)
    eos_model = LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))
    running = Server(eos_model, ServeOptions(model_name=NAME, method="ar"))
    try:
        stopped = running.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0)
        assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
        result = running.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                                     extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 30 and result.choices[0].finish_reason == "length"
    finally:
        running.stop()


def test_a_chat_template_for_a_model_without_one(tmp_path):
    directory = save_checkpoint(tmp_path / "base", max_position_embeddings=1 << 12)  # no chat template
    base = LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))
    with pytest.raises(ValueError, match="no chat template"):
        base.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="does not compile"):
        base.set_chat_template("{% for m in messages %}")
    base.set_chat_template(TEMPLATE)
    assert base.encode_chat([{"role": "user", "content": "hi"}]).tolist() == base.encode("<user>hi\n<assistant>").tolist()


def test_penalties_and_logit_bias_through_the_client(server, model):
    client = server.client()
    ids = model.encode(PROMPT)
    kwargs = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={str(int(ids[2])): -100})
    reference = model.generate(ids, method="pld", max_new_tokens=30, temperature=0.0, presence_penalty=0.8,
                               frequency_penalty=0.4, logit_bias={int(ids[2]): -100.0})
    result = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0, **kwargs)
    assert result.choices[0].text == reference.text
    assert int(ids[2]) not in model.encode(result.choices[0].text).tolist()
    seeded = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0.9, seed=3,
                                       extra_body={"method": "ngram"}, **kwargs)
    assert seeded.choices[0].text == model.generate(ids, method="ar", max_new_tokens=30, temperature=0.9, seed=3,
                                                    presence_penalty=0.8, frequency_penalty=0.4,
                                                    logit_bias={int(ids[2]): -100.0}).text
    for body, fragment in [({"logit_bias": {"999999": 1}}, "outside the vocabulary"),
                           ({"logit_bias": {"3": 150}}, "biases lie in [-100, 100]"),
                           ({"logit_bias": {"cat": 1}}, "keys are token ids"),
                           ({"presence_penalty": 3}, "presence_penalty")]:
        response = httpx.post(server.url + "/v1/completions", timeout=DEADLINE_S,
                              json={"model": NAME, "prompt": PROMPT, "max_tokens": 3, **body})
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


def test_n_choices_are_the_single_requests_with_seeds_seed_plus_i(server, model):
    client = server.client()
    kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.9)
    replies = [client.completions.create(seed=11 + i, **kwargs) for i in range(3)]
    singles = [reply.choices[0].text for reply in replies]
    result = client.completions.create(n=3, seed=11, **kwargs)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == singles
    assert result.usage.prompt_tokens == len(PROMPT)  # the prompt once, every choice's completion
    assert result.usage.completion_tokens == sum(reply.usage.completion_tokens for reply in replies)
    pieces = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(n=3, seed=11, stream=True, **kwargs):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
    assert ["".join(pieces[i]) for i in range(3)] == singles
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "cat"}], n=2,
                                          max_tokens=10, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_logprobs_are_the_models_through_the_client(server, model):
    client = server.client()
    ids = model.encode(PROMPT)
    reference = offline(model, ids, max_new_tokens=20, temperature=0.0, logprobs=3)
    strings = model.token_strings(reference.token_ids)
    result = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == strings
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-5)
    assert logprobs.text_offset == [sum(map(len, strings[:i])) for i in range(len(strings))]
    for top, entry, text in zip(logprobs.top_logprobs, reference.logprobs, strings):
        assert text in top and len(top) <= 4  # the 3 most likely (by text), and the chosen token
        assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
    streamed_tokens, streamed_offsets = [], []
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=3,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_offsets += chunk.choices[0].logprobs.text_offset
    assert streamed_tokens == strings and streamed_offsets == logprobs.text_offset
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4).choices[0].logprobs is None

    messages = [{"role": "user", "content": "say cat cat cat"}]
    reference = offline(model, model.encode_chat(messages), max_new_tokens=12, temperature=0.0, logprobs=2)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == model.token_strings(reference.token_ids)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    streamed = [item.token for chunk in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True)
        for choice in chunk.choices if choice.logprobs for item in choice.logprobs.content]
    assert streamed == [c.token for c in content]
    assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=3).choices[0].logprobs is None


def test_processed_logprobs_mode_reports_the_drawn_distribution(model):
    processed = Server(model, ServeOptions(model_name=NAME, method="pld", logprobs_mode="processed"))
    try:
        kwargs = dict(max_new_tokens=12, temperature=0.8, top_k=2, seed=4, logprobs=4)
        reference = offline(model, model.encode(PROMPT), logprobs_mode="processed", **kwargs)
        result = processed.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0.8,
                                                       seed=4, logprobs=4, extra_body={"top_k": 2})
        logprobs = result.choices[0].logprobs
        assert logprobs.token_logprobs == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-5)
        # Two tokens survive top_k=2; the others' -inf shows as vLLM's -9999.0, and the JSON stays valid.
        wide = [top for top in logprobs.top_logprobs if len(top) > 2]
        assert wide and all(min(top.values()) == -9999.0 for top in wide)
    finally:
        processed.stop()
    with pytest.raises(ValueError, match="logprobs_mode"):
        ServeOptions(model_name=NAME, logprobs_mode="logits")


EOS_TEXT = "~"  # the character tokenizer spells EOS (id 95) as text
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}


def test_structured_output_through_the_client(tmp_path):
    from longspec.speculation.grammar import OutputConstraint

    directory = save_checkpoint(tmp_path / "eos-model", chat_template=TEMPLATE, eos_token_id=95)
    model = LongSpecModel(load_target(directory, dtype=torch.float32), EngineOptions(progress=False))
    running = Server(model, ServeOptions(model_name=NAME, method="pld"))
    try:
        client = running.client()
        schema_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
        reference = offline(model, model.encode(PROMPT), max_new_tokens=60, temperature=0.0,
                            constraint=OutputConstraint("json_schema", SCHEMA))
        result = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=60, temperature=0,
                                           extra_body={"response_format": schema_format})
        assert result.choices[0].text == reference.text
        if result.choices[0].finish_reason == "stop":
            assert set(json.loads(reference.text.removesuffix(EOS_TEXT))) == {"city", "n"}
        messages = [{"role": "user", "content": "a city?"}]
        chat_reference = offline(model, model.encode_chat(messages), max_new_tokens=40, temperature=0.9, seed=2,
                                 constraint=OutputConstraint("regex", "[a-z]{2,6} [0-9]+"))
        streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0.9,
                                                  seed=2, stream=True,
                                                  extra_body={"structured_outputs": {"regex": "[a-z]{2,6} [0-9]+"}})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat_reference.text
        choice = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                extra_body={"structured_outputs": {"choice": ["north", "south"]}})
        assert choice.choices[0].message.content.removesuffix(EOS_TEXT) in ("north", "south")
        json_mode = client.chat.completions.create(model=NAME, messages=messages, max_tokens=200, temperature=0,
                                                   response_format={"type": "json_object"})
        if json_mode.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(json_mode.choices[0].message.content.removesuffix(EOS_TEXT)), dict)
        for body, fragment in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
             "response_format: the json schema does not compile"),
            ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs: the regex does not compile"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
            ({"structured_outputs": {"grammar": "start: ("}}, "the grammar does not compile"),
            ({"response_format": {"type": "json_schema"}}, "give json_schema exactly"),
            ({"response_format": {"type": "yaml"}}, "response_format"),
            ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos cannot go"),
            ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ]:
            response = httpx.post(running.url + "/v1/completions", timeout=DEADLINE_S,
                                  json={"model": NAME, "prompt": PROMPT, "max_tokens": 3, **body})
            assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
        assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
    finally:
        running.stop()
