"""`longspec train responses`: the target's own responses to prompts built from a local
corpus, written as a JSONL corpus for every drafter's trainer (`--corpus OUT/responses.jsonl`)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from longspec.cli.options import add_device_argument

RESPONSES_FILE = "responses.jsonl"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "responses", help="write the target's own responses to prompts built from a corpus (training data)",
        description="Build prompts from a local corpus (an excerpt of a document under an instruction: summarise, "
                    "explain, continue, complete the code) or take a workload's own (--task: a benchmark task's items, "
                    "less those a benchmark run measured), answer them with the target, greedy and sampled, and "
                    f"append prompt + response rows to OUT/{RESPONSES_FILE}. Rerun to resume. Train a drafter on them "
                    f"with --corpus OUT/{RESPONSES_FILE}.")
    p.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
    p.add_argument("--corpus", type=Path, action="append", default=[], help="directory, text file or .jsonl (repeatable)")
    p.add_argument("--task", action="append", default=[], metavar="KIND[=PATH]",
                   help="instead of a corpus, a workload's own prompts: the items of a `longspec bench` task, served as "
                        "bench serves them (repeatable; e.g. multi_news, lcc=FILE)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="directory of the tasks' default files (as `longspec bench --data-dir`; default: $LONGSPEC_BENCH_DATA, "
                        "else ../shared/data if present)")
    p.add_argument("--context-lengths", type=int, nargs="+", default=[1024, 2048, 4096], metavar="N",
                   help="task prompts: each item is fitted (as bench fits it) to one of the lengths it reaches, at random")
    p.add_argument("--exclude-items-of", type=Path, action="append", default=[], metavar="RESULTS",
                   help="task prompts: never use an item that this `longspec bench` results.jsonl measured (repeatable), "
                        "so a drafter trained on the responses is measured on unseen items")
    p.add_argument("--stdlib", action="store_true", help="also build prompts from the Python standard library")
    p.add_argument("--exclude", action="append", default=[], help="skip directories with this name (repeatable)")
    p.add_argument("--text-field", default=None, help="JSONL field holding the text (default: text/context/content/...)")
    p.add_argument("--heldout", type=float, default=0.05,
                   help="documents the trainers hold out with this fraction are never used (keep it equal to theirs)")
    p.add_argument("--out", type=Path, required=True, help=f"directory of {RESPONSES_FILE}; rerun to resume")
    p.add_argument("--prompts", type=int, default=400, help="prompts to answer")
    p.add_argument("--prose-share", type=float, default=0.5,
                   help="share of prompts built from prose (the rest from source code), where the corpus has both")
    p.add_argument("--excerpt-tokens", type=int, nargs="+", default=[512, 1024], metavar="N",
                   help="excerpt lengths, one picked per prompt")
    p.add_argument("--max-new-tokens", type=int, default=384, help="longest response (responses stop at EOS)")
    p.add_argument("--sampled-share", type=float, default=0.5,
                   help="share of prompts answered by sampling (temperature, top-p); the rest greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--method", default="pld", help="the (lossless) method that generates: the tokens are the target's")
    p.add_argument("--batch-rows", type=int, default=8, help="rows sharing a target forward")
    p.add_argument("--dtype", default="bfloat16")
    add_device_argument(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="picks documents, excerpts and instructions; seeds sampling")
    p.set_defaults(train_command=run)


def run(args) -> int:
    import time

    import longspec
    from longspec.cli.paths import check_output_directory
    from longspec.speculation.methods import make_drafter
    from longspec.training.data import EXCLUDED_DIRS, corpus_files, iter_documents, stdlib_dir
    from longspec.training.responses import ResponseSettings, build_prompts, check_prompt_options, write_responses

    # Everything cheap is checked before the weights load.
    check_output_directory(args.out)
    settings = ResponseSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                method=args.method, batch_rows=args.batch_rows, seed=args.seed)
    make_drafter(args.method)  # an unknown method fails here
    check_prompt_options(count=args.prompts, excerpt_tokens=args.excerpt_tokens, sampled_share=args.sampled_share,
                         prose_share=args.prose_share, heldout_fraction=args.heldout)
    corpus = list(args.corpus) + ([stdlib_dir()] if args.stdlib else [])
    if corpus and args.task:
        raise ValueError("give --task (a workload's prompts) or --corpus/--stdlib (prompts built from documents), "
                         "not both: write each to its own --out and train on both files")
    if not corpus and not args.task:
        raise ValueError("no prompts: pass --corpus PATH and/or --stdlib (prompts built from documents), or --task KIND")
    exclude = EXCLUDED_DIRS + tuple(args.exclude)
    corpus_files(corpus, exclude)  # a missing path fails here
    task_items = load_task_items(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    model = longspec.load(args.model, dtype=args.dtype, device=args.device)
    if model.tokenizer is None:
        raise ValueError(f"{model.target.source} has no tokenizer: prompts are built from text")
    if args.task:
        prompts = task_prompts(task_items, model.tokenizer, lengths=args.context_lengths, count=args.prompts,
                               sampled_share=args.sampled_share, seed=args.seed)
        if not prompts:
            raise ValueError(f"no item of {', '.join(args.task)} reaches {min(args.context_lengths)} tokens; "
                             "lower --context-lengths")
    else:
        prompts = build_prompts(iter_documents(corpus, text_field=args.text_field, exclude=exclude), model.tokenizer,
                                count=args.prompts, excerpt_tokens=args.excerpt_tokens,
                                sampled_share=args.sampled_share, prose_share=args.prose_share,
                                heldout_fraction=args.heldout, seed=args.seed)
        if not prompts:
            raise ValueError(f"no document of the corpus is long enough for excerpts of {args.excerpt_tokens} tokens")
    if not getattr(model.tokenizer, "chat_template", None):  # a base model: instructions as plain text, as bench does
        print(f"{model.target.source} has no chat template: every prompt is plain text", file=sys.stderr)
        prompts = [dataclasses.replace(p, chat=False) for p in prompts]
    out = args.out / RESPONSES_FILE
    start, tokens = time.perf_counter(), 0

    def report(row: dict) -> None:
        nonlocal tokens
        tokens += row["response_tokens"]
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        print(f"{row['id']}: {row['response_tokens']} tokens ({'sampled' if row['sampled'] else 'greedy'}); "
              f"{tokens} in all, {rate:.1f} tokens/s", file=sys.stderr, flush=True)

    written = write_responses(model, prompts, out, settings, progress=report)
    print(f"{written} responses written now, {len(prompts) - written} were already in {out}; train on them with "
          f"--corpus {out}", file=sys.stderr)
    return 0


def load_task_items(args) -> list:
    """The items of the --task files less those that --exclude-items-of names, read
    (and checked) before the weights load."""
    from longspec.bench.runner import load_rows
    from longspec.bench.tasks import TaskSpec
    from longspec.cli.bench import data_dir_of

    tasks = [TaskSpec.parse(spec, data_dir_of(args)) for spec in args.task]
    for task in tasks:
        if not task.path.is_file():
            raise ValueError(f"task file not found: {task.path}")
    if not args.context_lengths or min(args.context_lengths) < 1:
        raise ValueError(f"--context-lengths must be positive token counts, got {args.context_lengths}")
    excluded: set[tuple[str, str]] = set()
    for path in args.exclude_items_of:
        if not path.is_file():
            raise ValueError(f"--exclude-items-of: {path} not found (give a `longspec bench` results.jsonl)")
        items = {(row["task"], str(row["item"])) for row in load_rows(path) if row.get("kind") == "run"}
        if not items:
            raise ValueError(f"--exclude-items-of: {path} holds no benchmark runs")
        excluded |= items
    kept = [item for task in tasks for item in task.load() if (item.task, item.item_id) not in excluded]
    if tasks:
        print(f"{len(kept)} task items; {len(excluded)} items measured by the benchmark runs are left out",
              file=sys.stderr)
    return kept


def task_prompts(items, tokenizer, *, lengths, count: int, sampled_share: float, seed: int):
    """Up to `count` prompts from benchmark task items, each served as `longspec bench`
    serves it: its task's template, fitted (middle cut, or a book's head) to one of
    `lengths` that it reaches, picked at random (seeded)."""
    import random

    from longspec.bench.tasks import encode_item, middle_truncate
    from longspec.training.responses import ResponsePrompt

    rng = random.Random(seed)
    prompts = []
    for item in items:
        ids = encode_item(item, tokenizer, use_chat=True)
        reached = [n for n in sorted(set(lengths)) if ids.numel() >= n]
        if not reached:
            continue
        length = rng.choice(reached)
        fitted = ids[:length] if item.keep == "head" else middle_truncate(ids, length)
        prompts.append(ResponsePrompt(
            id=f"{item.task}:{item.item_id}@{length}", source=f"{item.task}:{item.item_id}", kind=item.task,
            prompt=tokenizer.decode(fitted, skip_special_tokens=True),
            chat=item.chat and bool(getattr(tokenizer, "chat_template", None)), sampled=False,
            prompt_ids=tuple(fitted.tolist())))
    rng.shuffle(prompts)
    return [dataclasses.replace(p, sampled=rng.random() < sampled_share) for p in prompts[:count]]
