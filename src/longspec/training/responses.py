"""The target's own responses as a training corpus.

A drafter is judged on the tokens its target writes when serving (answers to
instructions, continuations of code, the loops of greedy decoding) on the content of
the workload: the shipped LongSpec draft agrees with the target as well on its
responses as on the documents of its training domain, and far less on news and Java
(docs/lab-notes/training.md#the-targets-own-responses-as-training-data-the-longspec-draft-continued-on-them-issue-longspec-draft-that-pays).
Here prompts are built from a corpus — an excerpt of a document under an instruction
(summarise, explain, continue, complete the code) — and the target's responses to
them, greedy and sampled, become JSONL rows: the prompt and the response as served,
without the served prefix (trainers put BOS back), read by every trainer with
`--corpus FILE`.
Rows are appended as batches finish; a resumed run answers only the prompts it has
not answered yet.

Documents that the split holds out (`is_held_out` with the trainers' own fraction)
are never used, so evaluation rows built from the same corpus stay unseen.

Prompts may also come already tokenized (`ResponsePrompt.prompt_ids`): a workload's
own prompts exactly as they are served, e.g. a benchmark task's items fitted to a
context length (`longspec train responses --task`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

from longspec.runtime.atomic_files import trim_torn_tail
from longspec.training.data import Document, is_held_out

CODE_SUFFIXES = (".py", ".c", ".h", ".js")


@dataclass(frozen=True)
class Instruction:
    template: str  # `{excerpt}` marks where the document's excerpt goes
    chat: bool  # in the model's chat template; False: raw text the target continues


# Asked of prose (books, documentation).
PROSE_INSTRUCTIONS = (
    Instruction("Summarize the following text.\n\n{excerpt}", chat=True),
    Instruction("Write a one-paragraph summary of the passage below.\n\n{excerpt}", chat=True),
    Instruction("{excerpt}\n\nWhat are the main points of the text above? Answer in a few sentences.", chat=True),
    Instruction("Explain the following text to someone who has not read it.\n\n{excerpt}", chat=True),
    Instruction("Continue the following text in the same style.\n\n{excerpt}", chat=True),
)
# Asked of source code; the last one is a plain completion, as a code model is served.
CODE_INSTRUCTIONS = (
    Instruction("Explain what the following code does.\n\n```\n{excerpt}\n```", chat=True),
    Instruction("Complete the following code.\n\n```\n{excerpt}\n```", chat=True),
    Instruction("Review the following code and suggest improvements.\n\n```\n{excerpt}\n```", chat=True),
    Instruction("{excerpt}", chat=False),
)


@dataclass(frozen=True)
class ResponsePrompt:
    id: str  # document name, excerpt start and length: stable across runs with the same seed
    source: str
    kind: str  # "prose" or "code"
    prompt: str
    chat: bool
    sampled: bool  # answered with the sampling settings (else greedy)
    prompt_ids: tuple[int, ...] | None = None  # served as exactly these tokens (`prompt`: their text); None: encode it


def build_prompts(documents: Iterable[Document], tokenizer, *, count: int, excerpt_tokens: Sequence[int],
                  sampled_share: float, prose_share: float, heldout_fraction: float, seed: int) -> list[ResponsePrompt]:
    """Up to `count` distinct prompts, seeded: each picks prose with probability
    `prose_share` (else code; whichever the corpus has), a document of that kind in
    proportion to its length, an excerpt of one of `excerpt_tokens` lengths at a random
    place (documents shorter than half of it are passed over), and an instruction for
    its kind. Held-out documents are never used."""
    check_prompt_options(count=count, excerpt_tokens=excerpt_tokens, sampled_share=sampled_share,
                         prose_share=prose_share, heldout_fraction=heldout_fraction)
    by_kind: dict[str, list[Document]] = {"prose": [], "code": []}
    for d in documents:
        if d.text.strip() and not is_held_out(d.name, heldout_fraction):
            by_kind[document_kind(d)].append(d)
    weights = {kind: list(accumulate(len(d.text) for d in docs)) for kind, docs in by_kind.items()}
    rng = random.Random(seed)
    tokens: dict[str, list[int]] = {}
    prompts: dict[str, ResponsePrompt] = {}
    for _ in range(count * 20):  # draws that fall on short documents or repeat a prompt are passed over
        if len(prompts) == count or not (by_kind["prose"] or by_kind["code"]):
            break
        kind = "prose" if rng.random() < prose_share else "code"
        if not by_kind[kind]:
            kind = "code" if kind == "prose" else "prose"
        document = rng.choices(by_kind[kind], cum_weights=weights[kind])[0]
        length = rng.choice(list(excerpt_tokens))
        instruction = rng.choice(CODE_INSTRUCTIONS if kind == "code" else PROSE_INSTRUCTIONS)
        sampled = rng.random() < sampled_share
        if document.name not in tokens:  # each document tokenized once, however often it is drawn
            tokens[document.name] = tokenizer(document.text, add_special_tokens=False).input_ids
        ids = tokens[document.name]
        if len(ids) < length // 2:
            continue
        start = rng.randrange(max(len(ids) - length, 0) + 1)
        excerpt = tokenizer.decode(ids[start: start + length])
        if start > 0:  # begin on a whole line, as a reader would quote it
            excerpt = excerpt.partition("\n")[2] or excerpt
        key = f"{document.name}@{start}+{length}"
        if key in prompts or not excerpt.strip():
            continue
        prompts[key] = ResponsePrompt(id=key, source=document.name, kind=kind,
                                      prompt=instruction.template.format(excerpt=excerpt), chat=instruction.chat,
                                      sampled=sampled)
    return list(prompts.values())


def check_prompt_options(*, count: int, excerpt_tokens: Sequence[int], sampled_share: float, prose_share: float,
                         heldout_fraction: float) -> None:
    """`build_prompts`' options, checked before any work (the CLI calls it before loading weights)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not excerpt_tokens or min(excerpt_tokens) < 16:
        raise ValueError(f"excerpt lengths must be >= 16 tokens, got {list(excerpt_tokens)}")
    for name, share in (("sampled_share", sampled_share), ("prose_share", prose_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {share}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")


def document_kind(document: Document) -> str:
    """"code" for source files (by suffix; a JSONL row by its file's), else "prose"."""
    return "code" if Path(document.name.split(":")[0]).suffix in CODE_SUFFIXES else "prose"


@dataclass(frozen=True)
class ResponseSettings:
    max_new_tokens: int = 384
    temperature: float = 1.0  # of sampled prompts; the others are greedy
    top_p: float = 0.95
    method: str = "pld"  # any registered method: lossless, so the responses are the target's own
    batch_rows: int = 8  # rows sharing a target forward
    seed: int = 0  # sampled prompt i (its index in the prompt list) draws from seed + i

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {self.batch_rows}")


def _is_response(line: bytes) -> bool:
    try:
        return "id" in json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def answered_ids(path: Path) -> set[str]:
    """Prompt ids already in a responses file. Only a last line cut off by a killed run
    is dropped (its prompt is answered again); a damaged line elsewhere is refused,
    never silently lost."""
    if not path.is_file():
        return set()
    trim_torn_tail(path, _is_response)
    return {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}


def write_responses(model, prompts: Sequence[ResponsePrompt], out_path: Path, settings: ResponseSettings,
                    *, progress=None) -> int:
    """Answer the prompts not yet in out_path with `model` (a `LongSpecModel`), appending
    one row per prompt; returns the number of rows written now."""
    from longspec.training.data import served_prefix

    done = answered_ids(out_path)
    prefix = len(served_prefix(model.tokenizer))
    written = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as f:
        for sampled in (False, True):
            todo = [(i, p) for i, p in enumerate(prompts) if p.sampled == sampled and p.id not in done]
            step = settings.batch_rows * 2  # rows written (and resumable) every two batches' worth
            for begin in range(0, len(todo), step):
                chunk = todo[begin: begin + step]
                for chat in (False, True):  # one call per template kind: `chat` applies to a whole batch
                    part = [(i, p) for i, p in chunk if p.chat == chat]
                    if not part:
                        continue
                    results = model.generate_batch(
                        [list(p.prompt_ids) if p.prompt_ids else p.prompt for _, p in part],
                        max_rows=settings.batch_rows, method=settings.method,
                        max_new_tokens=settings.max_new_tokens, chat=chat,
                        seed=[settings.seed + i for i, _ in part] if sampled else None,
                        temperature=settings.temperature if sampled else 0.0,
                        top_p=settings.top_p if sampled else None)
                    for (_, p), result in zip(part, results):
                        prompt_ids = list(p.prompt_ids) if p.prompt_ids else model.encode(p.prompt, chat=p.chat).tolist()
                        text = model.tokenizer.decode(prompt_ids[prefix:] + result.token_ids)
                        fields = {k: v for k, v in asdict(p).items() if k != "prompt_ids"}  # the text says it
                        row = fields | {"prompt_tokens": len(prompt_ids), "response_tokens": len(result.token_ids),
                                           "response": result.text, "text": text}
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        written += 1
                        if progress is not None:
                            progress(row)
    return written
