"""Held-out top-1 accuracy of TokenSwift heads files, per head, over the target's full
vocabulary: against the target's own greedy tokens (what greedy verification accepts)
and against the data's tokens, on the held-out rows of token shards (BOS-first rows,
as served).

    python benchmarks/training/tokenswift_heads_agreement.py --shards runs/eval-task-shards runs/eval-general-shards \\
        src/longspec/weights/tokenswift-gemma-3-270m.safetensors runs/tokenswift-heads-cached/heads.safetensors

Head i at position t is right when it names the token i + 1 ahead (the target's own
head predicts t + 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.training.data import load_split, prefixed_rows, served_prefix
from longspec.training.tokenswift.heads_cached import features_of_rows, heldout_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", type=Path, nargs="+", help="heads .safetensors files")
    parser.add_argument("--shards", type=Path, nargs="+", required=True, help="token shards with a held-out split")
    parser.add_argument("--labels", nargs="+", choices=["self", "data"], default=["self", "data"],
                        help="the target's greedy tokens, the data's, or both")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tokenswift_heads_agreement.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = longspec.load(dtype=args.dtype)
    target = loaded.model
    prefix = served_prefix(loaded.tokenizer)
    results = []
    for shards in args.shards:
        ids = prefixed_rows(load_split(shards, "heldout"), args.seq_len, prefix)
        for kind in args.labels:
            rows = features_of_rows(target, ids, len(prefix), kind)
            for path in args.heads:
                heads = TokenSwiftHeads.load(path, target.config).to(torch.float32)
                accuracy = heldout_accuracy(target, heads, rows.hidden, rows.labels, rows.prefix_tokens)
                results.append({"shards": str(shards), "labels": kind, "heads": str(path), "rows": len(rows),
                                "top1_per_head": accuracy})
                print(f"{shards.name:24s} {kind:4s} labels, {len(rows)} rows | {path}: "
                      + " / ".join(f"{a:.3f}" for a in accuracy), flush=True)
    write_results(args.out, {"machine": machine(), "seq_len": args.seq_len, "dtype": args.dtype}, results)


if __name__ == "__main__":
    main()
