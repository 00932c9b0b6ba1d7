"""The completion routes' request path as plain steps, each testable alone:

    parse (body -> validated request) -> check (against this server's limits)
    -> prepare (tokenize, build drafters and grammars; off the event loop)
    -> admit (reserve, queue on the generation worker, score echoed prompts)
    -> respond (`render.py`: one JSON body, or Server-Sent Events)

A request is a batch of prompts (OpenAI's list forms; chat and a single prompt are a
batch of one) times `n` choices; every choice is a row of the batch engine, and choice
`index` is prompt `index // n`'s choice `index % n`, as OpenAI orders them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from longspec.api import LongSpecModel, PreparedRequest
from longspec.request import GenerationRequest
from longspec.serve.errors import RequestError, busy, unavailable
from longspec.serve.limits import parse_json, read_body
from longspec.serve.options import ServeOptions
from longspec.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from longspec.serve.request_options import OptionError, ServerLimits, check_request_options
from longspec.serve.worker import GenerationWorker, Job, QueueFull, RequestFailed, WorkerUnavailable
from longspec.speculation.batch_engine import BatchOptions
from longspec.speculation.logprobs import TokenLogprob
from longspec.speculation.methods import METHODS

logger = logging.getLogger("longspec.serve")
_FIELD_PREFIX = re.compile(r"^(\w+): ")


@dataclass
class PromptChoices:
    """One prompt of a request: its ids, its text as the client sent it (what `echo`
    returns; None for token ids until rendered), and one prepared request per choice
    (none when `max_tokens` is 0)."""

    ids: torch.Tensor
    text: str | None
    requests: list[PreparedRequest]


@dataclass
class Admitted:
    """A request in the worker: its prompts, the jobs of its choices in OpenAI's order,
    and each prompt's scored tokens when `echo` asked for their log-probabilities."""

    prompts: list[PromptChoices]
    jobs: list[Job]
    prompt_logprobs: list[list[TokenLogprob]] | None


