"""The served OpenAPI document: every route's request body (the pydantic models the
handlers validate with) and every status it answers, with OpenAI's error shape, so that
schema-driven tools (client generators, property-based testers) see the real API.

The handlers read their bodies themselves (limits on bytes, time and nesting come
before parsing), so FastAPI cannot infer the bodies: they are declared here."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from longspec.serve.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS = {
    400: "The request is invalid (the message names the field and the fix)",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    408: "The body did not arrive in time",
    413: "The body is larger than the server's limit",
    415: "The body is not JSON",
    429: "At the concurrency limit: retry after `Retry-After` seconds",
    431: "The headers are larger than the server's limit",
    500: "A server-side failure (the server's log has the cause)",
    503: "The generation thread has stopped",
}
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _error_responses(statuses) -> dict:
    schema = {"$ref": _REF.format(model="ErrorResponse")}
    return {str(status): {"description": ERRORS[status], "content": {"application/json": {"schema": schema}}}
            for status in statuses}


def document(app: FastAPI, *, with_key: bool) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, definitions = models_json_schema(
        [(model, "validation") for model in (*BODIES.values(), ErrorResponse)], ref_template=_REF)
    spec.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
    key_status = (401,) if with_key else ()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            model = BODIES.get(path) if method == "post" else None
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's own validation error: these handlers answer 400
            if model is not None:
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(model=model.__name__)}}}}
                responses["200"] = {"description": "The completion (JSON), or Server-Sent Events with stream: true",
                                    "content": {"application/json": {"schema": {"type": "object"}},
                                                "text/event-stream": {"schema": {"type": "string"}}}}
                responses.update(_error_responses((400, *key_status, 404, 408, 413, 415, 429, 431, 500, 503)))
            elif path == "/health":
                responses.update(_error_responses((431, 503)))
            elif path == "/metrics":
                responses["200"] = {"description": "Prometheus metrics",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
                responses.update(_error_responses((*key_status, 431)))
            else:
                responses.update(_error_responses((*key_status, 431)))
    if with_key:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
        spec["paths"]["/health"]["get"]["security"] = []
    return spec
