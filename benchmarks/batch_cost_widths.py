"""How well the batched cost measurement prices the widths it does not measure: a
batched verification forward timed at every width (tokens per row) 1..32, against
the same curve interpolated from the widths the library measures (`BATCH_WIDTHS`).

    python benchmarks/batch_cost_widths.py --rows 2 4 --context 1024 --threads 2

A ratio below 1 prices that width too cheap, above 1 too dear. The single-sequence
curve measures every k up to 17 because interpolating powers of two mispriced the
trees between them
(docs/lab-notes/forward-cost.md#the-forward-cost-steps-with-the-products-row-tiles-issues-adaptive-speculation-runtime-speed);
this says whether the batched one needs the same, against the time a denser
measurement costs a server's first batched round of each row count.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import longspec
from common import machine, write_results
from longspec.speculation.cost_model import BATCH_WIDTHS, ForwardCost, measure_batch_forward_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--widest", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/batch_cost_widths.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load().model
    every = tuple(range(1, args.widest + 1))
    measured = tuple(w for w in BATCH_WIDTHS if w <= args.widest)
    rows_out = []
    for rows in args.rows:
        started = time.perf_counter()
        dense = measure_batch_forward_cost(model, rows=rows, context=args.context, widths=every, repeats=args.repeats)
        dense_s = time.perf_counter() - started
        coarse = ForwardCost({}, measured, tuple(dense.seconds_for(w) for w in measured))
        for w in every:
            rows_out.append({"rows": rows, "width": w, "ms": round(1e3 * dense.seconds_for(w), 3),
                             "interpolated_over_measured": round(coarse.seconds_for(w) / dense.seconds_for(w), 4),
                             "dense_measurement_s": round(dense_s, 1)})
    header = {"benchmark": "batch_cost_widths", "machine": machine(), "context": args.context,
              "threads": torch.get_num_threads(), "library_widths": list(measured), "time": time.ctime()}
    write_results(args.out, header, rows_out)
    print("| rows | widths priced within 5% | worst (width: interpolated / measured) | up to 16 tokens a row |")
    print("|---|---|---|---|")
    for rows in args.rows:
        mine = [r for r in rows_out if r["rows"] == rows]
        within = sum(abs(r["interpolated_over_measured"] - 1) <= 0.05 for r in mine)
        worst = max(mine, key=lambda r: abs(r["interpolated_over_measured"] - 1))
        low = [r["interpolated_over_measured"] for r in mine if r["width"] <= 16]
        print(f"| {rows} | {within} / {len(mine)} | {worst['width']}: {worst['interpolated_over_measured']:.2f} | "
              f"{min(low):.2f}–{max(low):.2f} |")


if __name__ == "__main__":
    main()
