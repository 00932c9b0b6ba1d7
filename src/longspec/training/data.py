"""Training corpora → token shards, with a held-out split by file.

A corpus is a list of paths: directories (every text/code file below them), text
files, and JSONL files (one document per row, from a text field). Each document
is tokenized on its own and followed by the tokenizer's EOS. Whether a document is
held out is decided by a hash of its name (file path, or path + row number for
JSONL), never by line, so held-out code and prose are files the draft never saw.

Shards are safetensors files of int32 tokens with a JSON index; building skips
shards already written, so an interrupted tokenization resumes.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longspec.runtime.device import HOST
from longspec.training.fingerprint import digest, files_fingerprint, tokenizer_fingerprint

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".html", ".js")
JSONL_TEXT_FIELDS = ("text", "context", "content", "problem", "question")


@dataclass(frozen=True)
class Document:
    name: str  # stable identity used for the held-out decision
    text: str


def is_held_out(name: str, fraction: float) -> bool:
    digest = hashlib.sha1(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# Directories never read as corpus (installed third-party packages, caches).
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", ".git")


def stdlib_dir() -> Path:
    """The Python standard library's source (with pydoc_data's prose topics)."""
    return Path(sysconfig.get_paths()["stdlib"])


def directory_files(path: Path, exclude: Sequence[str] = EXCLUDED_DIRS) -> list[Path]:
    """The corpus files below a directory (text/code suffixes, excluded directories skipped)."""
    return sorted(
        p for p in path.rglob("*")
        if p.is_file() and p.suffix in TEXT_SUFFIXES and not set(p.relative_to(path).parts) & set(exclude)
    )


def corpus_files(paths: Sequence[str | Path], exclude: Sequence[str] = EXCLUDED_DIRS) -> list[Path]:
    """Every file `iter_documents` reads, in its order."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += directory_files(path, exclude)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path not found: {path}")
    return files


def iter_documents(
    paths: Sequence[str | Path], *, text_field: str | None = None, exclude: Sequence[str] = EXCLUDED_DIRS
) -> Iterator[Document]:
    for path in paths:
        path = Path(path)
        if path.is_dir():
            for file in directory_files(path, exclude):
                yield Document(str(file.relative_to(path.parent)), file.read_text(errors="replace"))
        elif path.suffix == ".jsonl" and path.is_file():
            with path.open() as rows:
                for number, line in enumerate(rows):
                    if line.strip():
                        yield Document(f"{path}:{number}", _jsonl_text(json.loads(line), path, number, text_field))
        elif path.is_file():
            yield Document(str(path), path.read_text(errors="replace"))
        else:
            raise FileNotFoundError(f"corpus path not found: {path}")


def _jsonl_text(row: dict, path: Path, number: int, field: str | None) -> str:
    fields = (field,) if field else JSONL_TEXT_FIELDS
    for name in fields:
        value = row.get(name)
        if isinstance(value, str):
            return value
    raise ValueError(f"{path} row {number} has no text field among {fields}; pass --text-field")


