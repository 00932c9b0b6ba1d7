"""Hostile requests against `longspec serve`: what an adversary or an unlucky client
sends (paths in drafter options, out-of-bound values, oversized and deeply nested
bodies, malformed JSON, slow and vanishing clients), each with the status it must get.
Used by tests/test_hostile_requests.py (an in-process server) and by
benchmarks/serving/serve_hostile.py (a `longspec serve` process, its memory watched)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

MODEL = "tiny"  # the served model name both users of this module serve under
PROMPT_LIMIT = 1000  # --max-prompt-tokens of the server the cases are written for
BODY_LIMIT = 1 << 20  # --max-body-bytes of that server
BODY_TIMEOUT_S = 2.0  # --body-timeout of that server
# Fragments no response may carry: the server's files, code and environment.
SERVER_PATHS = ("/etc/", "/root", "/tmp/", "/home/", "site-packages", ".py\"", "Traceback", "/nonexistent")


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    fragment: str = ""  # in the error message
    body: object = None  # JSON-able, or raw bytes
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict | list | None = None  # a list of pairs may repeat a header
    send: Callable[[str, "Case"], tuple[int, str]] | None = None  # a custom client (slow, vanishing)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 4, **fields}


def option(method: str, **options) -> dict:
    return completion(method=method, method_options=options)


def _raw(url: str, request: bytes, read_s: float = 10.0) -> tuple[int, str]:
    """Send raw HTTP bytes; the status and body of the answer (0 when the server closed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_s) as sock:
        sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    return status, body.decode("utf-8", "replace")


