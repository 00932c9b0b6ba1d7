"""Training tokens for TokenSwift heads: local text files and the Python standard
library, tokenized once and cut into fixed-length windows."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from longspec.runtime.device import HOST
from longspec.training.data import iter_documents, prefixed_rows


def stdlib_files(limit: int) -> list[Path]:
    """The first `limit` standard-library modules (sorted: reproducible) and the
    prose of Python's documentation topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:limit]
    topics = root / "pydoc_data" / "topics.py"
    return files + ([topics] if limit > 0 and topics.is_file() else [])


def text_files(paths: Sequence[Path]) -> list[Path]:
    out = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt"))
            if not found:
                raise ValueError(f"{path} holds no .txt files: in directories, TokenSwift training reads .txt files "
                                 "(name other text files, .py or .md say, directly with --data FILE)")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"training data path not found: {path}")
    return out


def tokenize_files(tokenizer, files: Sequence[Path]) -> torch.Tensor:
    """Every file's tokens in order; a .jsonl file gives its rows' text field (e.g.
    `longspec train responses` output), one document per row."""
    ids: list[int] = []
    for document in iter_documents(files):
        ids.extend(tokenizer(document.text).input_ids)
    if not ids:
        raise ValueError("no training tokens: give text files or directories with --data, or --stdlib-files > 0")
    return torch.tensor(ids, dtype=torch.long, device=HOST)


def windows(tokens: torch.Tensor, length: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """[N, length] windows: `prefix` (the served prefix, e.g. BOS, as every served
    sequence starts with it), then the next non-overlapping length - len(prefix)
    tokens of the stream (the tail that does not fill one is dropped)."""
    body = length - len(prefix)
    if body < 1 or tokens.numel() // body < 2:
        raise ValueError(f"{tokens.numel()} tokens make fewer than 2 windows of {length}; add data or shorten --seq-len")
    return prefixed_rows(tokens, length, prefix)


def split_heldout(data: torch.Tensor, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training windows, `count` held-out windows), a seeded random split."""
    if not 1 <= count < data.shape[0]:
        raise ValueError(f"cannot hold out {count} of {data.shape[0]} windows")
    order = torch.randperm(data.shape[0], generator=torch.Generator().manual_seed(seed), device=HOST)
    held = count
    return data[order[held:]], data[order[:held]]


def batches(data: torch.Tensor, batch_size: int, seed: int, start_step: int) -> Iterator[torch.Tensor]:
    """Endless shuffled batches; epoch e uses permutation seed + e, so a resumed run
    at step s sees exactly the batches an uninterrupted run would."""
    per_epoch = data.shape[0] // batch_size
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(data.shape[0], generator=torch.Generator().manual_seed(seed + epoch), device=HOST)
        yield data[order[index * batch_size : (index + 1) * batch_size]]
        step += 1
