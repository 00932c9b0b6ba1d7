"""The greedy token's argmax (`row_argmax`, bf16 rows of Gemma's 262k vocabulary) of this
tree against another source of it, per row count, in one run: each call of one side is
followed by the same call of the other, so both see the same machine state.

    git show REV:src/longspec/runtime/kernels/row_argmax.cpp > /tmp/old.cpp
    python benchmarks/ab/row_argmax_ab.py --baseline-source /tmp/old.cpp --threads 1

One row is a decode step's greedy token, 2-65 rows a verified tree's, 512 a training
row's self-distilled labels. Prints the median milliseconds per row of each side and
baseline / this (above 1: this tree is faster), and checks that both give the same
indices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import baseline_library, call_seconds, machine, write_results
from longspec.runtime.native import native_ops

BASELINE_LIBRARY = "longspec_baseline_argmax"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-source", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 65, 512])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, baseline = native_ops(), baseline_library(args.baseline_source, BASELINE_LIBRARY)
    if ours is None:
        raise SystemExit("the native kernels are unavailable here (reason logged)")
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"machine: {machine()}, {torch.get_num_threads()} threads, vocabulary {args.vocab}\n")
    print("| rows | baseline ms/row | this ms/row | baseline / this |")
    print("|---|---|---|---|")
    for count in args.rows:
        logits = torch.randn(count, args.vocab, generator=generator).to(torch.bfloat16)
        if not torch.equal(ours.row_argmax(logits), baseline.row_argmax(logits)):
            raise SystemExit(f"the two sources disagree at {count} rows")
        this_s, base_s = [], []
        for _ in range(args.repeats):
            base_s.append(call_seconds(lambda: baseline.row_argmax(logits)))
            this_s.append(call_seconds(lambda: ours.row_argmax(logits)))
        base, this = statistics.median(base_s) / count * 1e3, statistics.median(this_s) / count * 1e3
        rows.append({"rows": count, "vocab": args.vocab, "baseline_ms_per_row": base, "this_ms_per_row": this,
                     "speedup": base / this})
        print(f"| {count} | {base:.3f} | {this:.3f} | {base / this:.2f} |", flush=True)
    if args.out:
        write_results(args.out, {"benchmark": "row-argmax-ab", "machine": machine(), "threads": torch.get_num_threads(),
                                 "baseline_source": str(args.baseline_source)}, rows)


if __name__ == "__main__":
    main()
