"""A line on stderr for one-time work that turns out slow.

Building the kernels, the certified head's copy or measuring the forward cost takes
from a second to a minute; a silent wait that long looks like a hang. `phase(what)`
says nothing when the work ends within `AFTER_S`, else one line when that time has
passed and one when it ends. Off with `set_enabled(False)` (the CLI's --quiet and
--json); by default on where stderr is a terminal.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

AFTER_S = 2.0
_enabled: bool | None = None


def set_enabled(enabled: bool | None) -> None:
    """True or False for this process; None: where stderr is a terminal."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def phase(what: str, after_s: float = AFTER_S) -> Iterator[None]:
    """Run the block; where it lasts beyond `after_s`, say `what` on stderr, then how long it took."""
    if not enabled():
        yield
        return
    start = time.perf_counter()
    said = threading.Event()

    def say() -> None:
        said.set()
        print(f"longspec: {what} ...", file=sys.stderr, flush=True)

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            print(f"longspec: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
