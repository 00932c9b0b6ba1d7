"""Crash-safe, concurrent-safe entries of the longspec cache (``$LONGSPEC_CACHE``).

An entry is a directory built once (the embedded model's converted checkpoint) and
read by every later run. Whatever happens while it is built — Ctrl-C, SIGKILL, a full
disk, a second process building the same entry — a later run either finds a complete,
verified entry or rebuilds it:

* atomic: the builder writes into a fresh temporary directory beside the entry
  (unique name, same file system), every file is fsynced, a manifest of file sizes
  and SHA-256 digests is written last, and the directory is renamed into place;
* verified: an entry is used only if its manifest exists and every file has the
  recorded size (no other files); a partial or foreign entry is rebuilt, with one
  line saying so;
* concurrent-safe: builders of one entry take a file lock; a process that loses the
  race waits, then uses the winner's entry. Temporary directories left by killed
  builders are removed by the next builder (it holds the lock, so none is live).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

MANIFEST = "longspec-cache.json"
MANIFEST_FORMAT = "longspec-cache/1"
# After this long waiting for the lock, say that another process is building.
_WAIT_NOTICE_S = 1.0
_HASH_BLOCK = 1 << 20

log = logging.getLogger("longspec")


class CacheWriteError(OSError):
    """The cache could not be written (disk full, permissions): names the directory,
    the bytes needed and the LONGSPEC_CACHE variable."""


def entry_problem(entry: Path) -> str | None:
    """Why `entry` cannot be used (None when it is complete)."""
    if not entry.is_dir():
        return "missing"
    manifest_path = entry / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return "it has no manifest (an interrupted build, or one by an older longspec)"
    except (OSError, ValueError) as error:
        return f"its manifest is unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        return "its manifest is not a longspec cache manifest"
    recorded = manifest["files"]
    present = {p.name for p in entry.iterdir()} - {MANIFEST}
    if present != set(recorded):
        extra, lacking = sorted(present - set(recorded)), sorted(set(recorded) - present)
        return f"its files differ from the manifest (unexpected {extra}, missing {lacking})"
    for name, info in recorded.items():
        size = (entry / name).stat().st_size
        if size != info.get("size"):
            return f"{name} has {size} bytes, the manifest records {info.get('size')} (truncated or replaced)"
    return None


def cached_entry(root: Path, name: str, build: Callable[[Path], None], *, what: str, needed_bytes: int = 0) -> Path:
    """``root/name``, built by ``build(temporary_directory)`` unless a complete entry
    exists. ``needed_bytes`` (an estimate of what the build writes) is checked against
    the free space before building and named if the disk fills up anyway."""
    entry = root / name
    if entry_problem(entry) is None:
        return entry
    with _storage_errors(root, needed_bytes, what):
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f".{name}.lock"))
        try:
            lock.acquire(timeout=_WAIT_NOTICE_S)
        except Timeout:
            log.warning("waiting for another longspec process that is building %s in %s", what, root)
            lock.acquire()
        try:
            problem = entry_problem(entry)
            if problem is None:  # another process built it while we waited
                return entry
            if problem != "missing":
                log.warning("the cached %s at %s is incomplete or corrupt (%s); rebuilding it", what, entry, problem)
                _remove(entry)
            _remove_stale_builds(root, name)
            ensure_free_space(root, needed_bytes, what)
            _build_atomically(root, name, build)
        finally:
            lock.release()
    return entry


def discard_entry(entry: Path) -> None:
    """Remove a complete entry found damaged by its reader (moved aside first, so no
    reader sees it half-deleted); the next `cached_entry` builds it again."""
    lock = FileLock(str(entry.parent / f".{entry.name}.lock"))
    with lock:
        if entry.exists():
            _remove(entry)


def ensure_free_space(directory: Path, needed_bytes: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if needed_bytes > free:
        raise CacheWriteError(
            errno.ENOSPC,
            f"not enough free disk space for {what} in {directory}: it needs about {_mib(needed_bytes)}, "
            f"{_mib(free)} are free; free some space or set LONGSPEC_CACHE to a directory on a larger disk",
        )


# ----------------------------------------------------------------------- internals
def _build_atomically(root: Path, name: str, build: Callable[[Path], None]) -> None:
    temporary = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
    try:
        build(temporary)
        temporary.chmod(_DIRECTORY_MODE & ~_umask())  # mkdtemp's 0700 would hide the entry from other users
        _write_manifest(temporary)
        _fsync_directory(temporary)
        temporary.rename(root / name)
        _fsync_directory(root)
    except BaseException:  # Ctrl-C included: leave nothing half-built behind
        shutil.rmtree(temporary, ignore_errors=True)
        raise


_DIRECTORY_MODE = 0o777


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_manifest(directory: Path) -> None:
    files = {}
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            raise ValueError(f"a cache entry holds only files; {path} is not one")
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
            os.fsync(handle.fileno())
        files[path.name] = {"size": path.stat().st_size, "sha256": digest.hexdigest()}
    manifest = directory / MANIFEST
    with manifest.open("w") as handle:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Move aside first (atomic), then delete: a reader never sees a half-deleted entry."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".trash", dir=path.parent))
    path.rename(trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_builds(root: Path, name: str) -> None:
    for pattern in (f".{name}.*.partial", f".{name}.*.trash", f"{name}.partial"):
        for stale in root.glob(pattern):
            log.warning("removing %s, left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)


class _storage_errors:
    """Turn disk-full and permission errors into one message naming the fix."""

    def __init__(self, root: Path, needed_bytes: int, what: str) -> None:
        self.root, self.needed, self.what = root, needed_bytes, what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if not isinstance(error, OSError) or isinstance(error, CacheWriteError):
            return False
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheWriteError(
                error.errno,
                f"the disk filled up while writing {self.what} to {self.root} (it needs about {_mib(self.needed)}); "
                "free some space or set LONGSPEC_CACHE to a directory on a larger disk",
            ) from error
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CacheWriteError(
                error.errno,
                f"cannot write {self.what} to {self.root} ({os.strerror(error.errno)}); "
                "set LONGSPEC_CACHE to a writable directory",
            ) from error
        return False


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