def build_shards(
    documents: Iterable[Document],
    tokenizer,
    out_dir: str | Path,
    *,
    heldout_fraction: float = 0.05,
    shard_tokens: int = 1 << 20,
    eos_id: int | None = None,
    key: str | None = None,
) -> dict:
    """Tokenize documents into out_dir/{train,heldout}-NNNNN.safetensors + index.json.

    key: a fingerprint of what the shards are made from (files, tokenizer, split; see
    `shards_key`). Existing shards are reused only under the same key; shards of
    another corpus are refused, never silently trained on. None reuses whatever is
    there (pre-built shards given without a corpus)."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index_file = out / "index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        if key is not None and index.get("key") != key:
            raise ValueError(
                f"the token shards in {out} were built from another corpus, tokenizer or split (or by an older "
                "longspec) than this run's: use another --out (or --shards DIR), or delete that directory to rebuild"
            )
        return index
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    index = {"key": key, "shards": {"train": [], "heldout": []}, "files": {"train": [], "heldout": []},
             "tokens": {"train": 0, "heldout": 0}}
    buffers: dict[str, list[int]] = {"train": [], "heldout": []}

    def flush(split: str) -> None:
        tokens = buffers[split]
        if not tokens:
            return
        name = f"{split}-{len(index['shards'][split]):05d}.safetensors"
        save_file({"tokens": torch.tensor(tokens, dtype=torch.int32, device=HOST)}, str(out / name))
        index["shards"][split].append(name)
        index["tokens"][split] += len(tokens)
        buffers[split] = []

    for doc in documents:
        split = "heldout" if is_held_out(doc.name, heldout_fraction) else "train"
        ids = tokenizer(doc.text, add_special_tokens=False).input_ids
        if not ids:
            continue
        buffers[split].extend(ids + ([eos] if eos is not None else []))
        index["files"][split].append(doc.name)
        if len(buffers[split]) >= shard_tokens:
            flush(split)
    for split in buffers:
        flush(split)
    if not index["tokens"]["train"]:
        held = len(index["files"]["heldout"])
        if held:
            raise ValueError(f"all {held} corpus file(s) fell in the held-out split (--heldout {heldout_fraction} picks "
                             "files by name): add files, or pass --heldout 0 for a corpus of one or a few files")
        raise ValueError("the corpus produced no training tokens; check the --corpus paths")
    index_file.write_text(json.dumps(index, indent=1))
    return index


def shards_key(paths: Sequence[str | Path], tokenizer, *, text_field: str | None, heldout_fraction: float,
               exclude: Sequence[str] = EXCLUDED_DIRS) -> str:
    """What a shard directory is made from: every corpus file (path, size, mtime), the
    text field, the held-out fraction and the tokenizer."""
    return digest({
        "files": files_fingerprint(corpus_files(paths, exclude)), "text_field": text_field,
        "heldout_fraction": heldout_fraction, "tokenizer": tokenizer_fingerprint(tokenizer),
    })


def load_split(shard_dir: str | Path, split: str = "train") -> torch.Tensor:
    """All tokens of one split, concatenated, int64."""
    shard_dir = Path(shard_dir)
    index = json.loads((shard_dir / "index.json").read_text())
    parts = [load_file(str(shard_dir / name))["tokens"] for name in index["shards"][split]]
    if not parts:
        raise ValueError(f"{shard_dir} has no {split!r} shards")
    return torch.cat(parts).long()


def token_frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size)


def most_frequent_ids(tokens: torch.Tensor, vocab_size: int, count: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `count` most frequent token ids (ties broken by id), with `always` (e.g.
    EOS) included; sorted ascending."""
    if not 1 <= count <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {count}")
    freq = token_frequencies(tokens, vocab_size).double()
    freq[torch.as_tensor(list(always), dtype=torch.long)] = float("inf")
    order = torch.argsort(-freq, stable=True)
    return order[:count].sort().values


def served_prefix(tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer puts before every served prompt (BOS for Llama and Gemma,
    nothing for Qwen): training rows start with them, as served sequences do."""
    with_special = list(tokenizer("x").input_ids)
    plain = list(tokenizer("x", add_special_tokens=False).input_ids)
    if plain and with_special[len(with_special) - len(plain):] == plain:
        return tuple(with_special[: len(with_special) - len(plain)])
    return ()


def prefixed_rows(tokens: torch.Tensor, length: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """[count, length] rows: `prefix` (the served prefix, e.g. BOS), then the next
    length - len(prefix) tokens of the stream. Without the prefix the target's
    features and greedy labels differ from what it computes when serving."""
    body = length - len(prefix)
    if body < 1:
        raise ValueError(f"rows of {length} tokens leave no room after a prefix of {len(prefix)}")
    count = tokens.numel() // body
    if count < 1:
        raise ValueError(f"{tokens.numel()} tokens make no sequence of {length}; add data or lower --seq-len")
    rows = tokens[: count * body].view(count, body)
    if prefix:
        rows = torch.cat([torch.tensor(list(prefix), dtype=rows.dtype, device=HOST).expand(count, -1), rows], dim=1)
    return rows


class SequenceSampler:
    """Fixed-length training sequences cut from a token stream (each starting with the
    served prefix), visited in a seeded permutation per epoch. `position` (sequences
    consumed) is all the state a resumed run needs; rank r of w takes every w-th
    sequence of each batch slice.

    `max_rows`: an epoch visits only this many rows, a seeded sample of the whole
    stream (row ids stay those of the whole stream, so cached features keep their
    names): with features cached, later epochs cost only the draft's own steps."""

    def __init__(self, tokens: torch.Tensor, length: int, seed: int, prefix: Sequence[int] = (),
                 max_rows: int | None = None) -> None:
        self.sequences = prefixed_rows(tokens, length, prefix)
        self.seed = seed
        count = self.sequences.shape[0]
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if max_rows is None or max_rows >= count:
            self.rows = torch.arange(count, device=HOST)
        else:
            sample = torch.randperm(count, generator=torch.Generator().manual_seed(seed - 1), device=HOST)[:max_rows]
            self.rows = sample.sort().values
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    def __len__(self) -> int:
        return self.rows.numel()

    def batch(self, position: int, size: int) -> torch.Tensor:
        rows = [self.row_at(position + i) for i in range(size)]
        return self.sequences[torch.tensor(rows, device=HOST)]

    def row_at(self, position: int) -> int:
        """The stream row visited `position` sequences into the run."""
        epoch, offset = divmod(position, len(self))
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + epoch), device=HOST))
        return int(self.rows[self._order[1][offset]])
