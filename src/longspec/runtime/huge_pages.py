"""Weights on transparent huge pages (Linux).

A CPU decode step streams every weight matrix once, so its speed is the rate at which
weights come from memory. With 4 KiB pages that stream crosses a page — a TLB miss
and a page walk — every 4 KiB (about 130,000 times per token for Gemma 3 270M); with
2 MiB pages, 512 times fewer. Linux backs an anonymous mapping with huge pages when
the mapping is advised (`MADV_HUGEPAGE`) before its pages are first touched, which is
the default "madvise" policy of most distributions. So the weights are copied once,
at load, into one such mapping; where the kernel has no huge pages, or Python's
`mmap` lacks `madvise`, nothing changes.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_THP_POLICY = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_policy() -> str:
    """The kernel's transparent-huge-page policy ("always", "madvise", "never"), or
    "unavailable" off Linux or without THP."""
    try:
        text = _THP_POLICY.read_text()
    except OSError:
        return "unavailable"
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen or "unavailable"


def huge_page_buffers(sizes: list[int]) -> list[torch.Tensor] | None:
    """Byte buffers of `sizes`, each on its own 2 MiB-aligned pages of one anonymous mapping
    advised for huge pages (untouched: the kernel gives each huge page when it is first
    written), or None where the machine offers no huge pages."""
    if huge_page_policy() not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # each on its own pages
    if not sizes:
        return []
    try:
        mapping = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as error:
        logger.info("weights stay on normal pages (%s)", error)
        return None
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    start = -arena.data_ptr() % HUGE_PAGE_BYTES  # huge pages need 2 MiB-aligned addresses
    return [arena[start + offset : start + offset + size] for size, offset in zip(sizes, offsets)]


def move_to_huge_pages(parameters: list[torch.nn.Parameter]) -> bool:
    """Copy CPU `parameters` into one anonymous mapping advised for huge pages and
    point them at it. Returns whether they moved (False, with nothing changed, where
    the machine offers no huge pages)."""
    todo = [p for p in parameters if p.device.type == "cpu"]
    buffers = huge_page_buffers([p.numel() * p.element_size() for p in todo])
    if buffers is None:
        return False
    for p, buffer in zip(todo, buffers):
        moved = buffer.view(p.dtype).view(p.shape)
        moved.copy_(p.data)
        p.data = moved
    return True


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """How many bytes of the pages under `tensor` the kernel backs with huge pages
    (`AnonHugePages` of its mapping in /proc/self/smaps), or None where that cannot be read."""
    address = tensor.data_ptr()
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            begin, _, end = head.partition("-")
            try:
                inside = int(begin, 16) <= address < int(end, 16)
            except ValueError:
                inside = False
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
