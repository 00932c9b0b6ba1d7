"""Benchmark tasks, loaded from local files (never the network).

A task file becomes a list of `TaskItem`s (text, or token ids for models without
a tokenizer); `build_prompts` tokenizes them (through the chat template where the
task asks for one and the tokenizer has one) and fits them to context buckets.

Formats (`TASK_KINDS`; `--tasks KIND` reads its default file under the data
directory, `--tasks KIND=PATH` any file of that format):

* LongBench JSONL (`multi_news`, `lcc`, `gov_report`, `qmsum`, `repobench-p`, or
  `longbench` to pick the template from each row's `dataset` key): keys `context`,
  `input` (may be empty), formatted with the task's LongBench prompt template.
* Spec-Bench / MT-Bench `question.jsonl` (`spec_bench`): keys `question_id`,
  `category`, `turns` (the first turn is the prompt); every category is kept.
* AIME-style problems (`aime`): key `problem` (optional `id`), asked for
  step-by-step reasoning: long outputs.
* Book prefix (`book`): a plain-text file; the prompt is its opening (after the
  Project Gutenberg header when one is present), continued as prose.
* Generic JSONL (`jsonl`): one object per line with `prompt` (text) or
  `prompt_ids` (list of token ids); optional `id` and `chat` (bool).
* Generic text (`text`): the whole file is one prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# LongBench's own per-task prompt templates (dataset2prompt.json of THUDM/LongBench).
LONGBENCH_TEMPLATES = {
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the "
    "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
    "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
    "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "lcc": "Please complete the code given below. \n{context}Now, the next line of code is:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Now, the next line of code is:\n",
}
# LongBench leaves code completion out of the chat template (its pred.py does the same).
LONGBENCH_NO_CHAT = {"lcc", "repobench-p"}
AIME_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{{}}.\n\n{problem}"
GUTENBERG_START = "*** START OF"


class TaskFileError(ValueError):
    """A task file is missing or malformed; the message names the file and line."""


@dataclass(frozen=True)
class TaskItem:
    task: str
    item_id: str
    text: str | None = None  # prompt text, or None when ids are given
    ids: tuple[int, ...] | None = None
    chat: bool = False  # wrap in the model's chat template (when it has one)
    category: str = ""
    keep: str = "middle"  # what survives fitting to a bucket: "middle" cut (LongBench) or the "head" (book prefixes)
    origin: str = ""  # FILE:LINE the item was read from, for error messages


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt, fitted to a context bucket (0: no bucket)."""

    task: str
    item_id: str
    ids: torch.Tensor
    bucket: int = 0
    category: str = ""

    @property
    def context_tokens(self) -> int:
        return self.ids.numel()

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.task, self.item_id, self.bucket)


def _read_jsonl(path: Path, required: Sequence[str]) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise TaskFileError(f"task file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        lines = _utf8_lines(f, path)
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise TaskFileError(f"{path}:{number}: not valid JSON ({error.msg})") from error
            if not isinstance(row, dict):
                raise TaskFileError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise TaskFileError(f"{path}:{number}: missing key {missing[0]!r} (required: {', '.join(required)})")
            rows.append((number, row))
    if not rows:
        raise TaskFileError(f"{path}: no rows")
    return rows


def _utf8_lines(handle, path: Path) -> list[str]:
    try:
        return handle.readlines()
    except UnicodeDecodeError as error:
        raise TaskFileError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); convert it to UTF-8 "
                            "(e.g. iconv -f latin1 -t utf-8)") from None


def check_prompt_ids(items: Sequence[TaskItem], vocab_size: int) -> None:
    """Token-id prompts must lie in the model's vocabulary: fail before any work,
    naming the file and line."""
    for item in items:
        if item.ids is None:
            continue
        bad = [t for t in item.ids if not 0 <= t < vocab_size]
        if bad:
            raise TaskFileError(f"{item.origin or item.item_id}: prompt_ids {bad[:5]} lie outside the model's "
                                f"vocabulary [0, {vocab_size}); these ids were made for another tokenizer")


