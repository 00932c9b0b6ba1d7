"""Builder processes for the tests of the model cache's prepared entries (the certified
head's copy, the prepared weights): start one, count its builds, wait until one is mid-build."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT_S = 120


def start_builder(worker: Path, *args: object) -> subprocess.Popen:
    """`worker` run with `args`; Ctrl-C restored, since a shell's background job inherits it ignored."""
    return subprocess.Popen([sys.executable, str(worker), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def builds(root: Path) -> int:
    log = root / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def wait_for_a_build(root: Path, worker: subprocess.Popen, partial: str) -> None:
    """Until `worker` has started a build whose temporary directory matches `partial` in `root`."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if builds(root) and list(root.glob(partial)):
            return
        if worker.poll() is not None:
            out, err = worker.communicate()
            raise AssertionError(f"the builder exited ({worker.returncode}) before building: {out}{err}")
        time.sleep(0.02)
    raise AssertionError("the builder never started building")
