"""Writes that a kill at any instant cannot half-do.

- `write_atomically`: a file is written beside its place, flushed to disk, then renamed
  over it (and its directory flushed): a reader sees the old file or the new one.
- `Checkpoint`: several files that belong together (weights, optimizer state, a config)
  commit as one: each is written as `NAME.next`, then a manifest naming every file with
  its SHA-256 and the run's inputs is renamed into place (the commit), then the files
  are renamed to their names. A run that finds `.next` files and a manifest that names
  them finishes the renames; `.next` files without it are dropped. `verify` refuses a
  directory whose files do not match its manifest, or whose inputs changed.
- `trim_torn_tail`: an append-only log of lines keeps every complete line; a line cut
  off by a kill is the only thing dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles: rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None] | bytes | str) -> None:
    """Replace `path` with what `write(temporary_path)` writes (or the given bytes or text)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(write):
            write(temporary)
        else:
            temporary.write_bytes(write.encode() if isinstance(write, str) else write)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _sync_directory(path.parent)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from as it is."""


class Checkpoint:
    """The files of one training run's checkpoint in `directory`, committed together."""

    MANIFEST = "checkpoint.json"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    @property
    def manifest_path(self) -> Path:
        return self.directory / self.MANIFEST

    def manifest(self) -> dict | None:
        """The committed manifest (after finishing an interrupted commit), or None."""
        self.recover()
        if not self.manifest_path.is_file():
            return None
        return json.loads(self.manifest_path.read_text())

    def recover(self) -> None:
        """Finish a commit that was interrupted after its manifest, or drop one that
        was interrupted before it."""
        if not self.directory.is_dir():
            return
        pending = sorted(self.directory.glob("*.next"))
        if not pending:
            return
        committed = json.loads(self.manifest_path.read_text()) if self.manifest_path.is_file() else {"files": {}}
        for staged in pending:
            name = staged.name.removesuffix(".next")
            if committed["files"].get(name) == sha256_of(staged):
                os.replace(staged, self.directory / name)
            else:
                staged.unlink()  # a commit that never reached its manifest
        _sync_directory(self.directory)

    def commit(self, writers: dict[str, Callable[[Path], None]], inputs: dict, step: int) -> None:
        """Write every file (name -> writer of that path), then commit them as one.
        `inputs` describes what the run trains on (its corpus digest, its options): a
        resume with other inputs is refused (`verify`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.recover()
        hashes = {}
        for name, write in writers.items():
            staged = self.directory / f"{name}.next"
            write(staged)
            with open(staged, "rb+") as f:
                os.fsync(f.fileno())
            hashes[name] = sha256_of(staged)
        previous = json.loads(self.manifest_path.read_text()) if self.manifest_path.is_file() else {"files": {}}
        files = {**previous["files"], **hashes}
        write_atomically(self.manifest_path, json.dumps({"step": step, "inputs": inputs, "files": files}, indent=1,
                                                        sort_keys=True, default=str))
        for name in hashes:  # the commit point is behind us: roll forward
            os.replace(self.directory / f"{name}.next", self.directory / name)
        _sync_directory(self.directory)

    def verify(self, inputs: dict) -> dict | None:
        """The manifest of a checkpoint to resume from (None: nothing to resume), after
        checking every file against it and the run's inputs against the ones it was
        trained on; raises CheckpointError naming the difference."""
        manifest = self.manifest()
        if manifest is None:
            return None
        for name, digest in manifest["files"].items():
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"{path} is missing from the checkpoint of step {manifest['step']}; "
                                      f"resume from a complete run directory or start a new one (--out)")
            if sha256_of(path) != digest:
                raise CheckpointError(f"{path} does not match the checkpoint of step {manifest['step']} (its SHA-256 "
                                      "differs): it was changed after the run wrote it; start a new run (--out)")
        wanted = json.loads(json.dumps(inputs, sort_keys=True, default=str))
        if manifest["inputs"] != wanted:
            changed = sorted(k for k in set(manifest["inputs"]) | set(wanted)
                             if manifest["inputs"].get(k) != wanted.get(k))
            raise CheckpointError(f"{self.directory} was trained with other inputs ({', '.join(changed)} changed): "
                                  "resume with the same corpus and options, or start a new run (--out)")
        return manifest


def trim_torn_tail(path: str | os.PathLike, is_complete: Callable[[bytes], bool] = lambda line: True) -> int:
    """Cut an append-only line log back to its last complete line (a kill mid-write
    leaves at most one torn line, at the end); returns the bytes cut. A line that is
    not the last and fails `is_complete` means the file was damaged otherwise: refused."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything up to the last newline
    last = data[keep:]
    lines = data[:keep].splitlines()
    if lines and not is_complete(lines[-1]):  # a final line whose newline landed but not its content
        keep -= len(lines[-1]) + 1
        lines = lines[:-1]
    for number, line in enumerate(lines, 1):
        if not is_complete(line):
            raise ValueError(f"{path}: line {number} is damaged (not only the last line, which a kill may cut off); "
                             "restore the file or start a new output")
    cut = len(data) - keep
    if cut:
        with open(path, "rb+") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    del last
    return cut
