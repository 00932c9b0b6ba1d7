"""What machine this is, for keys of per-machine measurements and report headers."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else the platform's word."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_identity() -> dict:
    """CPU model and core count: what a timing measured here depends on."""
    return {"cpu": cpu_name(), "cores": os.cpu_count()}


def cores_busy_elsewhere(window_s: float = 0.25, clock=time.monotonic, sleep=time.sleep) -> float | None:
    """Cores kept busy by other processes right now: the machine's busy CPU time over a
    short window in which this process sleeps, less this process's own, where the
    operating system reports it (Linux's /proc/stat); else None. Unlike the load
    average, it does not count this process's own work of the last minute (a benchmark
    that measures between its own timed runs is not competing with anything)."""
    try:
        busy0, own0, start = _machine_busy_seconds(), _own_cpu_seconds(), clock()
        sleep(window_s)
        busy1, own1, elapsed = _machine_busy_seconds(), _own_cpu_seconds(), clock() - start
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(elapsed, 1e-9)


def _machine_busy_seconds() -> float:
    """CPU seconds every core spent outside idle and I/O wait since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already inside user time


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, this process's included), where
    the operating system reports one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
