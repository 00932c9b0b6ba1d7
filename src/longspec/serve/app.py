"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions (streaming as Server-Sent Events), /health and /metrics.

The app talks to the model's public API (`LongSpecModel.prepare`) and to the
generation worker, which batches the requests (continuous batching), never to
caches or drafters. Every refusal is an OpenAI-style JSON error with the status a
client expects: 400 invalid request, 401 missing or wrong key, 404 unknown model,
415 not JSON, 429 at the concurrency limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from longspec.api import LongSpecModel, PreparedRequest
from longspec.serve.limits import LimitError, RequestLimits, parse_json, read_body
from longspec.serve.logprob_fields import CompletionLogprobs, chat_logprobs
from longspec.serve.metrics import ServerMetrics
from longspec.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields, error_body
from longspec.serve.request_options import OptionError, ServerLimits, check_request_options
from longspec.serve.worker import GenerationWorker, Job, QueueFull, RequestFailed, WorkerUnavailable
from longspec.speculation.batch_engine import BatchOptions
from longspec.speculation.logprobs import MODES as LOGPROBS_MODES
from longspec.speculation.logprobs import TokenLogprob
from longspec.speculation.methods import DEFAULT_METHOD, METHODS, make_drafter

SSE_DONE = b"data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
logger = logging.getLogger("longspec.serve")


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    method: str = DEFAULT_METHOD  # when a request names none
    api_key: str | None = None
    max_concurrent: int = 16
    max_prompt_tokens: int | None = None  # None: the model's context
    max_new_tokens: int = 1024
    max_batch: int = 8  # requests decoded together (rows of the batch); the others wait for a row
    limits: RequestLimits = RequestLimits()  # what a request may weigh, checked before any work
    max_n: int = 8  # choices a request may ask for (`n`): each is a row of the batch
    logprobs_mode: str = "raw"  # the distribution `logprobs` report (vLLM's flag): raw or processed
    # The server's own drafter options per method (paths to weights among them), under
    # the few a request may set (`request_options.REQUEST_OPTIONS`).
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(METHODS)}")
        unknown = sorted(set(self.method_options) - set(METHODS))
        if unknown:
            raise ValueError(f"options for unknown method(s) {', '.join(unknown)}; available: {', '.join(METHODS)}")
        for name in ("max_concurrent", "max_new_tokens", "max_batch", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a real key, or none to serve without one (loopback only)")


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


class RequireKey:
    """'Authorization: Bearer KEY' on every path but /health, as plain ASGI middleware
    (it passes the rest through untouched: disconnects and streams included)."""

    def __init__(self, app, *, key: str, metrics: ServerMetrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.errors.labels(status="401").inc()
                body = error_body("missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(model: LongSpecModel, options: ServeOptions) -> FastAPI:
    metrics = ServerMetrics()
    state: dict[str, GenerationWorker] = {}

    context = model.config.max_position_embeddings
    prompt_limit = min(options.max_prompt_tokens or context, context)
    # A row holds the longest prompt with the largest output, a tree and the root.
    row_capacity = min(prompt_limit + options.max_new_tokens, context) + model.engine.options.max_tree_nodes + 1
    batch = BatchOptions(max_rows=options.max_batch, row_capacity=row_capacity)
    limits = ServerLimits(prompt_tokens=prompt_limit)
    for method, configured in options.method_options.items():
        make_drafter(method, **configured)  # a wrong path or option fails at startup, not in a request
    model.separate_encoding()  # prompts are tokenized beside the generation thread's detokenizing
    _ = model.model.certified_head  # built now (seconds for a large vocabulary), not in the first request
    if model.tokenizer is not None and model.config.eos_token_ids:
        # Seconds for a large vocabulary: built beside startup; a structured request waits for it.
        threading.Thread(target=_build_grammar_vocabulary, args=(model,), daemon=True,
                         name="longspec-grammar-vocabulary").start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["worker"] = GenerationWorker(model, metrics, options.max_concurrent, batch)
        try:
            yield
        finally:
            state.pop("worker").close()

    # No interactive docs: the API is OpenAI's (docs/serving.md); the schema stays behind the key.
    app = FastAPI(title="longspec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.state = state
    app.state.batch = batch

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        metrics.errors.labels(status=str(error.status)).inc()
        return JSONResponse(error_body(str(error), error.kind, error.param, error.code), status_code=error.status)

    @app.exception_handler(LimitError)
    async def limit_error(request: Request, error: LimitError) -> JSONResponse:
        metrics.errors.labels(status=str(error.status)).inc()
        kind = "invalid_request_error"
        return JSONResponse(error_body(str(error), kind, None, error.code), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        metrics.errors.labels(status=str(error.status_code)).inc()
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("a request failed unexpectedly")
        metrics.errors.labels(status="500").inc()
        return JSONResponse(error_body("internal server error (the server's log has the cause)", "server_error"),
                            status_code=500)

    if options.api_key is not None:
        app.add_middleware(RequireKey, key=options.api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        worker = state.get("worker")
        if worker is not None and not worker.alive:
            return JSONResponse({"status": "unavailable", "reason": "the generation thread has stopped"},
                                status_code=503)
        return {"status": "ok", "requests_in_flight": worker.admitted if worker else 0}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                             "owned_by": "longspec", "max_model_len": context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        return await _admit_and_respond(request, body, lambda: model.encode(body.prompt, limit=prompt_limit), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        messages = [m.for_template() for m in body.messages]
        return await _admit_and_respond(request, body, lambda: model.encode_chat(messages, limit=prompt_limit),
                                        chat=True)

    # ------------------------------------------------------------ helpers
    async def _parse(request: Request, kind: type[BaseModel]):
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise RequestError(415, f"the body must be JSON (Content-Type: application/json), got {content_type!r}",
                               code="unsupported_media_type")
        data = parse_json(await read_body(request, options.limits), options.limits)
        if not isinstance(data, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
        try:
            body = kind.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            message = first["msg"].removeprefix("Value error, ")
            raise RequestError(400, f"{param}: {message}" if param else message, param=param) from None
        if body.model != options.model_name:
            raise RequestError(404, f"the model {body.model!r} does not exist; this server serves {options.model_name!r}",
                               param="model", code="model_not_found")
        if body.method is not None and body.method not in METHODS:
            raise RequestError(400, f"unknown method {body.method!r}; available: {', '.join(METHODS)}", param="method")
        if body.max_tokens is not None and body.max_tokens > options.max_new_tokens:
            raise RequestError(400, f"max_tokens={body.max_tokens} exceeds this server's limit of "
                                    f"{options.max_new_tokens} new tokens", param="max_tokens")
        longest_stop = max((len(stop) for stop in body.stops), default=0)
        if longest_stop > options.limits.max_stop_chars:
            raise RequestError(400, f"a stop string of {longest_stop} characters exceeds this server's limit of "
                                    f"{options.limits.max_stop_chars}", param="stop")
        messages = getattr(body, "messages", ())
        if len(messages) > options.limits.max_messages:
            raise RequestError(400, f"{len(messages)} messages exceed this server's limit of "
                                    f"{options.limits.max_messages}", param="messages")
        if body.n > options.max_n:
            raise RequestError(400, f"n={body.n} exceeds this server's limit of {options.max_n} choices", param="n")
        prompt = getattr(body, "prompt", "")
        if isinstance(prompt, list) and len(prompt) > prompt_limit:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens, more than this server's limit of "
                                    f"{prompt_limit}", param="prompt", code="context_length_exceeded")
        return body

    async def _admit_and_respond(request: Request, body: GenerationFields, encode, *, chat: bool):
        """Counted in first (so tokenizing and building drafters count against the
        concurrency limit), then prepared off the event loop, then queued."""
        worker = state["worker"]
        reserved = 0
        jobs: list[Job] = []
        try:
            for _ in range(body.n):  # every choice is a row, counted against the limit
                worker.reserve()
                reserved += 1
            prepared = await run_in_threadpool(_prepare, body, encode)
            for choice in prepared:
                jobs.append(worker.submit(choice))
        except QueueFull as error:
            _give_back(worker, reserved, jobs)
            raise RequestError(429, str(error), kind="rate_limit_error", code="too_many_requests") from None
        except WorkerUnavailable as error:
            _give_back(worker, reserved, jobs)
            raise RequestError(503, str(error), kind="server_error", code="service_unavailable") from None
        except ValueError as error:
            _give_back(worker, reserved, jobs)
            raise RequestError(400, str(error), code="context_length_exceeded") from None
        except BaseException:
            _give_back(worker, reserved, jobs)
            raise
        return await _respond(request, body, jobs, chat=chat)

    def _give_back(worker: GenerationWorker, reserved: int, jobs: list[Job]) -> None:
        """Undo a request's admission: reservations not yet submitted are released, jobs
        already queued are cancelled (the worker releases theirs)."""
        for job in jobs:
            job.cancelled.set()
        for _ in range(reserved - len(jobs)):
            worker.release()

    def _prepare(body: GenerationFields, encode) -> list[PreparedRequest]:
        """Everything that can fail on bad input, before the request is queued: one
        prepared request per choice (choice i draws from seed + i)."""
        try:
            ids = encode()
            if ids.numel() > prompt_limit:
                raise RequestError(400, f"the prompt has {ids.numel()} tokens, more than this server's limit of "
                                        f"{prompt_limit}", param="prompt", code="context_length_exceeded")
            max_new = body.max_tokens or max(1, min(options.max_new_tokens, context - ids.numel()))
            method = body.method or options.method
            drafter_options = {**options.method_options.get(method, {}),
                               **check_request_options(method, body.method_options, limits)}
            seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
            constraint = body.constraint
            if constraint is not None:
                try:
                    constraint.grammar()  # compiled before any work, so that its error names the field
                except ValueError as error:
                    field = "structured_outputs" if body.structured_outputs is not None else "response_format"
                    raise RequestError(400, f"{field}: {error}", param=field) from None
            return [model.prepare(
                ids, max_new_tokens=max_new, method=method,
                method_options=drafter_options, temperature=body.temperature,
                top_p=body.top_p if body.top_p < 1.0 else None, top_k=body.top_k, min_p=body.min_p,
                presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
                logit_bias=body.token_bias, seed=seed, stop=body.stops, ignore_eos=body.ignore_eos,
                logprobs=body.logprob_alternatives, logprobs_mode=options.logprobs_mode, constraint=constraint,
            ) for seed in seeds]
        except OptionError as error:
            raise RequestError(400, str(error), param="method_options") from None
        except ImportError as error:  # an optional part this server was installed without
            raise RequestError(400, f"this server cannot do that: {error}") from None
        except (ValueError, TypeError) as error:
            raise RequestError(400, str(error)) from None
        except OSError as error:  # the server's own drafter files: the operator's to fix, not the client's to read
            logger.error("preparing a request for method %r failed: %s", body.method or options.method, error)
            raise RequestError(500, f"method {body.method or options.method!r} is unavailable on this server (its "
                                    "drafter could not be loaded; see the server's log)", kind="server_error") from None

    async def _respond(request: Request, body: GenerationFields, jobs: list[Job], *, chat: bool):
        identity = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_sse(jobs, body, identity, created, chat), media_type="text/event-stream")
        texts: list[list[str]] = [[] for _ in jobs]
        entries: list[list[TokenLogprob]] = [[] for _ in jobs]
        try:
            async for index, chunk in _merged(jobs, request):
                texts[index].append(chunk.text)
                entries[index].extend(chunk.logprobs or ())
        finally:
            for job in jobs:
                job.cancelled.set()  # no-op when done; frees the rows if this handler was cancelled or its client left
        asked = body.logprob_alternatives is not None
        choices = []
        for index, (job, text) in enumerate(zip(jobs, texts)):
            finish = _finish_reason(job.stats.stop_reason)
            metrics.record_finished(job.stats, finish)
            if chat:
                logprobs = chat_logprobs(entries[index], model.token_strings) if asked else None
                choices.append({"index": index, "message": {"role": "assistant", "content": "".join(text)},
                                "logprobs": logprobs, "finish_reason": finish})
            else:
                logprobs = CompletionLogprobs(model.token_strings).fields(entries[index]) if asked else None
                choices.append({"index": index, "text": "".join(text), "logprobs": logprobs, "finish_reason": finish})
        return {"id": identity, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": options.model_name, "choices": choices, "usage": _usage(jobs)}

    async def _merged(jobs: list[Job], request: Request | None = None):
        """(choice index, chunk) of every job as they come; the first failure fails all."""
        if len(jobs) == 1:
            async for chunk in _chunks(jobs[0], request):
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job: Job) -> None:
            try:
                async for chunk in _chunks(job, request):
                    await queue.put((index, chunk, None))
            except RequestError as error:
                await queue.put((index, None, error))
            await queue.put((index, None, None))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(jobs)
            while running:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    running -= 1
                else:
                    yield index, chunk
        finally:
            for task in tasks:
                task.cancel()

    async def _sse(jobs: list[Job], body: GenerationFields, identity: str, created: int,
                   chat: bool) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> bytes:
            data = {"id": identity, "object": kind, "created": created, "model": options.model_name, "choices": choices}
            if body.include_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        asked = body.logprob_alternatives is not None
        completion_logprobs = [CompletionLogprobs(model.token_strings) for _ in jobs]

        def choice(index: int, text: str | None, finish: str | None, first: bool = False,
                   entries: list[TokenLogprob] | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                logprobs = chat_logprobs(entries, model.token_strings) if entries else None
                return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            logprobs = completion_logprobs[index].fields(entries) if entries else None
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

        finished = False
        try:
            if chat:
                for index in range(len(jobs)):
                    yield event([choice(index, None, None, first=True)])
            async for index, chunk in _merged(jobs):
                if chunk.text or (asked and chunk.token_ids):
                    yield event([choice(index, chunk.text, None, entries=chunk.logprobs)])
            for index, job in enumerate(jobs):
                finish = _finish_reason(job.stats.stop_reason)
                yield event([choice(index, None, finish)])
                metrics.record_finished(job.stats, finish)
            if body.include_usage:
                yield event([], _usage(jobs))
            yield SSE_DONE
            finished = True
        except RequestError as error:  # the generation failed after the response began
            yield b"data: " + json.dumps(error_body(str(error), error.kind)).encode() + b"\n\n"
            yield SSE_DONE
        finally:
            if not finished:
                for job in jobs:
                    job.cancelled.set()  # the client went away: the worker stops these rows at their next round

    async def _chunks(job: Job, request: Request | None = None):
        """The job's chunks; with `request` (a response not yet begun), a client that
        disconnects cancels the job, as a closed stream does."""
        checked = time.monotonic()
        while True:
            if request is None:
                kind, payload = await job.events.get()
            else:
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise RequestError(499, "the client closed the connection", code="client_closed")
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
            if kind == "chunk":
                yield payload
            elif kind == "done":
                return
            elif isinstance(payload, RequestFailed) and payload.invalid:
                metrics.errors.labels(status="400").inc()
                raise RequestError(400, f"this request's generation failed: {payload}")
            elif isinstance(payload, WorkerUnavailable):
                metrics.errors.labels(status="503").inc()
                raise RequestError(503, str(payload), kind="server_error", code="service_unavailable")
            else:
                metrics.errors.labels(status="500").inc()
                raise RequestError(500, f"generation failed: {payload}", kind="server_error")

    return app


def _build_grammar_vocabulary(model: LongSpecModel) -> None:
    try:
        model.grammar_vocabulary()
    except (ImportError, ValueError) as error:  # structured requests will get the same reason
        logger.warning("structured output is unavailable: %s", error)


def _finish_reason(stop_reason: str) -> str:
    return "length" if stop_reason == "length" else "stop"


def _usage(jobs: list[Job]) -> dict:
    """OpenAI's usage: the prompt once, the completions of every choice."""
    prompt, completion = jobs[0].stats.prompt_tokens, sum(len(job.token_ids) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
