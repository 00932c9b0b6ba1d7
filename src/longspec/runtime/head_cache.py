"""The certified head's int8 copy, built once per machine and kept in the model cache.

Deriving it (`certified_head.quantize_head`) reads the whole head in float64: seconds
for a large vocabulary (Gemma's 262,144 rows), paid by every process before its first
decision. Here it is built once, written as one safetensors file in an entry of the
model cache (`model_cache.cached_entry`: locked, built in a temporary directory,
renamed into place, so concurrent or killed builders leave nothing half-written), and
memory-mapped by later loads.

The entry's name digests everything its bytes depend on: the head weight's own bytes
(xxh3, ~10 ms for Gemma's), its shape, the group, the array format, and the sources of
the kernel that reads the layout (`int8_screen.cpp`; edits to other kernels keep the
copy). The file records each array's xxh3, checked at every load: a copy whose bytes
changed is discarded and rebuilt, because a wrong bound would certify a wrong token.
Building a copy removes the other copies of the same head weight (made for an older
screen kernel or format), so a machine keeps one per model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import xxhash

from longspec.runtime.model_cache import (
    CacheWriteError,
    cached_entry,
    discard_entry,
    entry_problem,
)
from longspec.runtime.native import sources_identity
from longspec.runtime.progress import phase

FORMAT = "longspec-certified-head/1"
CACHE_SUBDIR = "prepared"
FILE = "certified-head.safetensors"

log = logging.getLogger("longspec")


def default_directory() -> Path:
    """Where prepared copies are kept unless a caller names a directory."""
    from longspec.runtime.default_model import cache_root

    return cache_root() / CACHE_SUBDIR


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes (contiguous, on the host)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_128(memoryview(flat.numpy())).hexdigest()


SCREEN_SOURCES = ("int8_screen.cpp",)  # the kernel that reads the copy's layout


def entry_key(weight: torch.Tensor, group: int) -> dict:
    return {"format": FORMAT, "source": tensor_digest(weight), "shape": list(weight.shape), "dtype": str(weight.dtype),
            "group": group, "kernels": sources_identity(*SCREEN_SOURCES)}


def entry_name(weight: torch.Tensor, group: int, key: dict | None = None) -> str:
    key = entry_key(weight, group) if key is None else key
    return "certified-head-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cached_head_arrays(weight: torch.Tensor, group: int, directory: Path | None = None) -> dict[str, torch.Tensor] | None:
    """`quantize_head(weight, group)`, from the cache (memory-mapped) or built and stored
    there; None where the weight is not finite (no bound holds: no head). A cache that
    cannot be written (read-only, full) costs the build every time, with one warning
    naming why."""
    from longspec.runtime.certified_head import quantize_head

    root = directory or default_directory()
    key = entry_key(weight, group)
    name = entry_name(weight, group, key)
    # Checked before a build only (a second for Gemma's head): an entry exists only for a finite weight.
    if entry_problem(root / name) is not None and not bool(torch.isfinite(weight).all()):
        return None

    built = []

    def build(temporary: Path) -> None:
        with phase("building the certified head's int8 copy (once per machine)"):
            arrays = quantize_head(weight, group)
        _save(arrays, temporary / FILE, key)
        built.append(True)

    return _cached(root, name, key, build, built, lambda: quantize_head(weight, group),
                   "the certified head's int8 copy", _estimated_bytes(weight, group))


def _cached(root: Path, name: str, key: dict, build, built: list, in_memory, what: str, needed: int,
            file: str = FILE):
    """The entry `name` (built by `build` where missing), its arrays checked; `in_memory()`
    where the cache cannot be written. Also serves `prepared_weights` (another `file`)."""
    for attempt in range(2):
        try:
            entry = cached_entry(root, name, build, what=what, needed_bytes=needed)
        except CacheWriteError as error:
            log.warning("%s; %s is built in memory this time", error, what)
            return in_memory()
        arrays, problem = _load(entry / file, key["format"])
        if problem is None:
            if built:
                _remove_older_copies(root, name, key, file)
            return arrays
        log.warning("the cached copy at %s is damaged (%s); rebuilding it", entry, problem)
        discard_entry(entry)
    raise RuntimeError(f"{what} in {root} was damaged twice in a row; delete that directory")


SCREEN_FORMAT = "longspec-file-screen/1"


def cached_file_screen(rows, directory: Path | None = None) -> dict[str, torch.Tensor]:
    """`file_screen.derive_screen(rows)` (a quantized GGUF head's Q5_0 screen and bound
    constants), from the cache or built and stored there, like the int8 copy above. Keyed
    by the file rows' own bytes: the screen depends on them alone."""
    import numpy as np

    from longspec.runtime.file_screen import derive_screen

    raw = np.ascontiguousarray(rows.raw)
    key = {"format": SCREEN_FORMAT, "source": xxhash.xxh3_128(memoryview(raw).cast("B")).hexdigest(),
           "shape": [rows.rows, rows.cols], "kind": rows.kind}
    name = "certified-head-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    root = directory or default_directory()
    built = []

    def build(temporary: Path) -> None:
        with phase("building the quantized head's screen (once per machine)"):
            arrays = derive_screen(rows)
        _save(arrays, temporary / FILE, key)
        built.append(True)

    return _cached(root, name, key, build, built, lambda: derive_screen(rows), "the quantized head's screen",
                   rows.rows * (rows.cols // 32 * 22 + 8))


def _estimated_bytes(weight: torch.Tensor, group: int) -> int:
    V, H = weight.shape
    return V * H + V * (-(-H // group)) * 4 + 3 * V * 4  # codes, scales, three row constants


def _remove_older_copies(root: Path, name: str, key: dict, file: str = FILE) -> None:
    """Other entries of the same kind (the name's prefix) made from the same source (another
    kernel, format or group)."""
    from safetensors import safe_open

    kind = name[: name.rindex("-") + 1]
    for entry in root.glob(kind + "*"):
        if entry.name == name or not (entry / file).is_file():
            continue
        try:
            with safe_open(str(entry / file), framework="pt") as handle:
                other = json.loads((handle.metadata() or {}).get("key", "{}"))
        except Exception:  # noqa: BLE001 - unreadable: not ours to judge; entry_problem reports it
            continue
        if other.get("source") == key["source"]:
            log.info("removing %s, a copy of the same head for another kernel or format", entry)
            discard_entry(entry)


def _save(arrays: dict[str, torch.Tensor], path: Path, key: dict) -> None:
    from safetensors.torch import save_file

    metadata = {"format": key.get("format", FORMAT), "key": json.dumps(key, sort_keys=True),
                "xxh3": json.dumps({name: tensor_digest(t) for name, t in arrays.items()})}
    save_file({name: t.contiguous() for name, t in arrays.items()}, str(path), metadata=metadata)


def _load(path: Path, expected: str = FORMAT) -> tuple[dict[str, torch.Tensor], str | None]:
    """The arrays, memory-mapped (`map_safetensors`: no copy), and what is wrong with
    them (None: each array's bytes hash to what the build recorded)."""
    try:
        arrays, metadata = map_safetensors(path)
        recorded = json.loads(metadata.get("xxh3", "{}"))
    except Exception as error:  # a bad header or a short file
        return {}, f"unreadable: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    if metadata.get("format") != expected:
        return {}, f"format {metadata.get('format')!r}, expected {expected!r}"
    for name, tensor in arrays.items():
        if recorded.get(name) != tensor_digest(tensor):
            return {}, f"{name} does not hash to the value recorded when it was built"
    if set(recorded) != set(arrays):
        return {}, "its arrays differ from those recorded"
    return arrays, None


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                       "BOOL": torch.bool}


def map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A safetensors file's arrays as views of one private memory map of it (nothing is read
    until used; a write to an array copies its page and never reaches the file), and its
    metadata. safetensors' own `load_file` copies every byte into new memory."""
    import mmap
    import struct

    with open(path, "rb") as handle:
        header_bytes = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(header_bytes))
        size = os.fstat(handle.fileno()).st_size
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + header_bytes
    whole = torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else torch.empty(0, dtype=torch.uint8)
    arrays = {}
    for name, info in header.items():
        begin, end = (start + offset for offset in info["data_offsets"])
        if not start <= begin <= end <= size:
            raise ValueError(f"{name} lies outside the file ({size} bytes): truncated")
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        arrays[name] = whole[begin:end].view(dtype).view(info["shape"])
    return arrays, metadata


def cached_entries(directory: Path | None = None) -> list[tuple[Path, int, str | None]]:
    """Every entry under the cache's prepared/ (certified heads' copies, prepared weights):
    path, bytes, and what is wrong with it."""
    root = directory or default_directory()
    if not root.is_dir():
        return []
    entries = []
    for entry in sorted([*root.glob("certified-head-*"), *root.glob("weights-*")]):
        if entry.is_dir():
            size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
            entries.append((entry, size, entry_problem(entry)))
    return entries
