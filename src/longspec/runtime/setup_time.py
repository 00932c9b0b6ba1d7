"""One-time work, timed apart from the work it delays.

Converting a model, building or loading the native kernels, packing weights, the
certified head's int8 copy, measuring the forward cost, compiling steps: each is paid
once per process (or once per machine, where a cache keeps it), and timed as decoding
it made the first run's tokens per second a fraction of the real rate. Such work runs
inside `one_time(part)`; a timer of real work subtracts what `one_time` spent on its
thread meanwhile (`Stopwatch`), and reports it by part instead.

Nested one-time work is counted once, under the innermost part (a head built from a
cache that first loads the kernels: the kernels' seconds under "kernels", the rest
under "certified_head").
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()
_lock = threading.Lock()
_process_totals: dict[str, float] = defaultdict(float)


def _thread_parts() -> dict[str, float]:
    parts = getattr(_local, "parts", None)
    if parts is None:
        parts = _local.parts = defaultdict(float)
        _local.stack = []
    return parts


@contextmanager
def one_time(part: str) -> Iterator[None]:
    """Time the block as one-time work of `part` (exclusive of nested one-time work)."""
    parts = _thread_parts()
    stack = _local.stack
    start = time.perf_counter()
    stack.append(0.0)  # seconds of nested one-time work inside this block
    try:
        yield
    finally:
        nested = stack.pop()
        elapsed = time.perf_counter() - start
        own = max(elapsed - nested, 0.0)
        parts[part] += own
        if stack:
            stack[-1] += elapsed
        with _lock:
            _process_totals[part] += own


def snapshot() -> dict[str, float]:
    """This thread's one-time seconds so far, by part (pass to `since`)."""
    return dict(_thread_parts())


def since(mark: dict[str, float]) -> dict[str, float]:
    """This thread's one-time seconds by part since `mark` (parts with none left out)."""
    now = _thread_parts()
    return {part: seconds - mark.get(part, 0.0) for part, seconds in now.items() if seconds > mark.get(part, 0.0)}


def process_totals() -> dict[str, float]:
    """Every thread's one-time seconds by part since the process started (server metrics)."""
    with _lock:
        return dict(_process_totals)


class Stopwatch:
    """Seconds of real work since it started: the wall time less the one-time work done
    on this thread meanwhile, which `setup` holds by part."""

    def __init__(self) -> None:
        self.mark = snapshot()
        self.start = time.perf_counter()
        self.setup: dict[str, float] = {}

    def stop(self) -> float:
        elapsed = time.perf_counter() - self.start
        self.setup = since(self.mark)
        return max(elapsed - sum(self.setup.values()), 0.0)
