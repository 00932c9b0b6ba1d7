"""Per-row speed of each method against AR from one or more `longspec bench` results
files: a row is one prompt, setting and seed; its speed is the median decode rate of
its runs across every file given (runs of one machine and code, so files of repeated
runs pool into more runs per row).

    python benchmarks/suite/row_ratios.py RUN1/results.jsonl RUN2/results.jsonl --method auto --below 0.97

Prints a Markdown table (AR and method medians, their ratio, runs each, the method's
verified nodes and accepted tokens per round), the geometric mean of the ratios per
setting and the rows under --below.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path


def runs(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "run":
                rows.append(record)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="results.jsonl files of `longspec bench`")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--baseline", default="ar")
    parser.add_argument("--below", type=float, default=0.97, help="list the rows whose ratio is under this")
    args = parser.parse_args()

    rates: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run in runs(args.results):
        seed = run["seed"] if run["setting"] != "greedy" else "-"
        rates[(run["item"], run["context_tokens"], run["setting"], seed)][run["method"]].append(run)

    print(f"| prompt | context | setting | seed | {args.baseline} tok/s | {args.method} tok/s | "
          f"{args.method} / {args.baseline} | runs each | verified nodes per round | accepted per round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = defaultdict(list)
    below = []
    for key in sorted(rates, key=lambda k: (k[0], k[1], k[2], str(k[3]))):
        base, method = rates[key].get(args.baseline), rates[key].get(args.method)
        if not base or not method:
            continue
        base_rate = statistics.median(r["decode_tokens_per_s"] for r in base)
        rate = statistics.median(r["decode_tokens_per_s"] for r in method)
        ratio = rate / base_rate
        ratios[key[2]].append(ratio)
        if ratio < args.below:
            below.append((key, ratio))
        rounds = sum(r.get("target_forwards") or 0 for r in method)  # one verification forward a round
        nodes = sum(sum(r.get("proposed_by_depth") or []) for r in method)
        accepted = sum(r["new_tokens"] - (r.get("target_forwards") or 0) for r in method)  # each round adds a bonus
        per_round = (f"{nodes / rounds:.2f} | {accepted / rounds:.3f}" if rounds else "- | -")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {base_rate:.1f} | {rate:.1f} | {ratio:.3f} | "
              f"{min(len(base), len(method))} | {per_round} |")
    print()
    for setting, values in ratios.items():
        mean = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"{setting}: {args.method} / {args.baseline} geometric mean {mean:.3f} over {len(values)} rows, "
              f"min {min(values):.3f}")
    print(f"rows under {args.below}: " + (", ".join(f"{k[0]} {k[2]} seed {k[3]} {r:.3f}" for k, r in below) or "none"))


if __name__ == "__main__":
    main()
