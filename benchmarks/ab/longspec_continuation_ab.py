"""Continue one LongSpec draft under recipe variants that differ in one setting, and
score each on the held-out rows of every corpus, side by side, in one run.

    python benchmarks/ab/longspec_continuation_ab.py --corpus A.jsonl --corpus B.jsonl \\
        --out bench-out/continuation --steps 200 --variants uniform lag1-weighted

The from-scratch ablations (`longspec_ablations.py`) run at a budget where no draft
reads the newest target K/V yet, so settings that act on how it reads them (which
drafting depths the noisy shift rehearses) show nothing there. This script starts every
variant from the same trained draft (default: the shipped one), trains each on the
same rows in the same order with the same seed and schedule (one feature cache serves
them all), and scores top-1 agreement with the target's greedy token at drafting
depth 1 and 3 on each corpus's held-out files (never trained on), at RoPE position 0
and at a long-context position with the anchors kept at 0..3. The draft it starts
from is scored too. Rerunning the command resumes unfinished variants.
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
from longspec.speculation.drafters.longspec import load_draft
from longspec.speculation.presets.longspec import shipped_draft_path
from longspec.training.data import build_shards, iter_documents, load_split, prefixed_rows, served_prefix, shards_key
from longspec.training.longspec.agreement import draft_agreement
from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions
from longspec.training.longspec.visibility import NoisyShift, ShiftVisibility


def variants(gamma: int) -> dict[str, object]:
    """name -> the visibility rule the variant trains with (everything else is shared)."""
    lag1_weights = tuple(float(2 ** (gamma - 2 - j)) for j in range(gamma - 1))  # halving per depth: gamma 5: 8 4 2 1
    return {
        "uniform": NoisyShift(gamma),  # the shipped recipe
        "lag1-weighted": NoisyShift(gamma, lag1_weights),
        "shift1": ShiftVisibility(1),
    }


def corpus_shards(corpus: Path, tokenizer, out: Path, heldout: float) -> Path:
    """Shards of one corpus alone: its held-out files are the same as in the mixed run
    (held-out is decided per file name), so each corpus is scored on its own."""
    key = shards_key([corpus], tokenizer, text_field=None, heldout_fraction=heldout)
    build_shards(iter_documents([corpus]), tokenizer, out, heldout_fraction=heldout, key=key)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, action="append", required=True, help="response .jsonl or text corpus (repeatable)")
    parser.add_argument("--init-from", type=Path, default=None, help="draft every variant continues (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/continuation"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--heldout", type=float, default=0.05)
    parser.add_argument("--eval-sequences", type=int, default=32, help="held-out rows per corpus (fewer if it has fewer)")
    parser.add_argument("--eval-positions", type=int, nargs="+", default=[0, 4096])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=["uniform", "lag1-weighted"], metavar="NAME")
    args = parser.parse_args()
    chosen = variants(args.gamma)
    unknown = set(args.variants) - set(chosen)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {list(chosen)}")
    start_draft = args.init_from or shipped_draft_path()
    if not start_draft.is_file():
        raise FileNotFoundError(f"--init-from: no draft weights at {start_draft}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(None, dtype=torch.bfloat16)
    tokenizer = target.tokenizer
    prefix = served_prefix(tokenizer)
    mixed = args.out / "shards"
    key = shards_key(args.corpus, tokenizer, text_field=None, heldout_fraction=args.heldout)
    build_shards(iter_documents(args.corpus), tokenizer, mixed, heldout_fraction=args.heldout, key=key)
    train_tokens = load_split(mixed, "train")
    eval_rows = {}
    for i, corpus in enumerate(args.corpus):
        heldout = load_split(corpus_shards(corpus, tokenizer, args.out / f"eval-shards-{i}", args.heldout), "heldout")
        eval_rows[corpus.name if corpus.name != "responses.jsonl" else corpus.parent.name] = \
            prefixed_rows(heldout, args.seq_len, prefix)[: args.eval_sequences]

    stores = {name: {} for name in eval_rows}  # the held-out rows' target features, shared by every draft

    def score(draft) -> dict:
        return {name: [s.to_dict() for s in draft_agreement(draft, target.model, rows, depths=(1, 3),
                                                             start_positions=args.eval_positions,
                                                             feature_store=stores[name])]
                for name, rows in eval_rows.items()}

    rows = [{"variant": "start", "draft": str(start_draft), "steps": 0,
             "scores": score(load_draft(start_draft, target.model.config))}]
    print(json.dumps(rows[-1]), flush=True)
    for name in args.variants:
        options = TrainOptions(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               warmup=args.warmup, bf16_autocast=bf16_matmuls_are_fast(target.model.device), seed=args.seed, save_every=25,
                               visibility=chosen[name], row_prefix=prefix)
        start = time.perf_counter()
        trainer = LongSpecTrainer(target.model, train_tokens, args.out / name, options, init_from=start_draft,
                                  feature_cache=args.out / "features", progress=False)
        trainer.train()
        seconds = time.perf_counter() - start
        trainer.draft.eval()
        rows.append({"variant": name, "visibility": options.describe()["visibility"], "steps": trainer.step,
                     "train_s_this_run": seconds, "scores": score(trainer.draft)})
        print(json.dumps(rows[-1]), flush=True)

    header = {"benchmark": "longspec-continuation-ab", "machine": machine(), "threads": torch.get_num_threads(),
              "start": str(start_draft), "corpora": [str(c) for c in args.corpus], "steps": args.steps,
              "train_tokens": args.steps * args.batch_size * args.seq_len, "lr": args.lr, "time": time.ctime()}
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "continuation.jsonl").open("w") as f:
        for line in [{"header": header}, *rows]:
            f.write(json.dumps(line) + "\n")
    print(f"\nmachine: {header['machine']}; {header['train_tokens']} training tokens per variant\n")
    for corpus in eval_rows:
        keys = [(s["start_position"], s["depth"]) for s in rows[0]["scores"][corpus]]
        print(f"{corpus} ({eval_rows[corpus].shape[0]} held-out rows)")
        print("| variant | " + " | ".join(f"top-1 @pos {p}, d{d}" for p, d in keys) + " | d1 - d3 @pos 0 | CE @pos 0, d1 |")
        print("|---|" + "---|" * (len(keys) + 2))
        for r in rows:
            by_key = {(s["start_position"], s["depth"]): s for s in r["scores"][corpus]}
            p0 = keys[0][0]
            gap = by_key[(p0, 1)]["top1"] - by_key[(p0, 3)]["top1"]
            print(f"| {r['variant']} | " + " | ".join(f"{by_key[k]['top1']:.3f}" for k in keys)
                  + f" | {100 * gap:+.1f} pts | {by_key[(p0, 1)]['cross_entropy']:.2f} |")
        print()


if __name__ == "__main__":
    main()
