"""Score LongSpec draft checkpoints side by side on held-out rows: how often each
draft's top token is the target's greedy token, at drafting depth 1 and 3, with the
rows at RoPE position 0 and at a long-context position (anchors kept at 0..3).

    python benchmarks/training/longspec_agreement.py --shards RUN/shards DRAFT.safetensors [DRAFT2.safetensors ...]

Rows start with what the tokenizer puts before a served prompt (BOS), as served
sequences do, and come from the held-out split (files never trained on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine
from longspec.runtime.loading import load_target
from longspec.speculation.drafters.longspec import load_draft
from longspec.training.data import load_split, prefixed_rows, served_prefix
from longspec.training.longspec.agreement import draft_agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", type=Path, nargs="+", help="draft .safetensors files (with their .json)")
    parser.add_argument("--shards", type=Path, required=True, help="token shards with a held-out split")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--positions", type=int, nargs="+", default=[0, 4096])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=torch.bfloat16)
    rows = prefixed_rows(load_split(args.shards, "heldout"), args.seq_len, served_prefix(target.tokenizer))
    rows = rows[: args.sequences]
    print(json.dumps({"machine": machine(), "rows": rows.shape[0], "seq_len": args.seq_len}))
    print("| draft | top-1 @pos 0, d1 | @pos 0, d3 | " + " | ".join(f"@pos {p}, d1 | @pos {p}, d3" for p in args.positions[1:])
          + " | CE @pos 0, d1 |")
    print("|---" * (4 + 2 * len(args.positions[1:])) + "|")
    for path in args.drafts:
        draft = load_draft(path, target.model.config)
        scores = draft_agreement(draft, target.model, rows, depths=(1, 3), start_positions=args.positions)
        by_key = {(s.start_position, s.depth): s for s in scores}
        cells = [f"{by_key[(p, d)].top1:.3f}" for p in args.positions for d in (1, 3)]
        print(f"| {path} | " + " | ".join(cells) + f" | {by_key[(args.positions[0], 1)].cross_entropy:.2f} |", flush=True)


if __name__ == "__main__":
    main()
