"""Runs admitted requests on one background thread that steps a continuous-batching
`BatchEngine`: every step, waiting requests join free rows (their prefill within the
engine's per-step budget) and all decoding rows advance one round in one target
forward. The asyncio side submits a `PreparedRequest` and reads its text chunks from
a queue; a request whose client went away is cancelled before the next step, which
frees its cache row at once."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from longspec.api import LongSpecModel, PreparedRequest, RowStream
from longspec.serve.metrics import ServerMetrics
from longspec.speculation.batch_engine import BatchOptions
from longspec.speculation.logprobs import PromptScorer, TokenLogprob
from longspec.speculation.metrics import GenerationStats

logger = logging.getLogger("longspec.serve")


@dataclass(eq=False)  # compared by identity
class Job:
    request: PreparedRequest
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: RowStream | None = None  # set once the engine has the request
    first_token: bool = True

    @property
    def stats(self) -> GenerationStats:
        return self.request.stats

    @property
    def token_ids(self) -> list[int]:
        return self.stream.token_ids if self.stream is not None else []

    def emit(self, kind: str, payload: object = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


@dataclass(eq=False)
class ScoreJob:
    """A prompt to score (`PromptScorer`), a piece between two rounds of the batch."""

    scorer: PromptScorer
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future

    def finish(self, entries: list[TokenLogprob] | None = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.result.done():  # its handler was cancelled (client gone)
                return
            if error is None:
                self.result.set_result(entries)
            else:
                self.result.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass


class CancelledRequest(Exception):
    """Told to a request that will get no more tokens (nobody may be listening)."""


class RequestFailed(Exception):
    """This request's own drafter or sampling failed; the other requests go on.
    `invalid` when the cause is a value the request chose (a ValueError or TypeError)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.invalid = isinstance(cause, (ValueError, TypeError))


class WorkerUnavailable(Exception):
    """The generation thread has stopped: nothing is generated until the server restarts."""


class QueueFull(Exception):
    """The concurrency limit is reached."""


