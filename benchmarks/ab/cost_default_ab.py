"""`auto` deciding with the default forward-cost curve (a machine not measured yet) against
`auto` with this machine's measured curve and against plain decoding, in turns in one
process, per prompt and setting: is `auto` ever slower than AR because of the default?

    python benchmarks/ab/cost_default_ab.py --repeats 2

The measured curve is this machine's cached one (measured first where missing); the
default side finds no cached curve and queues nothing. Prints decode tokens/s per run
(setup excluded: GenerationStats.decode_tokens_per_s) and each side's mean ratio to AR;
writes JSON lines to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, prose_text, stdlib_source_text, write_results
from longspec.speculation import cost_measurement, cost_model

SETTINGS = {"greedy": {}, "sampled": {"temperature": 0.8, "top_p": 0.95, "seed": 0}}


@contextmanager
def default_curve():
    """Lookups find no measured curve and queue nothing: `auto` decides with the default."""
    stored, autostart = cost_model._stored, cost_measurement._autostart
    cost_model._stored = lambda key, directory, ks: None
    cost_measurement.set_policy("background")
    cost_measurement._autostart = False
    try:
        yield
    finally:
        cost_model._stored, cost_measurement._autostart = stored, autostart
        cost_measurement.set_policy("now")
        cost_measurement._pending.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/cost_default_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = longspec.load()
    prompts = {name: model.tokenizer(text).input_ids[: args.context]
               for name, text in (("stdlib code", stdlib_source_text(20 * args.context)),
                                  ("prose", prose_text(20 * args.context)))}
    model.generate(next(iter(prompts.values()))[:64], max_new_tokens=8, method="auto")  # warm-up, measures the curve
    rows = []
    sides = ("ar", "auto measured", "auto default")
    for repeat in range(args.repeats):
        for prompt, ids in prompts.items():
            for setting, options in SETTINGS.items():
                order = sides if repeat % 2 == 0 else tuple(reversed(sides))
                for side in order:
                    method = "ar" if side == "ar" else "auto"
                    if side == "auto default":
                        with default_curve():
                            stats = model.generate(ids, max_new_tokens=args.new_tokens, method=method, **options).stats
                    else:
                        stats = model.generate(ids, max_new_tokens=args.new_tokens, method=method, **options).stats
                    row = {"repeat": repeat, "prompt": prompt, "setting": setting, "side": side,
                           "decode_tokens_per_s": stats.decode_tokens_per_s, "tau": stats.tau,
                           "cost_curve": stats.controller.get("cost_curve"), "setup_s": stats.setup_s}
                    rows.append(row)
                    print(f"{repeat} {prompt:12} {setting:8} {side:13} {stats.decode_tokens_per_s:6.1f} tok/s "
                          f"tau {stats.tau:.2f} {row['cost_curve'] or ''}", flush=True)
    print()
    for side in sides[1:]:
        ratios = []
        for prompt in prompts:
            for setting in SETTINGS:
                mine = [r["decode_tokens_per_s"] for r in rows if (r["side"], r["prompt"], r["setting"]) == (side, prompt, setting)]
                ar = [r["decode_tokens_per_s"] for r in rows if (r["side"], r["prompt"], r["setting"]) == ("ar", prompt, setting)]
                ratio = statistics.mean(mine) / statistics.mean(ar)
                ratios.append(ratio)
                print(f"{side:13} {prompt:12} {setting:8} {ratio:.3f}x AR")
        print(f"{side:13} geometric mean {statistics.geometric_mean(ratios):.3f}x AR, lowest {min(ratios):.3f}")
    write_results(args.out, {"machine": machine(), "args": vars(args) | {"out": str(args.out)}}, rows)


if __name__ == "__main__":
    main()