def load_longbench(path: Path, task: str | None = None) -> list[TaskItem]:
    """LongBench rows; `task` picks the template (None: each row's `dataset` key)."""
    items = []
    for number, row in _read_jsonl(path, ["context", "input"] + ([] if task else ["dataset"])):
        name = task or row["dataset"]
        if name not in LONGBENCH_TEMPLATES:
            raise TaskFileError(
                f"{path}:{number}: no prompt template for LongBench task {name!r}; "
                f"known: {', '.join(LONGBENCH_TEMPLATES)}"
            )
        text = LONGBENCH_TEMPLATES[name].format(context=row["context"], input=row["input"])
        items.append(TaskItem(name, str(row.get("_id", number)), text, chat=name not in LONGBENCH_NO_CHAT))
    return items


def load_spec_bench(path: Path) -> list[TaskItem]:
    items = []
    for number, row in _read_jsonl(path, ["question_id", "category", "turns"]):
        if not isinstance(row["turns"], list) or not row["turns"] or not isinstance(row["turns"][0], str):
            raise TaskFileError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
        items.append(TaskItem("spec_bench", str(row["question_id"]), row["turns"][0], chat=True, category=row["category"]))
    return items


def load_aime(path: Path) -> list[TaskItem]:
    return [
        TaskItem("aime", str(row.get("id", number)), AIME_INSTRUCTION.format(problem=row["problem"]), chat=True)
        for number, row in _read_jsonl(path, ["problem"])
    ]


def load_book(path: Path) -> list[TaskItem]:
    if not path.is_file():
        raise TaskFileError(f"book file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    start = text.find(GUTENBERG_START)
    if start >= 0:  # skip the Project Gutenberg licence header
        text = text[text.index("\n", start) + 1 :]
    if not text.strip():
        raise TaskFileError(f"{path}: the book is empty")
    return [TaskItem("book", path.stem, text.lstrip(), keep="head")]


def load_generic_jsonl(path: Path) -> list[TaskItem]:
    items = []
    for number, row in _read_jsonl(path, []):
        if ("prompt" in row) == ("prompt_ids" in row):
            raise TaskFileError(f"{path}:{number}: give exactly one of the keys 'prompt' (text) or 'prompt_ids'")
        ids = row.get("prompt_ids")
        if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids)):
            raise TaskFileError(f"{path}:{number}: 'prompt_ids' must be a non-empty list of integers")
        items.append(
            TaskItem(path.stem, str(row.get("id", number)), row.get("prompt"), tuple(ids) if ids else None,
                     chat=bool(row.get("chat", False)), origin=f"{path}:{number}")
        )
    return items


def load_text(path: Path) -> list[TaskItem]:
    if not path.is_file():
        raise TaskFileError(f"text file not found: {path}")
    return [TaskItem(path.stem, path.name, path.read_text(encoding="utf-8", errors="replace"), keep="head")]


@dataclass(frozen=True)
class TaskKind:
    load: Callable[[Path], list[TaskItem]]
    default_file: str | None  # relative to the data directory
    long_output: bool = False  # judged by output length (speedup vs output length plot)
    bucketed: bool = True  # fitted to context buckets (short-prompt tasks are taken as they are)


def _longbench(task: str) -> Callable[[Path], list[TaskItem]]:
    return lambda path: load_longbench(path, task)


TASK_KINDS: dict[str, TaskKind] = {
    "multi_news": TaskKind(_longbench("multi_news"), "longbench/multi_news.jsonl"),
    "lcc": TaskKind(_longbench("lcc"), "longbench/lcc.jsonl"),
    "gov_report": TaskKind(_longbench("gov_report"), "longbench/gov_report.jsonl"),
    "qmsum": TaskKind(_longbench("qmsum"), "longbench/qmsum.jsonl"),
    "repobench-p": TaskKind(_longbench("repobench-p"), "longbench/repobench-p.jsonl"),
    "longbench": TaskKind(_longbench(None), None),
    "spec_bench": TaskKind(load_spec_bench, "spec_bench/question.jsonl", bucketed=False),
    "aime": TaskKind(load_aime, "aime24/test.jsonl", long_output=True, bucketed=False),
    "book": TaskKind(load_book, "books/pg19_frank_merriwell_down_south.txt", long_output=True),
    "jsonl": TaskKind(load_generic_jsonl, None),
    "text": TaskKind(load_text, None),
}


