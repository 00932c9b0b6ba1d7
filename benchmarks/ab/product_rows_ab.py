"""The tiled bf16 product of this tree against another source of it, per row count, in
one run: each call of one side is followed by the same call of the other, so both see
the same machine state. Gemma 3 270M's weight shapes, random weights (the 262k head
streams from memory, the small matrices stay in cache).

    git show REV:src/longspec/runtime/kernels/bf16_packed_linear.cpp > /tmp/old.cpp
    python benchmarks/ab/product_rows_ab.py --baseline-source /tmp/old.cpp --threads 2

Prints per shape and row count the median time of each side and baseline / this (above
1: this tree is faster), and checks that both give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "micro"))  # tiled_products.py

from common import baseline_library, call_seconds, machine, write_results
from longspec.runtime.native import bf16_linear_ops
from tiled_products import SHAPES

BASELINE_LIBRARY = "longspec_baseline_linear"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-source", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(1, 18)))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/product_rows_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = bf16_linear_ops()
    if ops is None:
        raise SystemExit("no native bf16 product on this machine (reason logged)")
    baseline = baseline_library(args.baseline_source, BASELINE_LIBRARY)
    results = []
    print("| matrix | rows | this ms | baseline ms | baseline / this |\n|---|---|---|---|---|")
    for name in args.shapes:
        N, K = SHAPES[name]
        weight = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
        packed = ops.bf16_pack_weight(weight)
        for rows in args.rows:
            x = torch.randn(rows, K, dtype=torch.bfloat16)
            ours, theirs = ops.bf16_packed_linear(x, packed, N, None), baseline.bf16_packed_linear(x, packed, N, None)
            if not torch.equal(ours, theirs):
                raise SystemExit(f"{name} at {rows} rows: the two sources give different bits")
            mine, other = [], []
            for _ in range(args.repeats):
                mine.append(call_seconds(lambda: ops.bf16_packed_linear(x, packed, N, None)))
                other.append(call_seconds(lambda: baseline.bf16_packed_linear(x, packed, N, None)))
            this_ms, base_ms = statistics.median(mine) * 1e3, statistics.median(other) * 1e3
            results.append({"matrix": name, "rows": rows, "this_ms": this_ms, "baseline_ms": base_ms,
                            "speedup": base_ms / this_ms})
            print(f"| {name} | {rows} | {this_ms:.3f} | {base_ms:.3f} | {base_ms / this_ms:.2f} |", flush=True)
    write_results(args.out, {"machine": machine(), "baseline_source": str(args.baseline_source),
                             "threads": args.threads, "repeats": args.repeats}, results)


if __name__ == "__main__":
    main()
