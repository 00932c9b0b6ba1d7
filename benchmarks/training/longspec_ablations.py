"""LongSpec draft training ablations, in one run on one machine: the recipe (rows
starting with BOS as served prompts do, a recency bias on the cross-attention,
anchor offsets, flash-noisy shifts, self-distilled labels) against the same recipe
with one piece changed — no BOS, no recency bias, no anchor offsets, shift 1 only
(no noise), GLIDE's block-wise mask, and the corpus's next tokens as labels — and the
EAGLE-style variant that fuses the target's hidden state into the draft's input.

    python benchmarks/training/longspec_ablations.py --shards RUN/shards --out bench-out/ablations --steps 150

Every variant trains from the same seed on the same sequences (features are cached
and shared between variants that need the same ones), then is scored on held-out
files (split by file, never seen in training) by `draft_agreement`: how often the
draft's top token is the target's greedy token at drafting depth 1 and 3, with the
held-out rows (starting with BOS, as served) placed at RoPE position 0 and at a
long-context position with the anchors kept at 0..3 (what anchor offsets are for). Depth-1 agreement is the first node's greedy acceptance
rate. Rerunning the command resumes unfinished variants.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine
from longspec.runtime.device import bf16_matmuls_are_fast
from longspec.runtime.loading import load_target
from longspec.speculation.drafters.longspec import DraftConfig
from longspec.training.data import (
    EXCLUDED_DIRS,
    build_shards,
    iter_documents,
    load_split,
    prefixed_rows,
    served_prefix,
    stdlib_dir,
)
from longspec.training.longspec.agreement import draft_agreement
from longspec.training.longspec.features import FEATURES_VERSION
from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions
from longspec.training.longspec.visibility import BlockVisibility, NoisyShift, ShiftVisibility

BOOKS = Path(__file__).resolve().parents[3] / "shared" / "data" / "books"
# The directories the shipped draft's recipe leaves out of the standard library.
RECIPE_EXCLUDES = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip")


def variants(gamma: int, prefix: tuple[int, ...]) -> dict[str, tuple[dict, dict]]:
    """name -> (TrainOptions fields, DraftConfig fields)."""
    recipe = {"anchor_offset": True, "self_distill": True, "visibility": NoisyShift(gamma), "row_prefix": prefix}
    draft = {"recency_bias": True}
    return {
        "recipe (BOS, recency bias, anchor offsets, noisy, self-distilled)": (recipe, draft),
        "no BOS": ({**recipe, "row_prefix": ()}, draft),
        "no recency bias": (recipe, {**draft, "recency_bias": False}),
        "hidden input (EAGLE-style)": (recipe, {**draft, "hidden_input": True}),
        "no anchor offsets": ({**recipe, "anchor_offset": False}, draft),
        "no noise (shift 1)": ({**recipe, "visibility": ShiftVisibility(1)}, draft),
        "block-wise mask (GLIDE)": ({**recipe, "visibility": BlockVisibility(gamma)}, draft),
        "data labels": ({**recipe, "self_distill": False}, draft),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True, help="token shards (built from the standard library and books if absent)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/ablations"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=32768)
    parser.add_argument("--eval-sequences", type=int, default=8)
    parser.add_argument("--eval-positions", type=int, nargs="+", default=[0, 4096])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="run only these variants (their names up to ' (', e.g. recipe 'no recency bias')")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None, dtype=torch.bfloat16)
    corpus = [stdlib_dir()] + ([BOOKS] if BOOKS.is_dir() else [])
    build_shards(iter_documents(corpus, exclude=EXCLUDED_DIRS + RECIPE_EXCLUDES), target.tokenizer, args.shards)
    train_tokens = load_split(args.shards, "train")
    heldout = load_split(args.shards, "heldout")
    count = min(args.eval_sequences, heldout.numel() // args.seq_len)
    if count < 1:
        raise ValueError(f"the held-out split has {heldout.numel()} tokens, fewer than one {args.seq_len}-token sequence")
    prefix = served_prefix(target.tokenizer)
    eval_sequences = prefixed_rows(heldout, args.seq_len, prefix)[:count]

    rows = []
    chosen = variants(args.gamma, prefix)
    if args.variants:
        unknown = set(args.variants) - {name.split(" (")[0] for name in chosen}
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; choose from {[n.split(' (')[0] for n in chosen]}")
        chosen = {name: v for name, v in chosen.items() if name.split(" (")[0] in args.variants}
    for name, (recipe, draft) in chosen.items():
        options = TrainOptions(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=10,
                               bf16_autocast=bf16_matmuls_are_fast(target.model.device), seed=0, save_every=25, **recipe)
        config = DraftConfig.for_target(target.model.config, **draft)
        run_dir = args.out / name.split(" (")[0].replace(" ", "-")
        start = time.perf_counter()
        # Features depend on the row prefix (the cache refuses a mismatch): one cache per prefix.
        features = args.out / f"features-v{FEATURES_VERSION}-{'bos' if options.row_prefix else 'no-bos'}"
        trainer = LongSpecTrainer(target.model, train_tokens, run_dir, options, draft_config=config,
                                  draft_vocab=args.draft_vocab, feature_cache=features, progress=False)
        trainer.train()
        seconds = time.perf_counter() - start
        scores = draft_agreement(trainer.draft, target.model, eval_sequences, depths=(1, 3), start_positions=args.eval_positions)
        rows.append({"variant": name, "steps": trainer.step, "train_s_this_run": seconds, "scores": [s.to_dict() for s in scores]})
        print(json.dumps(rows[-1]), flush=True)

    header = {"benchmark": "longspec-ablations", "machine": machine(), "threads": torch.get_num_threads(),
              "train_tokens": args.steps * args.batch_size * args.seq_len, "eval_sequences": count,
              "seq_len": args.seq_len, "time": time.ctime()}
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "ablations.jsonl").open("w") as f:
        for line in [{"header": header}, *rows]:
            f.write(json.dumps(line) + "\n")
    keys = [(s["start_position"], s["depth"]) for s in rows[0]["scores"]]
    print(f"\nmachine: {header['machine']}; {header['train_tokens']} training tokens per variant\n")
    print("| variant | " + " | ".join(f"top-1 @pos {p}, depth {d}" for p, d in keys) + " | CE @pos 0, depth 1 |")
    print("|---|" + "---|" * (len(keys) + 1))
    for r in rows:
        by_key = {(s["start_position"], s["depth"]): s for s in r["scores"]}
        first = by_key[keys[0]]
        print(f"| {r['variant']} | " + " | ".join(f"{by_key[k]['top1']:.3f}" for k in keys) + f" | {first['cross_entropy']:.2f} |")


if __name__ == "__main__":
    main()
