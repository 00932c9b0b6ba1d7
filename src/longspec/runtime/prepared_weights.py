"""A checkpoint's weights as the decoder takes them, built once per machine and kept in
the model cache.

Loading the embedded Gemma 3 270M from its float32 checkpoint reads 1 GB, casts every
tensor to bf16 and concatenates q, k, v and gate, up (`loading.fused_params`), in every
process. Here that result is written once as one safetensors file in an entry of the
model cache's `prepared/` directory (`model_cache.cached_entry`: locked, built in a
temporary directory, renamed into place, so concurrent or killed builders leave nothing
half-written; the same helpers as the certified head's copy, `head_cache`), and later
loads map it (`head_cache.map_safetensors`): the plain weights are views of the file's
pages, shared by every process that maps them, and the packed copies the products stream
are made from them straight into the huge-page mapping (`Decoder._pack_tiles`, one copy).

Only the plain fused weights are stored, not the packed copies: those are a permutation of
the plain ones made as fast as a copy, and storing both would double the entry. So the
entry is the model's bf16 size and depends on no kernel.

The entry's name digests what its bytes depend on: the checkpoint (the digests of the
model cache's manifest where the checkpoint is an entry of it, else each weight file's
name, size and modification time, and config.json's bytes), the dtype, the file format and
the source of `fused_params`. Every array's xxh3 is recorded and checked at each load
(about 0.04 s for Gemma's, with the GIL released): a copy whose bytes changed is discarded
and rebuilt. Building an entry removes the other entries made from the same checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from longspec.runtime import head_cache
from longspec.runtime.head_cache import _cached, _save
from longspec.runtime.model_cache import MANIFEST
from longspec.runtime.progress import phase

FORMAT = "longspec-prepared-weights/1"
FILE = "weights.safetensors"
PREFIX = "weights-"


def checkpoint_identity(directory: Path) -> dict:
    """What a checkpoint directory's weights are, cheaply: the model cache's recorded
    digests where it is an entry of that cache, else its files' names, sizes and times."""
    manifest = directory / MANIFEST
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())["files"]
            return {"manifest": {name: info["sha256"] for name, info in sorted(recorded.items())}}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not ours after all: described by its files below
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        stat = path.stat()
        files[path.name] = [stat.st_size, stat.st_mtime_ns]
    return {"files": files, "config": hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()}


def entry_key(directory: Path, dtype: torch.dtype) -> dict:
    from longspec.runtime.loading import fused_params

    try:
        source = inspect.getsource(fused_params).encode()
    except (OSError, TypeError):  # installed without its sources: the function's bytecode stands in
        source = fused_params.__code__.co_code
    code = hashlib.sha256(source).hexdigest()[:16]
    return {"format": FORMAT, "source": checkpoint_identity(directory), "dtype": str(dtype), "code": code}


def entry_name(key: dict) -> str:
    return PREFIX + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cached_params(directory: Path, dtype: torch.dtype, build_params: Callable[[], dict[str, torch.Tensor]],
                  root: Path | None = None) -> dict[str, torch.Tensor]:
    """The fused parameters of the checkpoint in `directory` in `dtype`: mapped from the
    cache, or made by `build_params()` and stored there first. A cache that cannot be
    written (read-only, full) costs the build every time, with one warning naming why."""
    root = root or head_cache.default_directory()  # beside the certified head's copies
    key = entry_key(directory, dtype)
    # _remove_older_copies compares sources as strings (the certified head's are digests).
    key["source"] = json.dumps(key["source"], sort_keys=True)
    name = entry_name(key)
    built = []

    def build(temporary: Path) -> None:
        with phase("preparing the weights in bf16 (once per machine)"):
            params = build_params()
        _save(params, temporary / FILE, key)
        built.append(True)

    return _cached(root, name, key, build, built, build_params, "the prepared weights",
                   _estimated_bytes(directory, dtype), file=FILE)


def _estimated_bytes(directory: Path, dtype: torch.dtype) -> int:
    """The entry's size: every tensor of the checkpoint in `dtype` (read from the headers)."""
    itemsize = dtype.itemsize
    total = 0
    for shard in directory.glob("*.safetensors"):
        try:
            with open(shard, "rb") as handle:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        except (OSError, ValueError, struct.error):
            continue  # the build names a bad file
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for size in info["shape"]:
                    count *= size
                total += count * itemsize
    return total