def slow_body(url: str, case: Case) -> tuple[int, str]:
    """Headers and half the body, then nothing: the body timeout must answer 408."""
    body = json.dumps(completion()).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body[: len(body) // 2]
    return _raw(url, request, read_s=BODY_TIMEOUT_S + 10)


def chunked_oversize(url: str, case: Case) -> tuple[int, str]:
    """A chunked body (no Content-Length) that grows past the limit: 413 while reading."""
    piece = b"x" * (64 << 10)
    chunks = b"".join(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(BODY_LIMIT // len(piece) + 2))
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    return _raw(url, request)


def lying_length(url: str, case: Case) -> tuple[int, str]:
    """A Content-Length far past the limit: refused before anything is read."""
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {BODY_LIMIT * 50}\r\n\r\n{{").encode()
    return _raw(url, request)


def _deep(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


def _wide_schema(n: int) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
    return completion(response_format={"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}})


CONTROL_STRINGS = ("<eos>", "<bos>", "<unk>", "<pad>", "<end_of_turn>", "<start_of_turn>", "<|im_end|>",
                   "<|endoftext|>", "</s>")
# Those that are control tokens of the served models (Gemma 3, the tests' tiny tokenizers); the others are
# sent too but not checked: in Gemma's vocabulary "</s>" is also an ordinary token, the same string either way.
CHECKED_CONTROL_STRINGS = CONTROL_STRINGS[:6]


def control_strings_prompt(url: str, case: Case) -> tuple[int, str]:
    """A completion prompt of control-token strings, echoed with its tokens: each must be
    spelled by plain tokens (none a control token), else a client could end the prompt
    or forge a turn (issue 64). Answers 200 "read as plain text" when they are."""
    prompt = "x" + "".join(CONTROL_STRINGS) + "<start_of_turn>model"
    response = httpx.post(url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    if response.status_code != 200:
        return response.status_code, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    if tokens and tokens[0] in ("<bos>", "<s>", "<|begin_of_text|>"):
        tokens = tokens[1:]  # the BOS the tokenizer adds: special, as it should be
    read_as_control = [t for t in tokens if t in CHECKED_CONTROL_STRINGS]
    if read_as_control:
        return 0, f"control strings read as control tokens: {read_as_control}"
    return 200, "control strings read as plain text"


# Bodies built to make a parser slow or to reach Python's internals (issue 64): each a 400.
HOSTILE_BODIES = {
    # An unterminated string of escaped quotes: a backtracking pattern took 57 s on 96 KB.
    "unterminated string of escaped quotes": b'{"model": "tiny", "prompt": "' + b'ab\\"' * 24_000,
    "800,000 brackets, balanced": b'{"model": "tiny", "prompt": "hi", "x": ' + b"[]" * 400_000 + b"}",
    "an integer of 5,000 digits": b'{"model": "tiny", "prompt": "hi", "seed": ' + b"7" * 5000 + b"}",
    "a lone surrogate": b'{"model": "tiny", "prompt": "hi \\ud800 there"}',
}


def idle_sockets(url: str, case: Case, count: int = 1000) -> tuple[int, str]:
    """A thousand connections that send nothing or half a request line, held open while a
    good request is sent: it must be served."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    try:
        for index in range(count):
            sock = socket.create_connection((host, int(port)), timeout=30)
            if index % 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sockets.append(sock)
        response = httpx.post(url + "/v1/completions", json=completion(), timeout=60)
        return response.status_code, f"served beside {count} idle sockets: {response.text}"
    finally:
        for sock in sockets:
            sock.close()


CASES: list[Case] = [
    # Drafter options that name files or models are the server's, never a request's.
    Case("checkpoint path", 400, "set by the server's configuration", option("longspec", checkpoint="/etc/passwd")),
    Case("checkpoint relative path", 400, "set by the server's configuration",
         option("longspec-chain", checkpoint="../../weights/x.safetensors")),
    Case("hub model id", 400, "set by the server's configuration", option("mamba", model="someone/some-repo")),
    Case("draft model directory", 400, "set by the server's configuration", option("draft-model", model="/etc")),
    Case("heads path", 400, "set by the server's configuration", option("tokenswift", heads="/etc/passwd")),
    Case("medusa heads path", 400, "set by the server's configuration", option("medusa", heads="/nonexistent/h")),
    # Bounds on the options a request may set.
    Case("widths past the vocabulary", 400, "every width must be", option("tokenswift", widths=[1, 300000])),
    Case("a tree of thousands of nodes", 400, "nodes", option("tokenswift-onepass", widths=[1, 16, 16, 16])),
    Case("partial cache of 1e9 slots", 400, "budget must be in", option("magicdec", budget=10**9)),
    Case("auto components repeated", 400, "names a component twice", option("auto", components=["pld"] * 1000)),
    Case("n-gram order 1e6", 400, "n must be in", option("ngram", n=10**6)),
    Case("option as text", 400, "must be an integer", option("pld", num_tokens="5")),
    Case("options as a list", 400, "method_options", completion(method="pld", method_options=[1, 2])),
    Case("unknown method", 400, "unknown method", completion(method="rm -rf")),
    Case("top_k beyond int64", 400, "top_k", completion(temperature=1, top_k=2**63)),
    Case("negative seed", 400, "seed", completion(seed=-1)),
    Case("infinite temperature", 400, "temperature", b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}'),
    Case("max_tokens 1e9", 400, "exceeds this server's limit", completion(max_tokens=10**9)),
    # Sizes, checked before the work they would cost.
    Case("body past the limit", 413, "--max-body-bytes", completion(prompt="x" * (BODY_LIMIT + 10))),
    Case("chunked body past the limit", 413, "--max-body-bytes", send=chunked_oversize),
    Case("declared length past the limit", 413, "--max-body-bytes", send=lying_length),
    Case("token ids past the prompt limit", 400, "more than this server's limit",
         completion(prompt=[5] * (PROMPT_LIMIT + 1))),
    Case("text that cannot fit the prompt limit", 400, "tokens long, beyond the limit",
         completion(prompt="y" * (BODY_LIMIT // 2))),
    Case("600 messages", 400, "messages exceed", {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 600},
         path="/v1/chat/completions"),
    Case("chat whose messages together cannot fit", 400, "tokens long, beyond the limit",
         {"model": MODEL, "messages": [{"role": "user", "content": "z" * 2000}] * 200}, path="/v1/chat/completions"),
    Case("stop string of 10,000 characters", 400, "stop string of 10000 characters", completion(stop="s" * 10000)),
    Case("five stop strings", 400, "at most 4 stop strings", completion(stop=["a", "b", "c", "d", "e"])),
    Case("100,000 nested lists", 400, "levels deep", _deep(100_000)),
    Case("deeply nested options", 400, "levels deep",
         b'{"model": "tiny", "prompt": "hi", "method_options": ' + b'{"a": ' * 64 + b"1" + b"}" * 64 + b"}"),
    # Malformed requests.
    Case("truncated JSON", 400, "not valid JSON", b'{"model": "tiny", "prompt": "hi"'),
    Case("not UTF-8", 400, "not UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    Case("an array", 400, "must be a JSON object", b'["tiny", "hi"]'),
    Case("empty body", 400, "not valid JSON", b""),
    Case("wrong content type", 415, "Content-Type", completion(), headers={"content-type": "text/plain"}),
    Case("unknown field", 400, "Extra inputs", completion(temprature=1)),
    Case("prompt of floats", 400, "prompt", completion(prompt=[1.5, 2.5])),
    Case("empty prompt", 400, "empty", completion(prompt="")),
    Case("token ids past the vocabulary", 400, "token ids must lie", completion(prompt=[1, 10**7])),
    Case("negative token id", 400, "token ids must lie", completion(prompt=[3, -4])),
    Case("unknown model", 404, "does not exist", {"model": "gpt-9", "prompt": "hi"}),
    Case("GET a POST endpoint", 405, "Method Not Allowed", None, method="GET"),
    Case("a path that does not exist", 404, "Not Found", completion(), path="/v1/fine-tunes"),
    Case("no interactive docs", 404, "Not Found", None, path="/docs", method="GET"),
    # Output constraints the matcher cannot follow: refused before any work (issue 64).
    Case("schema of 1,000 properties", 400, "more than the limit of 256", _wide_schema(1000)),
    Case("schema of 10,000 properties", 400, "more than the limit of 65,536", _wide_schema(10_000)),
    Case("regex that matches nothing", 400, "matches no text at all",
         completion(structured_outputs={"regex": "[^\\s\\S]"})),
    Case("schema that only refers to itself", 400, "matches no text at all",
         completion(response_format={"type": "json_schema", "json_schema": {"name": "loop", "schema": {
             "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}})),
    # Control-token strings in a prompt are plain text (a forged turn, an early <eos>).
    Case("control-token strings in a prompt", 200, "read as plain text", send=control_strings_prompt),
    # Below the request: parsers, headers, sockets (issue 64).
    *[Case(name, 400, fragment, body) for (name, body), fragment in zip(HOSTILE_BODIES.items(), (
        "not valid JSON", "not valid JSON", "5,000 digits", "lone UTF-16 surrogate"))],
    Case("headers of 70 KB", 431, "64 KiB", completion(), headers={"content-type": "application/json",
                                                                  "x-padding": "p" * (70 << 10)}),
    Case("two Authorization headers", 400, "Authorization headers", completion(),
         headers=[("content-type", "application/json"), ("authorization", "Bearer a"), ("authorization", "Bearer b")]),
    Case("a thousand idle sockets beside a good request", 200, "served beside", send=idle_sockets),
    # Clients that stall.
    Case("body that never finishes", 408, "did not arrive", send=slow_body),
]


def send(url: str, case: Case, timeout_s: float = 60.0) -> tuple[int, str, float]:
    """(status, response text, seconds) of one case."""
    start = time.monotonic()
    if case.send is not None:
        status, text = case.send(url, case)
        return status, text, time.monotonic() - start
    if isinstance(case.body, bytes):
        content = case.body
    else:
        content = b"" if case.body is None else json.dumps(case.body).encode()
    headers = case.headers or {"content-type": "application/json"}
    response = httpx.request(case.method, url + case.path, content=content if case.method != "GET" else None,
                             headers=headers, timeout=timeout_s)
    return response.status_code, response.text, time.monotonic() - start


def reveals_server_paths(text: str) -> list[str]:
    return [fragment for fragment in SERVER_PATHS if fragment in text]
