"""`longspec train responses`: the target's own responses to prompts built from a local
corpus, written as a JSONL corpus for every drafter's trainer (`--corpus OUT/responses.jsonl`)."""

from __future__ import annotations

import sys
from pathlib import Path

from longspec.cli.options import add_device_argument

RESPONSES_FILE = "responses.jsonl"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "responses", help="write the target's own responses to prompts built from a corpus (training data)",
        description="Build prompts from a local corpus (an excerpt of a document under an instruction: summarise, "
                    "explain, continue, complete the code), answer them with the target, greedy and sampled, and "
                    f"append prompt + response rows to OUT/{RESPONSES_FILE}. Rerun to resume. Train a drafter on them "
                    f"with --corpus OUT/{RESPONSES_FILE}.")
    p.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
    p.add_argument("--corpus", type=Path, action="append", default=[], help="directory, text file or .jsonl (repeatable)")
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
    import dataclasses
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
    if not corpus:
        raise ValueError("no documents to build prompts from: pass --corpus PATH (repeatable) and/or --stdlib")
    exclude = EXCLUDED_DIRS + tuple(args.exclude)
    corpus_files(corpus, exclude)  # a missing path fails here
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    model = longspec.load(args.model, dtype=args.dtype, device=args.device)
    if model.tokenizer is None:
        raise ValueError(f"{model.target.source} has no tokenizer: prompts are built from text")
    prompts = build_prompts(iter_documents(corpus, text_field=args.text_field, exclude=exclude), model.tokenizer,
                            count=args.prompts, excerpt_tokens=args.excerpt_tokens, sampled_share=args.sampled_share,
                            prose_share=args.prose_share, heldout_fraction=args.heldout, seed=args.seed)
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