@dataclass(frozen=True)
class TaskSpec:
    kind: str
    path: Path

    @classmethod
    def parse(cls, spec: str, data_dir: Path | None) -> "TaskSpec":
        """`KIND` (its default file under data_dir) or `KIND=PATH`."""
        kind, _, path = spec.partition("=")
        if kind not in TASK_KINDS:
            raise ValueError(f"unknown task {kind!r}; choose from {', '.join(TASK_KINDS)} (optionally KIND=PATH)")
        if path:
            return cls(kind, Path(path).expanduser())
        default = TASK_KINDS[kind].default_file
        if default is None:
            raise ValueError(f"task {kind!r} needs a file: write {kind}=PATH")
        if data_dir is None:
            raise ValueError(f"task {kind!r} reads {default} under the data directory: pass --data-dir "
                             f"(or set LONGSPEC_BENCH_DATA), or write {kind}=PATH")
        return cls(kind, data_dir / default)

    def load(self) -> list[TaskItem]:
        return TASK_KINDS[self.kind].load(self.path)


def middle_truncate(ids: torch.Tensor, length: int) -> torch.Tensor:
    """LongBench's truncation: keep the first and last halves, drop the middle,
    so the instruction at both ends survives."""
    if ids.numel() <= length:
        return ids
    head = length // 2
    return torch.cat([ids[:head], ids[ids.numel() - (length - head) :]])


def encode_item(item: TaskItem, tokenizer, use_chat: bool) -> torch.Tensor:
    if item.ids is not None:
        return torch.tensor(item.ids, dtype=torch.long)
    if tokenizer is None:
        raise ValueError(f"task {item.task!r} item {item.item_id} is text but the model has no tokenizer; "
                         "give prompt_ids in a jsonl task instead")
    if item.chat and use_chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": item.text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(tokenizer(item.text).input_ids, dtype=torch.long)


@dataclass(frozen=True)
class PromptFilter:
    """Which prompts a run takes. buckets: context lengths in tokens; an item
    enters bucket B when its prompt has at least B tokens and is cut to exactly
    B (middle cut for documents, the head for books). No buckets: the prompt as
    is, kept when min_context <= length <= max_context. limit: items per task
    (and per bucket)."""

    buckets: tuple[int, ...] = ()
    min_context: int = 1
    max_context: int | None = None
    limit: int | None = None
    use_chat: bool = True
    categories_spread: bool = True  # Spec-Bench-like tasks: take items round-robin over categories

    def __post_init__(self) -> None:
        if any(b < 1 for b in self.buckets):
            raise ValueError(f"context buckets must be positive token counts, got {self.buckets}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")


def _spread(items: list[TaskItem]) -> list[TaskItem]:
    """Round-robin over categories, so a small limit still covers every category."""
    by_category: dict[str, list[TaskItem]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    queues = list(by_category.values())
    out = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def build_prompts(items: Sequence[TaskItem], tokenizer, selection: PromptFilter = PromptFilter()) -> list[Prompt]:
    """Tokenize, filter by length and fit to buckets; stops tokenizing once every
    bucket holds `limit` items (LongBench files hold MBs of text)."""
    items = list(items)
    if selection.categories_spread and len({i.category for i in items}) > 1:
        items = _spread(items)
    targets = selection.buckets or (0,)
    counts = dict.fromkeys(targets, 0)
    prompts: list[Prompt] = []
    for item in items:
        if selection.limit is not None and all(n >= selection.limit for n in counts.values()):
            break
        ids = encode_item(item, tokenizer, selection.use_chat)
        for bucket in targets:
            if selection.limit is not None and counts[bucket] >= selection.limit:
                continue
            if bucket:
                if ids.numel() < bucket:
                    continue
                fitted = ids[:bucket] if item.keep == "head" else middle_truncate(ids, bucket)
            else:
                if ids.numel() < selection.min_context or (
                    selection.max_context is not None and ids.numel() > selection.max_context
                ):
                    continue
                fitted = ids
            prompts.append(Prompt(item.task, item.item_id, fitted, bucket, item.category))
            counts[bucket] += 1
    return prompts
