"""The training corpus options every token-stream trainer shares (`train longspec`,
`train mamba`, `train draft-model`): local files, JSONL, the Python standard library,
tokenized once into keyed shards, rows that start with the served prefix."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_corpus_arguments(p) -> None:
    p.add_argument("--corpus", type=Path, action="append", default=[], help="directory, text file or .jsonl (repeatable)")
    p.add_argument("--stdlib", action="store_true", help="also train on the Python standard library (code + pydoc prose)")
    p.add_argument("--exclude", action="append", default=[], help="skip directories with this name (repeatable)")
    p.add_argument("--text-field", default=None, help="JSONL field holding the text (default: text/context/content/...)")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of files held out (by file, never by line)")
    p.add_argument("--shards", type=Path, default=None, help="token shard directory (default: OUT/shards; reused if present)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=True,
                   help="start every row with what the tokenizer puts before a served prompt (BOS), as served "
                        "sequences do")


def training_tokens(args, target):
    """(training token stream, row prefix): shards built (or reused) from the corpus
    options; fails before any work when there is nothing to train on."""
    import torch

    from longspec.training.data import (
        EXCLUDED_DIRS,
        build_shards,
        iter_documents,
        load_split,
        served_prefix,
        shards_key,
        stdlib_dir,
    )

    corpus = list(args.corpus) + ([stdlib_dir()] if args.stdlib else [])
    shards = args.shards or args.out / "shards"
    if not corpus and not (shards / "index.json").is_file():
        raise ValueError("no training data: pass --corpus PATH (repeatable) and/or --stdlib")
    if target.tokenizer is None and not (shards / "index.json").is_file():
        raise ValueError(f"{target.source} has no tokenizer; pass pre-built --shards")
    exclude = EXCLUDED_DIRS + tuple(args.exclude)
    key = shards_key(corpus, target.tokenizer, text_field=args.text_field, heldout_fraction=args.heldout,
                     exclude=exclude) if corpus and target.tokenizer is not None else None
    index = build_shards(iter_documents(corpus, text_field=args.text_field, exclude=exclude), target.tokenizer, shards,
                         heldout_fraction=args.heldout, key=key)
    print(f"corpus: {index['tokens']['train']} training tokens from {len(index['files']['train'])} documents; "
          f"{index['tokens']['heldout']} held out from {len(index['files']['heldout'])}", flush=True)
    prefix = served_prefix(target.tokenizer) if args.bos and target.tokenizer is not None else ()
    tokens: torch.Tensor = load_split(shards, "train")
    return tokens, tuple(prefix)