class CompletionService:
    def __init__(self, model: LongSpecModel, options: ServeOptions) -> None:
        self.model, self.options = model, options
        self.context = model.config.max_position_embeddings
        self.prompt_limit = min(options.max_prompt_tokens or self.context, self.context)
        # A row holds the longest prompt with the largest output, a tree and the root.
        row_capacity = (min(self.prompt_limit + options.max_new_tokens, self.context)
                        + model.engine.options.max_tree_nodes + 1)
        self.batch = BatchOptions(max_rows=options.max_batch, row_capacity=row_capacity)
        self.server_limits = ServerLimits(prompt_tokens=self.prompt_limit)
        self.worker: GenerationWorker | None = None  # set while the app runs (its lifespan)

    # ----------------------------------------------------------------- parse
    async def parse(self, request: Request, kind: type[GenerationFields]) -> GenerationFields:
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise RequestError(415, f"the body must be JSON (Content-Type: application/json), got {content_type!r}",
                               code="unsupported_media_type")
        raw = await read_body(request, self.options.limits)
        data = await run_in_threadpool(parse_json, raw, self.options.limits)  # seconds for megabytes: off the loop
        body = validated(kind, data)
        self.check(body)
        return body

    def check(self, body: GenerationFields) -> None:
        """What the model and this server's flags allow, before any work."""
        options = self.options
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
        if isinstance(body, ChatCompletionRequest) and len(body.messages) > options.limits.max_messages:
            raise RequestError(400, f"{len(body.messages)} messages exceed this server's limit of "
                                    f"{options.limits.max_messages}", param="messages")
        if body.n > options.max_n:
            raise RequestError(400, f"n={body.n} exceeds this server's limit of {options.max_n} choices", param="n")
        prompts = body.prompts if isinstance(body, CompletionRequest) else []
        choices = body.prompt_count * body.n
        if choices > options.max_concurrent:
            raise RequestError(400, f"this request asks for {choices} choices ({body.prompt_count} prompts x n={body.n}), "
                                    f"more than this server admits at once ({options.max_concurrent}, "
                                    "--max-concurrent): send fewer prompts per request", param="prompt")
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, list) and len(prompt) > self.prompt_limit:
                which = "the prompt" if len(prompts) == 1 else f"prompt {index} of the batch"
                raise RequestError(400, f"{which} has {len(prompt)} tokens, more than this server's limit of "
                                        f"{self.prompt_limit}", param="prompt", code="context_length_exceeded")
        vocabulary = self.model.config.vocab_size
        beyond = sorted(token for token in body.token_bias if token >= vocabulary)
        if beyond:
            raise RequestError(400, f"logit_bias names token {beyond[0]}, outside the vocabulary [0, {vocabulary})",
                               param="logit_bias")

    # --------------------------------------------------------------- prepare
    def encoders(self, body: GenerationFields) -> list[tuple[str | None, Callable[[], torch.Tensor]]]:
        """(text as sent, tokenize) per prompt of the batch."""
        special = self.options.allow_special_tokens  # else control-token strings are plain text
        if isinstance(body, ChatCompletionRequest):
            messages = [m.for_template() for m in body.messages]
            return [(None, lambda: self.model.encode_chat(messages, limit=self.prompt_limit, special_tokens=special))]
        return [(prompt if isinstance(prompt, str) else None,
                 lambda prompt=prompt: self.model.encode(prompt, limit=self.prompt_limit, special_tokens=special))
                for prompt in body.prompts]

    def prepare(self, body: GenerationFields) -> list[PromptChoices]:
        """Everything that can fail on bad input, before anything is queued: one prepared
        request per choice (choice i of every prompt draws from seed + i, so a batch's
        prompt j equals the same prompt sent alone)."""
        method = body.method or self.options.method
        try:
            constraint = body.constraint
            if constraint is not None:
                try:
                    constraint.grammar()  # compiled before any work, so that its error names the field
                except ValueError as error:
                    field = "structured_outputs" if body.structured_outputs is not None else "response_format"
                    raise RequestError(400, f"{field}: {error}", param=field) from None
            drafter_options = {**self.options.method_options.get(method, {}),
                               **check_request_options(method, body.method_options, self.server_limits)}
            prompts = [PromptChoices(self._encoded(encode, index, body.prompt_count), text, [])
                       for index, (text, encode) in enumerate(self.encoders(body))]
            if body.max_tokens == 0:  # echo alone: nothing to generate
                return prompts
            base = GenerationRequest.of(
                method=method, method_options=drafter_options, stop=body.stops, ignore_eos=body.ignore_eos,
                logprobs=body.logprob_alternatives, logprobs_mode=self.options.logprobs_mode, constraint=constraint,
                **body.sampling_fields())
            for prompt in prompts:
                room = self.context - prompt.ids.numel()
                max_new = body.max_tokens or max(1, min(self.options.max_new_tokens, room))
                seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
                prompt.requests = [self.model.prepare(prompt.ids, base.but(max_new_tokens=max_new, seed=seed))
                                   for seed in seeds]
            return prompts
        except OptionError as error:
            raise RequestError(400, str(error), param="method_options") from None
        except ImportError as error:  # an optional part this server was installed without
            raise RequestError(400, f"this server cannot do that: {error}") from None
        except (ValueError, TypeError) as error:
            message = str(error)
            named = _FIELD_PREFIX.match(message)
            raise RequestError(400, message, param=named.group(1) if named else None) from None
        except OSError as error:  # the server's own drafter files: the operator's to fix, not the client's to read
            logger.error("preparing a request for method %r failed: %s", method, error)
            raise RequestError(500, f"method {method!r} is unavailable on this server (its drafter could not be "
                                    "loaded; see the server's log)", kind="server_error") from None

    def _encoded(self, encode: Callable[[], torch.Tensor], index: int, count: int) -> torch.Tensor:
        which = "the prompt" if count == 1 else f"prompt {index} of the batch"
        try:
            ids = encode()
        except ValueError as error:
            raise RequestError(400, str(error) if count == 1 else f"{which}: {error}", param="prompt",
                               code="context_length_exceeded" if "limit" in str(error) else None) from None
        if ids.numel() > self.prompt_limit:
            raise RequestError(400, f"{which} has {ids.numel()} tokens, more than this server's limit of "
                                    f"{self.prompt_limit}", param="prompt", code="context_length_exceeded")
        return ids

    # ----------------------------------------------------------------- admit
    async def admit(self, body: GenerationFields) -> Admitted:
        """Counted in first (so that tokenizing and building drafters count against the
        concurrency limit), then prepared off the event loop, then queued; echoed prompts
        are scored on the generation thread while the choices decode."""
        worker = self.worker
        count = body.prompt_count * body.n
        reserved, jobs, scoring = 0, [], []
        try:
            for _ in range(count):  # every choice is a row, counted against the limit
                worker.reserve()
                reserved += 1
            prompts = await run_in_threadpool(self.prepare, body)
            for prompt in prompts:
                for prepared in prompt.requests:
                    jobs.append(worker.submit(prepared))
            prompt_logprobs = None
            if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
                scoring = [worker.score(prompt.ids, body.logprobs) for prompt in prompts]
                prompt_logprobs = list(await asyncio.gather(*scoring))
        except QueueFull as error:
            self._give_back(reserved, jobs, scoring)
            raise busy(str(error)) from None
        except WorkerUnavailable as error:
            self._give_back(reserved, jobs, scoring)
            raise unavailable(str(error)) from None
        except RequestFailed as error:  # scoring a prompt failed
            self._give_back(reserved, jobs, scoring)
            if error.invalid:
                raise RequestError(400, f"scoring the prompt failed: {error}", param="prompt") from None
            raise RequestError(500, f"scoring the prompt failed: {error}", kind="server_error") from None
        except ValueError as error:  # `submit`: a prompt and max_tokens that cannot fit a row
            self._give_back(reserved, jobs, scoring)
            raise RequestError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
        except BaseException:
            self._give_back(reserved, jobs, scoring)
            raise
        for _ in range(reserved - len(jobs)):  # echo alone (max_tokens 0): the reservations held the scoring
            worker.release()
        return Admitted(prompts, jobs, prompt_logprobs)

    def _give_back(self, reserved: int, jobs: list[Job], scoring: list[asyncio.Future]) -> None:
        """Undo a request's admission: reservations not yet submitted are released, jobs
        already queued are cancelled (the worker releases theirs), scoring is dropped."""
        for job in jobs:
            job.cancelled.set()
        for future in scoring:
            future.cancel()
        for _ in range(reserved - len(jobs)):
            self.worker.release()


def validated(kind: type[BaseModel], data) -> GenerationFields:
    """The body as a request of `kind`, or a 400 naming the first field at fault."""
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if param is None:  # a rule across fields names its field first ("max_tokens: ...")
            named = _FIELD_PREFIX.match(message)
            param = named.group(1) if named and named.group(1) in kind.model_fields else None
            raise RequestError(400, message, param=param) from None
        raise RequestError(400, f"{param}: {message}", param=param) from None
