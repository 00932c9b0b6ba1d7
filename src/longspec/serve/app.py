"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions (streaming as Server-Sent Events), /health and /metrics.

The app wires routes to the request path (`service.py`: parse, check, prepare, admit)
and the answer (`render.py`); the generation worker batches the requests (continuous
batching). It talks to the model's public API, never to caches or drafters. Every
refusal is an OpenAI-style JSON error with the status a client expects: 400 invalid
request, 401 missing or wrong key, 404 unknown model, 405 wrong method (with `Allow`),
415 not JSON, 429 at the concurrency limit (with `Retry-After`), 431 oversized headers.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from longspec.api import LongSpecModel
from longspec.serve import openapi
from longspec.serve.errors import RequestError, error_body
from longspec.serve.guard import RequestGuard
from longspec.serve.limits import LimitError
from longspec.serve.metrics import ServerMetrics
from longspec.serve.options import ServeOptions
from longspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from longspec.serve.render import ResponseWriter
from longspec.serve.service import CompletionService
from longspec.serve.worker import GenerationWorker
from longspec.speculation.cost_model import queue_forward_costs
from longspec.speculation.grammar import warm_grammar_library
from longspec.speculation.methods import make_drafter

__all__ = ["ServeOptions", "create_app"]
logger = logging.getLogger("longspec.serve")


def create_app(model: LongSpecModel, options: ServeOptions) -> FastAPI:
    metrics = ServerMetrics()
    service = CompletionService(model, options)
    writer = ResponseWriter(model, metrics, options.model_name)
    for method, configured in options.method_options.items():
        make_drafter(method, **configured)  # a wrong path or option fails at startup, not in a request
    model.separate_encoding()  # prompts are tokenized beside the generation thread's detokenizing
    _ = model.model.certified_head  # built now (seconds for a large vocabulary), not in the first request
    queue_forward_costs(model.model, service.batch.max_rows)  # measured while the server idles, never in a request
    # The grammar matcher's vocabulary is built by the first structured request (seconds for a large
    # vocabulary, holding the tokenizer): built at startup, it held every first request's tokenizing.
    # Its library is imported here, not inside the first structured request.
    warm_grammar_library()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker = GenerationWorker(model, metrics, options.max_concurrent, service.batch)
        app.state.state["worker"] = service.worker
        try:
            yield
        finally:
            app.state.state.pop("worker")
            service.worker.close()

    # No interactive docs: the API is OpenAI's (docs/serving.md); the schema stays behind the key.
    app = FastAPI(title="longspec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics, app.state.state, app.state.batch, app.state.service = metrics, {}, service.batch, service
    _add_error_handlers(app, metrics)
    app.add_middleware(RequestGuard, key=options.api_key, metrics=metrics)
    app.openapi = lambda: app.openapi_schema or _cache_document(app, options)

    @app.get("/health")
    async def health():
        worker = service.worker
        if worker is not None and not worker.alive:
            return JSONResponse({"status": "unavailable", "reason": "the generation thread has stopped"},
                                status_code=503)
        return {"status": "ok", "requests_in_flight": worker.admitted if worker else 0}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        # vLLM's fields; chat requests without max_tokens generate up to the default (docs/serving.md).
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                             "owned_by": "longspec", "max_model_len": service.context,
                                             "max_prompt_tokens": service.prompt_limit,
                                             "max_new_tokens": options.max_new_tokens,
                                             "default_max_tokens": {"completions": 16,
                                                                    "chat.completions": options.max_new_tokens}}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await service.parse(request, CompletionRequest)
        return await writer.respond(request, body, await service.admit(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await service.parse(request, ChatCompletionRequest)
        return await writer.respond(request, body, await service.admit(body), chat=True)

    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        return answer(error.status, error_body(str(error), error.kind, error.param, error.code), error.headers)

    @app.exception_handler(LimitError)
    async def limit_error(request: Request, error: LimitError) -> JSONResponse:
        return answer(error.status, error_body(str(error), "invalid_request_error", None, error.code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # 404 and 405 from the router; its headers (405's `Allow`) are kept.
        return answer(error.status_code, error_body(str(error.detail), "invalid_request_error"),
                      dict(error.headers or {}))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("a request failed unexpectedly")
        return answer(500, error_body("internal server error (the server's log has the cause)", "server_error"))


def _cache_document(app: FastAPI, options: ServeOptions) -> dict:
    app.openapi_schema = openapi.document(app, with_key=options.api_key is not None)
    return app.openapi_schema
