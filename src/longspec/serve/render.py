"""An admitted request's answer: one JSON body, or Server-Sent Events as the choices'
chunks arrive. Choice `index` reads job `index` (OpenAI's order: prompt-major, then
`n`); an echoed prompt comes first in its choices' text, with its tokens'
log-probabilities when they were asked for."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from longspec.api import LongSpecModel
from longspec.serve.errors import RequestError, error_body, unavailable
from longspec.serve.logprob_fields import CompletionLogprobs, chat_logprobs, joined
from longspec.serve.metrics import ServerMetrics
from longspec.serve.protocol import CompletionRequest, GenerationFields
from longspec.serve.service import Admitted
from longspec.serve.worker import Job, RequestFailed, WorkerUnavailable
from longspec.speculation.logprobs import TokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there


class ResponseWriter:
    def __init__(self, model: LongSpecModel, metrics: ServerMetrics, model_name: str) -> None:
        self.model, self.metrics, self.model_name = model, metrics, model_name

    async def respond(self, request: Request, body: GenerationFields, admitted: Admitted, *, chat: bool):
        identity = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self.events(body, admitted, identity, created, chat),
                                     media_type="text/event-stream")
        jobs = admitted.jobs
        texts: list[list[str]] = [[] for _ in jobs]
        entries: list[list[TokenLogprob]] = [[] for _ in jobs]
        try:
            async for index, chunk in self.merged(jobs, request):
                texts[index].append(chunk.text)
                entries[index].extend(chunk.logprobs or ())
        finally:
            for job in jobs:
                job.cancelled.set()  # no-op when done; frees the rows if this handler was cancelled or its client left
        asked = body.logprob_alternatives is not None
        choices = []
        for index in range(admitted_choices(body)):
            job = jobs[index] if jobs else None
            finish = self._finished(job)
            text = "".join(texts[index]) if job else ""
            if chat:
                logprobs = chat_logprobs(entries[index], self.model.token_strings) if asked else None
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": finish})
                continue
            fields = CompletionLogprobs(self.model.token_strings)
            parts = []
            echo = self._echo(body, admitted, index, fields)
            if echo is not None:
                text = echo[0] + text
                parts.append(echo[1])
            if asked:
                parts.append(fields.fields(entries[index] if job else []))
            choices.append({"index": index, "text": text, "logprobs": joined(*parts) if asked else None,
                            "finish_reason": finish})
        return {"id": identity, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage(admitted)}

    def _echo(self, body: GenerationFields, admitted: Admitted, index: int,
              fields: CompletionLogprobs) -> tuple[str, dict | None] | None:
        """(the prompt's text, its logprobs fields or None) for a choice that echoes it."""
        if not (isinstance(body, CompletionRequest) and body.echo):
            return None
        which = index // body.n
        prompt = admitted.prompts[which]
        text = prompt.text if prompt.text is not None else self.model.text_of(prompt.ids.tolist())
        if admitted.prompt_logprobs is None:
            return text, None
        return text, fields.prompt_fields(int(prompt.ids[0]), admitted.prompt_logprobs[which])

    def _finished(self, job: Job | None) -> str:
        if job is None:  # an echo alone: the prompt is all there is, as a completion cut at 0 tokens
            return "length"
        finish = finish_reason(job.stats.stop_reason)
        self.metrics.record_finished(job.stats, finish)
        return finish

    async def merged(self, jobs: list[Job], request: Request | None = None):
        """(choice index, chunk) of every job as they come; the first failure fails all."""
        if len(jobs) == 1:
            async for chunk in self.chunks(jobs[0], request):
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job: Job) -> None:
            try:
                async for chunk in self.chunks(job, request):
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

    async def events(self, body: GenerationFields, admitted: Admitted, identity: str, created: int,
                     chat: bool) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        jobs = admitted.jobs

        def event(choices: list, usage_: dict | None = None) -> bytes:
            data = {"id": identity, "object": kind, "created": created, "model": self.model_name, "choices": choices}
            if body.include_usage:
                data["usage"] = usage_
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        asked = body.logprob_alternatives is not None
        count = admitted_choices(body)
        completion_logprobs = [CompletionLogprobs(self.model.token_strings) for _ in range(count)]

        def choice(index: int, text: str | None, finish: str | None, first: bool = False,
                   entries: list[TokenLogprob] | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                logprobs = chat_logprobs(entries, self.model.token_strings) if entries else None
                return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            logprobs = completion_logprobs[index].fields(entries) if entries else None
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

        finished = False
        try:
            for index in range(count):
                if chat:
                    yield event([choice(index, None, None, first=True)])
                    continue
                echo = self._echo(body, admitted, index, completion_logprobs[index])
                if echo is not None:
                    yield event([{"index": index, "text": echo[0], "logprobs": echo[1], "finish_reason": None}])
            async for index, chunk in self.merged(jobs):
                if chunk.text or (asked and chunk.token_ids):
                    yield event([choice(index, chunk.text, None, entries=chunk.logprobs)])
            for index in range(count):
                yield event([choice(index, None, self._finished(jobs[index] if jobs else None))])
            if body.include_usage:
                yield event([], usage(admitted))
            yield SSE_DONE
            finished = True
        except RequestError as error:  # the generation failed after the response began: no handler counts it
            self.metrics.errors.labels(status=str(error.status)).inc()
            yield b"data: " + json.dumps(error_body(str(error), error.kind)).encode() + b"\n\n"
            yield SSE_DONE
        finally:
            if not finished:
                for job in jobs:
                    job.cancelled.set()  # the client went away: the worker stops these rows at their next round

    async def chunks(self, job: Job, request: Request | None = None):
        """The job's chunks; with `request` (a response not yet begun), a client that
        disconnects cancels the job, as a closed stream does. Failures are raised as
        RequestError and counted where they are answered, once."""
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
                raise RequestError(400, f"this request's generation failed: {payload}")
            elif isinstance(payload, WorkerUnavailable):
                raise unavailable(str(payload))
            else:
                raise RequestError(500, f"generation failed: {payload}", kind="server_error")


def admitted_choices(body: GenerationFields) -> int:
    return body.prompt_count * body.n


def finish_reason(stop_reason: str) -> str:
    return "length" if stop_reason == "length" else "stop"


def usage(admitted: Admitted) -> dict:
    """OpenAI's usage: each prompt once, the completions of every choice."""
    prompt = sum(p.ids.numel() for p in admitted.prompts)
    completion = sum(len(job.token_ids) for job in admitted.jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