class GenerationWorker:
    """`capacity` requests at most in the server (decoding, prefilling or waiting for
    a row); `batch` sizes the engine's rows."""

    def __init__(self, model: LongSpecModel, metrics: ServerMetrics, capacity: int, batch: BatchOptions) -> None:
        if capacity < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {capacity}")
        self.model = model
        self.metrics = metrics
        self.capacity = capacity
        self.engine = model.batch_engine(batch)
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._jobs: list[Job] = []  # in the engine (this thread only)
        self._scoring: list[ScoreJob] = []  # prompts being scored (this thread only)
        self._admitted = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.died: str | None = None  # why the generation thread stopped, if it did
        self._thread = threading.Thread(target=self._supervised, name="longspec-generation", daemon=True)
        self._thread.start()

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    @property
    def alive(self) -> bool:
        """Whether the generation thread is running (the server's /health reports it)."""
        return self._thread.is_alive() and self.died is None

    def reserve(self) -> None:
        """Count a request in before any work is done for it (tokenising, building its
        drafter): raises QueueFull at the limit, WorkerUnavailable when the generation
        thread has stopped. Follow with `submit`, or `release` if preparing it fails."""
        if not self.alive:
            raise WorkerUnavailable(f"the generation thread has stopped ({self.died}); restart the server")
        with self._lock:
            if self._admitted >= self.capacity:
                raise QueueFull(f"the server is at its limit of {self.capacity} concurrent requests; retry later")
            self._admitted += 1

    def release(self) -> None:
        """Give back a reservation whose request will not be submitted."""
        self._release_slot()

    def submit(self, request: PreparedRequest) -> Job:
        """Queue a reserved request (raises ValueError, the reservation kept for the
        caller to release, when it cannot fit a cache row); its events arrive on
        job.events: ("chunk", StreamChunk)..., then ("done", None) or ("error", exception)."""
        needed = self.model.row_slots(request)
        if needed > self.engine.batch.row_capacity:
            raise ValueError(
                f"this request needs {needed} cache slots (prompt {request.ids.numel()} + max_tokens "
                f"{request.decoding.max_new_tokens} + tree + 1) but this server's rows hold {self.engine.batch.row_capacity}; "
                "lower max_tokens or shorten the prompt"
            )
        job = Job(request, asyncio.get_running_loop())
        self._incoming.put(job)
        return job

    def score(self, ids, top: int) -> asyncio.Future:
        """The log-probabilities of the prompt's tokens after the first (`PromptScorer`),
        computed on the generation thread a piece between rounds, under the caller's
        reservation; the future fails with WorkerUnavailable if the thread stops."""
        if not self.alive:
            raise WorkerUnavailable(f"the generation thread has stopped ({self.died}); restart the server")
        loop = asyncio.get_running_loop()
        job = ScoreJob(self.model.prompt_scorer(ids, top), loop, loop.create_future())
        self._incoming.put(job)
        return job.result

    def close(self) -> None:
        """Stop: running requests end before the next step, queued ones never start."""
        self._closing.set()
        self._thread.join()

    # ---------------------------------------------------------------- thread
    def _supervised(self) -> None:
        """The generation loop; if it dies, every waiting request is told at once and
        /health fails, instead of handlers waiting forever."""
        try:
            self._serve()
        except BaseException as error:  # noqa: BLE001 - the thread must not die silently
            self.died = f"{type(error).__name__}: {error}"
            logger.exception("the generation thread died")
            unavailable = WorkerUnavailable("the generation thread has stopped; restart the server")
            for job in list(self._jobs):
                job.emit("error", unavailable)
            for scoring in self._scoring:
                scoring.finish(error=unavailable)
            while not self._incoming.empty():
                waiting = self._incoming.get_nowait()
                if isinstance(waiting, ScoreJob):
                    waiting.finish(error=unavailable)
                else:
                    waiting.emit("error", unavailable)

    def _serve(self) -> None:
        while not self._closing.is_set():
            self._admit(block=not self._jobs and not self._scoring)
            self._drop_cancelled()
            self._score_a_piece()
            self._publish()
            if not self.engine.has_work:
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - the shared forward failed: every row in it fails, the worker goes on
                # A request's own drafter or sampling errors never get here (they fail its
                # row alone, `decode_round`); this is the model's forward or the cache.
                logger.exception("a batched step failed; the requests in it fail")
                failure = RuntimeError("the batch's forward failed (a server error; the server's log has the cause)")
                for job in list(self._jobs):
                    self._leave(job, ("error", failure))
                # A step that failed midway may leave a forward uncommitted: start afresh.
                self.engine = self.model.batch_engine(self.engine.batch)
                continue
            self._deliver()
        for job in list(self._jobs):
            self._leave(job, ("error", CancelledRequest("the server is stopping")), cancelled=True)
        for scoring in self._scoring:
            scoring.finish(error=CancelledRequest("the server is stopping"))
        while not self._incoming.empty():
            waiting = self._incoming.get_nowait()
            if isinstance(waiting, ScoreJob):
                waiting.finish(error=CancelledRequest("the server is stopping"))
            else:
                self._refuse(waiting, "the server is stopping")
        self._publish()

    def _publish(self) -> None:
        """Gauges from the engine's own state: rows in use, requests without a row."""
        self.metrics.running.set(self.engine.active_rows)
        self.metrics.waiting.set(self.engine.waiting + self._incoming.qsize())
        self.metrics.kv_cache_bytes.set(self.engine.bytes_in_use())

    def _admit(self, block: bool) -> None:
        try:
            job = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(job, ScoreJob):
                self._scoring.append(job)
            elif job.cancelled.is_set():
                self._refuse(job, "the request was cancelled before it started")
            else:
                try:
                    job.stream = self.model.submit(self.engine, job.request)
                    self._jobs.append(job)
                except Exception as error:  # noqa: BLE001
                    self._release_slot()
                    job.emit("error", error)
            try:
                job = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _score_a_piece(self) -> None:
        """One piece of the oldest prompt being scored (a prompt of thousands of tokens
        does not hold every stream for its whole forward)."""
        if not self._scoring:
            return
        job = self._scoring[0]
        if job.result.cancelled():
            self._scoring.pop(0)
            return
        try:
            done = job.scorer.step()
        except Exception as error:  # noqa: BLE001 - this prompt's failure, not the server's
            logger.exception("scoring a prompt failed")
            self._scoring.pop(0)
            job.finish(error=RequestFailed(error))
            return
        if done:
            self._scoring.pop(0)
            job.finish(job.scorer.entries)

    def _drop_cancelled(self) -> None:
        for job in list(self._jobs):
            if job.cancelled.is_set():
                self._leave(job, ("error", CancelledRequest("the request was cancelled (client gone)")), cancelled=True)

    def _deliver(self) -> None:
        for job in list(self._jobs):
            try:
                for chunk in job.stream.pump():
                    if job.first_token and chunk.token_ids:
                        job.first_token = False
                        self.metrics.ttft.observe(time.perf_counter() - job.arrived)
                    job.emit("chunk", chunk)
            except Exception as error:  # noqa: BLE001 - its text pipeline (detokenizing, stop strings): its own failure
                self._leave(job, ("error", RequestFailed(error)))
                continue
            error = job.stream.handle.error
            if error is not None:
                self._leave(job, ("error", RequestFailed(error)))
            elif job.stream.ended:
                self._leave(job, ("done", None))

    def _leave(self, job: Job, event: tuple, cancelled: bool = False) -> None:
        if not job.stream.handle.finished and job.stream.handle in self.engine:
            self.engine.cancel(job.stream.handle)  # frees its cache row now
        self._jobs.remove(job)
        if cancelled:
            self.metrics.cancelled.inc()
            self.metrics.record_tokens(job.stats)
        self._release_slot()
        job.emit(*event)

    def _refuse(self, job: Job, reason: str) -> None:
        self.metrics.cancelled.inc()
        self._release_slot()
        job.emit("error", CancelledRequest(reason))

    def _release_slot(self) -> None:
        with self._lock:
            self._admitted -= 1
