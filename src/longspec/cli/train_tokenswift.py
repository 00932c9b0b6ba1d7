"""`longspec train tokenswift`: train TokenSwift heads on a frozen target."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from longspec.cli.options import add_device_argument

DEFAULT_SEQ_LEN = 256  # tokens per text window
DEFAULT_ROWS = 16  # positions decoded per text window


def add_parser(sub) -> None:
    p = sub.add_parser("tokenswift", help="train TokenSwift multi-token heads on a frozen target")
    p.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
    p.add_argument("--data", type=Path, action="append", default=[], help="text file, .jsonl (its rows' text field) or directory of .txt (repeatable)")
    p.add_argument("--stdlib-files", type=int, default=0, help="also train on this many Python stdlib modules + doc prose")
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoints, curve.csv)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--dtype", default="bfloat16", help="target dtype (bfloat16 is the fast one on CPU)")
    add_device_argument(p)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--rows-per-window", type=int, default=DEFAULT_ROWS)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=True,
                   help="start every window with what the tokenizer puts before a served prompt (BOS), as served "
                        "sequences do")
    p.add_argument("--independent-heads", action="store_true",
                   help="Medusa-style heads, each on the target's state alone (method medusa), instead of "
                        "TokenSwift's residual chain")
    cached = p.add_argument_group(
        "from cached features", "train on the target features a `longspec train longspec` run cached (its "
        "--feature-cache directories: BOS-first rows, the target's hidden states and labels), without running the "
        "target; every position of every row trains")
    cached.add_argument("--feature-cache", type=Path, action="append", default=[],
                        help="a feature cache directory (repeatable); replaces --data/--stdlib-files")
    cached.add_argument("--cache-shards", type=Path, action="append", default=[],
                        help="the token shards each --feature-cache was cut from (its run's --shards), one per "
                             "cache in the same order: the rows' tokens, from which --labels data labels every "
                             "cached row")
    cached.add_argument("--labels", choices=["self", "data"], default="self",
                        help="the target's own greedy labels (self-distilled) or the data's next tokens (from the "
                             "caches' data rows, or from --cache-shards)")
    cached.add_argument("--loss-vocab", type=int, default=32768,
                        help="the loss scores this many most frequent training labels (the full vocabulary costs "
                             "more; positions labelled outside it are left out)")
    cached.add_argument("--heldout-shards", type=Path, action="append", default=[],
                        help="token shards (of `longspec train longspec --shards`) whose held-out split measures "
                             "the heads' top-1 accuracy over the full vocabulary (repeatable)")
    cached.add_argument("--heldout-rows", type=int, default=0,
                        help="without --heldout-shards: cached rows held out to measure it")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=None, help="stop and save after this much wall time")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(train_command=run)


def run(args) -> int:
    if args.cache_shards and not args.feature_cache:
        raise ValueError("--cache-shards name the token streams of --feature-cache directories: pass those too")
    if args.feature_cache:
        return run_from_features(args)
    from longspec.api import parse_dtype
    from longspec.cli.paths import check_output_directory
    from longspec.runtime.loading import load_target
    from longspec.training.data import served_prefix
    from longspec.training.fingerprint import digest, files_fingerprint, tokenizer_fingerprint
    from longspec.training.tokenswift.data import stdlib_files, text_files, tokenize_files, windows
    from longspec.training.tokenswift.heads import HEADS_FILE, HeadsTrainingConfig, train_heads

    config = HeadsTrainingConfig(  # checked before any work; the prefix length is known once the tokenizer is
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, rows_per_window=args.rows_per_window,
        lr=args.lr, warmup_steps=args.warmup_steps, num_heads=args.num_heads, chained=not args.independent_heads,
        eval_every=args.eval_every, save_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed,
    )
    check_output_directory(args.out)
    files = text_files(args.data) + stdlib_files(args.stdlib_files)
    if not files:
        raise ValueError("no training data: pass --data PATH and/or --stdlib-files N")
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    if target.tokenizer is None:
        raise ValueError(f"{target.source} has no tokenizer; TokenSwift training reads text")
    prefix = served_prefix(target.tokenizer) if args.bos else ()
    config = dataclasses.replace(config, prefix_tokens=len(prefix))
    data = windows(tokenize_files(target.tokenizer, files), args.seq_len, prefix)
    print(f"{len(files)} files, {data.numel()} tokens in {data.shape[0]} windows of {args.seq_len}", flush=True)
    data_key = digest({"files": files_fingerprint(files), "tokenizer": tokenizer_fingerprint(target.tokenizer)})
    train_heads(target.model, data, args.out, config, resume=args.resume, target_name=str(target.source),
                log=lambda line: print(line, flush=True), data_key=data_key)
    print(f"heads written to {args.out / HEADS_FILE}")
    return 0


def run_from_features(args) -> int:
    import torch

    from longspec.api import parse_dtype
    from longspec.cli.paths import check_output_directory
    from longspec.runtime.loading import load_target
    from longspec.training.data import load_split, prefixed_rows, served_prefix
    from longspec.training.tokenswift.heads import HEADS_FILE
    from longspec.training.tokenswift.heads_cached import (
        CachedHeadsConfig, features_of_rows, read_feature_caches, train_heads_from_features)

    if args.data or args.stdlib_files:
        raise ValueError("--feature-cache trains on cached features: drop --data/--stdlib-files (or the caches)")
    if args.cache_shards and len(args.cache_shards) != len(args.feature_cache):
        raise ValueError(f"{len(args.cache_shards)} --cache-shards for {len(args.feature_cache)} --feature-cache: give "
                         "each cache the --shards of the run that made it, in the same order")
    fixed_by_cache = [name for name, value, default in (("--seq-len", args.seq_len, DEFAULT_SEQ_LEN),
                                                        ("--rows-per-window", args.rows_per_window, DEFAULT_ROWS),
                                                        ("--no-bos", not args.bos, False)) if value != default]
    if fixed_by_cache:
        raise ValueError(f"{', '.join(fixed_by_cache)} shape text windows; with --feature-cache the cached rows fix "
                         "their length and prefix and every position trains: drop them")
    config = CachedHeadsConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        num_heads=args.num_heads, chained=not args.independent_heads, loss_vocab=args.loss_vocab,
        heldout_rows=0 if args.heldout_shards else args.heldout_rows, eval_every=args.eval_every,
        save_every=args.eval_every, max_minutes=args.max_minutes, seed=args.seed)
    check_output_directory(args.out)
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    rows = read_feature_caches(args.feature_cache, target.model, args.labels, args.cache_shards or None)
    print(f"{len(rows)} cached rows of {rows.labels.shape[1]} tokens ({args.labels} labels) "
          f"from {len(args.feature_cache)} caches", flush=True)
    heldout = None
    if args.heldout_shards:
        if target.tokenizer is None:
            raise ValueError(f"{target.source} has no tokenizer; --heldout-shards rows start with its served prefix")
        prefix = served_prefix(target.tokenizer)
        if len(prefix) != rows.prefix_tokens:
            raise ValueError(f"the caches' rows start with {rows.prefix_tokens} prefix tokens, this tokenizer's "
                             f"served prefix has {len(prefix)}: the held-out rows would not look like the cached ones")
        ids = torch.cat([prefixed_rows(load_split(d, "heldout"), rows.labels.shape[1], prefix)
                         for d in args.heldout_shards])
        heldout = features_of_rows(target.model, ids, len(prefix), args.labels)
    train_heads_from_features(target.model, rows, args.out, config, resume=args.resume,
                              target_name=str(target.source), log=lambda line: print(line, flush=True),
                              heldout=heldout)
    print(f"heads written to {args.out / HEADS_FILE}")
    return 0
