"""When the forward cost is measured: never before a first token, never during decoding.

A machine's forward-cost curve (`cost_model`) is measured once and cached. Where it
is missing, the policy says what a lookup does:

- "background" (the default): the lookup returns the conservative default curve
  (`cost_defaults`) and queues the measurement. One daemon thread runs the queue at
  this process's quiet moments: when no decoding round has run for `QUIET_S`. A
  round that starts while it measures makes it wait for quiet again and time the
  current size anew (`pause_while_decoding`), so a request waits for at most one
  measured forward, and a curve timed beside decoding is never kept.
- "later" (`longspec generate`): the default curve, and nothing measured in this process.
  A CLI run decodes without pause and exits: its only quiet moment is its exit, where a
  measurement started would only hold the exit for a forward and be dropped. The curve
  waits for `longspec doctor` or a server's idle time.
- "now": the lookup measures before returning (benchmarks, which time after their
  warm-up; `longspec doctor`; the test suite). Also `LONGSPEC_COST_MEASUREMENT=now`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable

POLICIES = ("background", "later", "now")
VARIABLE = "LONGSPEC_COST_MEASUREMENT"
QUIET_S = 0.5  # no round for this long: the process is idle, the measurement may run

log = logging.getLogger("longspec")

_policy: str | None = None
_lock = threading.Lock()
_pending: dict[str, Callable[[], object]] = {}  # key -> measurement, in request order
_wake = threading.Event()
_thread: threading.Thread | None = None
_autostart = True  # False: requests only queue (tests that run the queue themselves)
_stopping = threading.Event()


class _Stopped(Exception):
    """The process is ending: the measurement in progress is dropped."""
_last_round = 0.0  # time.monotonic() of the latest decoding round in this process
_slice_start = 0.0


def policy() -> str:
    if _policy is not None:
        return _policy
    chosen = os.environ.get(VARIABLE, "background")
    if chosen not in POLICIES:
        raise ValueError(f"{VARIABLE}={chosen!r}: choose one of {', '.join(POLICIES)}")
    return chosen


def prefer(chosen: str) -> None:
    """`chosen` for this process unless a policy was already chosen (`set_policy` or the
    environment): a command's default that a caller's choice overrides."""
    if _policy is None and VARIABLE not in os.environ:
        set_policy(chosen)


def set_policy(chosen: str | None) -> None:
    """One of POLICIES for this process; None: back to the environment's."""
    global _policy
    if chosen is not None and chosen not in POLICIES:
        raise ValueError(f"the cost-measurement policy must be one of {', '.join(POLICIES)}, got {chosen!r}")
    _policy = chosen


def note_round() -> None:
    """A decoding round ran (called by every round): measurements wait for quiet."""
    global _last_round
    _last_round = time.monotonic()


def pending() -> int:
    with _lock:
        return len(_pending)


def request(key: str, measure: Callable[[], object]) -> None:
    """Queue a measurement (once per key) for the background thread; nothing under "later"."""
    global _thread
    if policy() == "later":
        return
    with _lock:
        if key in _pending:
            return
        _pending[key] = measure
        if _autostart and (_thread is None or not _thread.is_alive()):
            _thread = threading.Thread(target=_run, name="longspec-cost-measurement", daemon=True)
            _thread.start()
    _wake.set()


def measure_pending() -> int:
    """Run every queued measurement now, on this thread (`longspec doctor`); how many ran."""
    done = 0
    while True:
        with _lock:
            if not _pending:
                return done
            key, measure = next(iter(_pending.items()))
        measure()
        with _lock:
            _pending.pop(key, None)
        done += 1


def in_background() -> bool:
    """Whether this thread is the background measurement's."""
    return _thread is not None and threading.current_thread() is _thread


def pause_while_decoding() -> bool:
    """Asked between a measurement's forwards: True (after waiting for quiet) when a
    round ran since the last ask, so the forwards of this size are timed again."""
    global _slice_start
    if threading.current_thread() is not _thread:
        return False  # measured on the caller's thread ("now", doctor): nothing competes
    if _stopping.is_set():
        raise _Stopped
    if _last_round < _slice_start:
        _slice_start = time.monotonic()
        return False
    _wait_for_quiet()
    _slice_start = time.monotonic()
    return True


def _wait_for_quiet() -> None:
    while (quiet_for := time.monotonic() - _last_round) < QUIET_S:
        if _stopping.wait(QUIET_S - quiet_for):
            raise _Stopped


def stop(timeout_s: float = 5.0) -> None:
    """End the background thread (at exit: a thread killed inside a native forward
    aborts the process), dropping the measurement in progress; the queue stays."""
    global _thread
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    _stopping.set()
    _wake.set()
    thread.join(timeout_s)
    _thread = None
    _stopping.clear()


atexit.register(stop)


def _run() -> None:
    global _slice_start
    while not _stopping.is_set():
        _wake.wait()
        with _lock:
            if not _pending:
                _wake.clear()
                continue
            key, measure = next(iter(_pending.items()))
        try:
            _wait_for_quiet()
            _slice_start = time.monotonic()
            measure()
        except _Stopped:
            return
        except Exception as error:  # noqa: BLE001 - a failed measurement leaves the default in use
            log.warning("measuring the forward cost in the background failed (%s); the default curve stays in use",
                        error)
        with _lock:
            _pending.pop(key, None)
