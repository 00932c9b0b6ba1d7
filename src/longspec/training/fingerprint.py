"""Fingerprints of what training data were made from, so that a cache or a resumed
run built from other files, another tokenizer or other settings is refused instead
of silently reused."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path


def files_fingerprint(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(resolved path, size, modification time in ns) per file: a changed, added or
    removed file changes it, without reading the contents."""
    out = []
    for path in files:
        stat = Path(path).stat()
        out.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's class, vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    return digest({"class": type(tokenizer).__name__, "vocab": vocab, "special": special})


def digest(parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def tokens_fingerprint(tokens) -> str:
    """The exact token stream (a changed corpus or tokenizer changes it)."""
    return hashlib.sha256(tokens.to(dtype=tokens.dtype).contiguous().numpy().tobytes()).hexdigest()


def target_fingerprint(model) -> str:
    """A target decoder: its config, dtype and a checksum of every weight (float64
    sums: any retrained or re-quantized weight changes them)."""
    import torch

    sums = {name: float(t.detach().sum(dtype=torch.float64)) for name, t in model.state_dict().items()}
    return digest({"config": model.config, "dtype": str(model.dtype), "sums": sums})
