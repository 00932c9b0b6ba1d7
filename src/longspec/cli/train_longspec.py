"""`longspec train longspec`: train a LongSpec/GLIDE draft for a frozen target."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from longspec.cli.options import add_device_argument, training_process_device
from longspec.cli.train_corpus import add_corpus_arguments, training_tokens


def add_parser(sub) -> None:
    p = sub.add_parser("longspec", help="train a LongSpec/GLIDE cross-attention draft for a target")
    p.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
    add_corpus_arguments(p)
    p.add_argument("--feature-cache", type=Path, default=None, help="store target features here and reuse them")
    p.add_argument("--out", type=Path, required=True, help="run directory: draft.safetensors/.json, trainer_state.pt, loss.csv")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this draft (.safetensors with its .json) instead of random weights; "
                        "its architecture and draft vocabulary are kept")
    p.add_argument("--dtype", default="bfloat16", help="target dtype (bfloat16 is the fast one on CPU)")
    add_device_argument(p)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this much wall time; rerun to resume")
    p.add_argument("--layers", type=int, default=1, help="draft layers N_d")
    p.add_argument("--window", type=int, default=512, help="draft self-attention window")
    p.add_argument("--draft-vocab", type=int, default=None, help="score only the N most frequent corpus tokens")
    p.add_argument("--gamma", type=int, default=5, help="draft depth the noisy shift / block mask simulate")
    p.add_argument("--shift-weights", type=float, nargs="+", default=None, metavar="W",
                   help="noisy training: relative weight of each shift 1..gamma-1 (e.g. 8 4 2 1 for gamma 5: depth 1 "
                        "gates every accepted token); default uniform")
    p.add_argument("--anchor-offset", action=argparse.BooleanOptionalAction, default=True, help="Anchor-Offset Indices")
    p.add_argument("--recency-bias", action=argparse.BooleanOptionalAction, default=True,
                   help="ALiBi-style recency bias on the cross-attention (new drafts; --init-from keeps the draft's)")
    p.add_argument("--hidden-input", action=argparse.BooleanOptionalAction, default=False,
                   help="EAGLE-style variant: fuse the target's hidden state at the newest visible position into the "
                        "draft's input (new drafts)")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                   help="new drafts: copy the attended target layer's q/o projections, norms and MLP into the "
                        "draft's cross-attention and MLP")
    p.add_argument("--max-rows", type=int, default=None,
                   help="rows one epoch visits (a seeded sample; default all): with --feature-cache, later epochs "
                        "reuse the stored features and cost only the draft's steps")
    p.add_argument("--cross-window", type=int, default=None,
                   help="new drafts: target keys a draft query reads besides the sinks (default: --seq-len, what a "
                        "training row shows; 0: every committed key, so a draft step's cost grows with the context)")
    p.add_argument("--cross-sinks", type=int, default=4, help="new drafts: first target positions always read "
                   "(the Anchor-Offset anchors: BOS + 3 tokens)")
    vis = p.add_mutually_exclusive_group()
    vis.add_argument("--noisy", dest="visibility", action="store_const", const="noisy", help="flash noisy training (default)")
    vis.add_argument("--block-mask", dest="visibility", action="store_const", const="block", help="GLIDE block-wise mask")
    vis.add_argument("--exact", dest="visibility", action="store_const", const="exact", help="shift 1 only (no noise)")
    p.set_defaults(visibility="noisy")
    p.add_argument("--labels", choices=("target", "data"), default="target",
                   help="target: the target's own greedy predictions (self-distillation); data: next corpus token")
    p.add_argument("--bf16-autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="draft matmuls in bfloat16 (default: where they are fast: GPUs, CPUs with AVX-512 BF16 or "
                        "AMX; on AVX2-only CPUs a step ran 38x slower than in float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (1 is far faster than 2 on a 2-core machine shared with other jobs)")
    p.set_defaults(train_command=run)


def run(args) -> int:
    import torch

    from longspec.api import parse_dtype
    from longspec.cli.paths import check_output_directory
    from longspec.runtime.device import bf16_matmuls_are_fast
    from longspec.runtime.loading import load_target
    from longspec.speculation.drafters.longspec.config import DraftConfig
    from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions
    from longspec.training.longspec.visibility import BlockVisibility, NoisyShift, ShiftVisibility

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    check_output_directory(args.out)
    if not args.corpus and not args.stdlib and not ((args.shards or args.out / "shards") / "index.json").is_file():
        raise ValueError("no training data: pass --corpus PATH (repeatable) and/or --stdlib")
    if args.shift_weights is not None and args.visibility != "noisy":
        raise ValueError("--shift-weights weights the noisy shifts; drop it with --block-mask or --exact")
    if args.visibility == "block":
        visibility = BlockVisibility(args.gamma)
    elif args.visibility == "exact":
        visibility = ShiftVisibility(1)
    else:
        visibility = NoisyShift(args.gamma, args.shift_weights)
    options = TrainOptions(
        steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
        anchor_offset=args.anchor_offset, self_distill=args.labels == "target", bf16_autocast=bool(args.bf16_autocast),
        seed=args.seed, save_every=args.save_every, visibility=visibility, max_rows=args.max_rows,
    )
    if args.init_from is not None and not args.init_from.is_file():
        raise FileNotFoundError(f"--init-from: no draft weights at {args.init_from}")
    if args.init_from is not None and args.draft_vocab is not None:
        raise ValueError("--init-from keeps that draft's vocabulary; drop --draft-vocab")
    device = training_process_device(args.device)
    if args.bf16_autocast is None:
        options = dataclasses.replace(options, bf16_autocast=bf16_matmuls_are_fast(device))
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=device)
    tokens, prefix = training_tokens(args, target)
    options = dataclasses.replace(options, row_prefix=prefix)
    if args.init_from is not None:
        architecture = {}  # the checkpoint's own weights: no warm start
    else:
        config = DraftConfig.for_target(target.model.config, num_layers=args.layers, window=args.window,
                                        recency_bias=args.recency_bias, hidden_input=args.hidden_input,
                                        cross_window=_cross_window(args), cross_sinks=args.cross_sinks)
        architecture = {"draft_config": config, "draft_vocab": args.draft_vocab, "warm_start": args.warm_start}
    trainer = LongSpecTrainer(
        target.model, tokens, args.out, options, feature_cache=args.feature_cache,
        init_from=args.init_from, **architecture,
    )
    if trainer.step:
        print(f"resuming at step {trainer.step} (data position {trainer.position})", flush=True)
    trainer.train(max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
    print(f"draft written to {args.out / 'draft.safetensors'} at step {trainer.step}", flush=True)
    return 0


def _cross_window(args) -> int | None:
    if args.cross_window is None:
        return args.seq_len
    if args.cross_window < 0:
        raise ValueError(f"--cross-window must be >= 0 (0: every key), got {args.cross_window}")
    return args.cross_window or None
