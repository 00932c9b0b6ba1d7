"""The library of native CPU kernels (`kernels/*.cpp`): built once per machine on first
use with PyTorch's extension builder (a C++ compiler and ninja), then loaded from its
cache (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions) in about a second.

Each kernel has a PyTorch fallback. Where the library cannot be had (no compiler or
ninja, a build error, not x86-64, or LONGSPEC_NATIVE_KERNELS=0) the fallbacks run and
the reason is logged once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from longspec.runtime.progress import phase
from longspec.runtime.setup_time import one_time

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.cpp"))
HEADERS = sorted(KERNELS.glob("*.h"))
LIBRARY = "longspec_native"
DISABLE_VARIABLE = "LONGSPEC_NATIVE_KERNELS"


# `functools.cache` lets two threads' first calls both run the body (`prebuild`'s thread and a
# load): both would register the library's operators, and a second registration aborts the process.
_FIRST_CALL = threading.Lock()


def native_ops():
    """`torch.ops.longspec_native`, or None (the reason logged once)."""
    with _FIRST_CALL:
        return _built_or_loaded()


@functools.cache
def _built_or_loaded():
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        log.info("native CPU kernels off (%s=0): PyTorch and oneDNN run instead", DISABLE_VARIABLE)
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.warning("native CPU kernels are built for x86-64 only; PyTorch and oneDNN run instead")
        return None
    try:
        from torch.utils.cpp_extension import load

        # The lock before the progress line: a thread waiting for another's build (`prebuild`) says nothing.
        with one_time("kernels"), _build_lock(), phase("building the native CPU kernels (once per machine)"):
            load(
                name=LIBRARY,
                sources=[str(source) for source in SOURCES],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as error:
        text = str(error).strip()
        reason = text.splitlines()[0] if text else type(error).__name__
        log.warning("native CPU kernels could not be built (%s); PyTorch and oneDNN run instead, decode is slower", reason)
        return None
    return getattr(torch.ops, LIBRARY)


def prebuild() -> None:
    """Build or load the library on a thread of its own: the compiler runs in other processes,
    so on a fresh machine the build overlaps a load's conversion and reading (`load_target`);
    the first `native_ops()` on another thread then waits for it (its lock), counted as kernels."""
    threading.Thread(target=native_ops, name="longspec-native-kernels", daemon=True).start()


@contextlib.contextmanager
def _build_lock():
    """Hold a lock of our own while PyTorch builds or loads the library. PyTorch's own
    build lock is a file that a process killed mid-build leaves behind, and every later
    process would wait on it forever; ours is released by the kernel when its holder
    dies, so a `lock` file found while holding ours is a dead builder's: removed."""
    from filelock import FileLock
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(LIBRARY, False))
    with FileLock(str(directory / "longspec-build.lock")):
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing the build lock of a native-kernel build that was killed (%s)", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def kernels_identity() -> str:
    """What a measured speed depends on: a digest of the kernel sources in use, or
    "none" where the library is unavailable (cost-model caches key on it)."""
    if native_ops() is None:
        return "none"
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def sources_identity(*names: str) -> str:
    """A digest of some kernel sources (and the shared headers): what a layout made for
    those kernels depends on, unchanged by edits to the others."""
    digest = hashlib.sha256()
    for source in [KERNELS / name for name in names] + HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def attention_ops():
    """The native ops whose attention kernels (few-query and ordered attention) run on this
    CPU: AVX-512 BF16 dot products, or float32 FMAs on AVX2 CPUs; None where the library or
    both instruction sets are missing."""
    ops = native_ops()
    if ops is None:
        return None
    if not ops.attention_supported():
        log.warning("this CPU has neither AVX-512 BF16 nor AVX2 with FMA: attention runs PyTorch's flash kernel, "
                    "and a token verified in a tree may round differently from the same token decoded alone")
        return None
    return ops


@functools.cache
def bf16_linear_ops():
    """The native ops whose bf16 product (`bf16_packed_linear`) runs on this CPU: AVX-512
    BF16 dot products, or float32 FMAs over the same packed weight on AVX2 CPUs; None
    where the library or both instruction sets are missing."""
    ops = native_ops()
    if ops is None:
        return None
    if not ops.bf16_linear_supported():
        log.warning("this CPU has neither AVX-512 BF16 nor AVX2 with FMA: bf16 linear layers use oneDNN")
        return None
    return ops


def bf16_speculation_is_exact() -> bool:
    """Whether bf16 speculative decoding on this CPU returns plain bf16 decoding's tokens
    bit for bit: the product and attention both run here on kernels whose arithmetic does
    not depend on what else a forward holds (trees of up to 64 nodes; docs/devices.md#default-dtype)."""
    return attention_ops() is not None and bf16_linear_ops() is not None
