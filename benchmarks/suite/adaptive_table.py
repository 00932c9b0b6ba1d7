"""`auto` against every fixed method of one `longspec bench` run, row by row: the
adaptive-speculation issue's table and its goals (auto >= 0.95x the row's best fixed
method and >= 0.97x AR on every row; geometric mean >= 1.05x the best single fixed
method; predicted accepted tokens per round within 10% of realised, per task).

    longspec bench --preset full --methods ar pld ngram longspec-ngram auto --out bench-out/full-auto
    python benchmarks/suite/adaptive_table.py bench-out/full-auto/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from longspec.bench.report import median_runs

ADAPTIVE = "auto"
BASELINE = "ar"


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def load_rows(path: Path) -> list[dict]:
    """Timed runs, one per prompt, setting and method (of repeats, the median run)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return median_runs([r for r in rows if r.get("kind") == "run" and r.get("decode_tokens_per_s")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.jsonl of a longspec bench run that includes auto")
    args = parser.parse_args()
    rates: dict[tuple, dict[str, float]] = defaultdict(dict)
    controllers: dict[tuple, dict] = {}
    for row in load_rows(args.results):
        key = (row["setting"], row["task"], row["bucket"], row.get("item", ""), row.get("seed"))
        rates[key][row["method"]] = row["decode_tokens_per_s"]
        if row["method"] == ADAPTIVE and row.get("controller"):
            controllers[key] = row["controller"]
    keys = sorted(k for k in rates if ADAPTIVE in rates[k] and BASELINE in rates[k])
    if not keys:
        raise SystemExit(f"no row of {args.results} has both {ADAPTIVE} and {BASELINE}")
    fixed = sorted({m for k in keys for m in rates[k]} - {ADAPTIVE})
    print("| setting | task | context | item | " + " | ".join(f"{m} tok/s" for m in fixed)
          + " | auto tok/s | auto / best fixed (which) | auto / AR | speculation off | nodes/round |"
          + " predicted / realised accepted per round |")
    print("|---" * (len(fixed) + 9) + "|")
    ratio_best, ratio_ar = [], []
    by_method: dict[str, list[float]] = defaultdict(list)
    calibration: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for key in keys:
        row = rates[key]
        auto = row[ADAPTIVE]
        best = max((m for m in fixed if m in row), key=row.__getitem__)
        ratio_best.append(auto / row[best])
        ratio_ar.append(auto / row[BASELINE])
        for m in fixed:
            if m in row:
                by_method[m].append(row[m] / row[BASELINE])
        by_method[ADAPTIVE].append(auto / row[BASELINE])
        c = controllers.get(key, {})
        rounds = max(c.get("rounds", 0), 1)
        off = f"{c['speculation_off_rounds'] / rounds:.0%}" if c else "–"
        nodes = f"{c['mean_nodes']:.1f}" if c else "–"
        cal = (f"{c['predicted_accepted_per_round']:.2f} / {c['realised_accepted_per_round']:.2f}" if c else "–")
        if c:
            calibration[(key[0], key[1])][0] += c["predicted_accepted_per_round"] * rounds
            calibration[(key[0], key[1])][1] += c["realised_accepted_per_round"] * rounds
        print(f"| {key[0]} | {key[1]} | {key[2]} | {str(key[3])[:8]} | " + " | ".join(f"{row[m]:.1f}" if m in row else "–" for m in fixed)
              + f" | {auto:.1f} | {auto / row[best]:.2f} ({best}) | {auto / row[BASELINE]:.2f} | {off} | {nodes} | {cal} |")
    print()
    print("| method | geometric mean × AR over all rows |")
    print("|---|---|")
    for m, values in sorted(by_method.items(), key=lambda kv: -geometric_mean(kv[1])):
        print(f"| {m} | {geometric_mean(values):.2f} |")
    best_single = max((m for m in fixed), key=lambda m: geometric_mean(by_method[m]))
    print()
    print(f"auto / best fixed per row: min {min(ratio_best):.2f}, rows >= 0.95: {sum(r >= 0.95 for r in ratio_best)}"
          f"/{len(ratio_best)}; auto / AR: min {min(ratio_ar):.2f}, rows >= 0.97: {sum(r >= 0.97 for r in ratio_ar)}"
          f"/{len(ratio_ar)}; geometric mean auto / {best_single} (best single): "
          f"{geometric_mean(by_method[ADAPTIVE]) / geometric_mean(by_method[best_single]):.2f}")
    for (setting, task), (predicted, realised) in sorted(calibration.items()):
        print(f"calibration {setting} {task}: predicted / realised accepted tokens = {predicted / max(realised, 1e-9):.2f}")


if __name__ == "__main__":
    main()
