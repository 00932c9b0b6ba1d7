"""What machine this is, for keys of per-machine measurements and report headers."""

from __future__ import annotations

import os
import platform
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


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, this process's included), where
    the operating system reports one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
