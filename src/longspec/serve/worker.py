"""Runs admitted requests one at a time on a background thread (the engine serves
one sequence per forward until batching lands; this is the interface a batched
scheduler will keep). The asyncio side submits a prepared `TokenStream` and reads
its chunks from a queue; a request whose client went away is cancelled at its next
round, which closes its generator and frees its KV cache."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from longspec.api import TokenStream
from longspec.serve.metrics import ServerMetrics


@dataclass
class Job:
    stream: TokenStream
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload: object = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.cancelled.set()


class CancelledRequest(Exception):
    """Told to a request that will get no more tokens (nobody may be listening)."""


class QueueFull(Exception):
    """The concurrency limit is reached."""


class GenerationWorker:
    def __init__(self, metrics: ServerMetrics, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {capacity}")
        self.metrics = metrics
        self.capacity = capacity
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._admitted = 0
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="longspec-generation", daemon=True)
        self._thread.start()

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    def submit(self, stream: TokenStream) -> Job:
        """Admit a request (raises QueueFull at the limit); its events arrive on job.events:
        ("chunk", StreamChunk)..., then ("done", None) or ("error", exception)."""
        with self._lock:
            if self._admitted >= self.capacity:
                raise QueueFull(f"the server is at its limit of {self.capacity} concurrent requests; retry later")
            self._admitted += 1
        job = Job(stream, asyncio.get_running_loop())
        self.metrics.waiting.inc()
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Stop: the running request ends at its next round, queued ones never start."""
        self._closing.set()
        self._jobs.put(None)
        self._thread.join()

    # ---------------------------------------------------------------- thread
    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.waiting.dec()
            try:
                self._generate(job)
            finally:
                with self._lock:
                    self._admitted -= 1

    def _generate(self, job: Job) -> None:
        if self._closing.is_set():
            job.cancelled.set()
        if job.cancelled.is_set():  # gone before it started (or the server is stopping)
            self.metrics.cancelled.inc()
            job.emit("error", CancelledRequest("the request was cancelled before it started"))
            return
        self.metrics.running.inc()
        held = 0
        first_token = True
        chunks = iter(job.stream)
        try:
            for chunk in chunks:
                if not held and job.stream.stats.kv_cache_bytes:
                    held = job.stream.stats.kv_cache_bytes
                    self.metrics.kv_cache_bytes.inc(held)
                if first_token and chunk.token_ids:
                    first_token = False
                    self.metrics.ttft.observe(time.perf_counter() - job.arrived)
                job.emit("chunk", chunk)
                if job.cancelled.is_set() or self._closing.is_set():
                    chunks.close()  # ends the engine's generator: its cache is released
                    self.metrics.cancelled.inc()
                    self.metrics.record_tokens(job.stream.stats)
                    job.emit("error", CancelledRequest("the request was cancelled (client gone or server stopping)"))
                    return
            job.emit("done")
        except Exception as error:  # noqa: BLE001 - reported to the request, the worker keeps serving
            job.emit("error", error)
        finally:
            self.metrics.running.dec()
            self.metrics.kv_cache_bytes.dec(held)

