"""The certified head against the full head, in one run on one machine: greedy decoding
(`ar`, and speculative methods), the cost of a k-token verification forward with its
decisions, and the candidates the screen leaves per decision.

    python benchmarks/ab/certified_head.py --contexts 1024 4096 --new-tokens 128 --methods ar pld auto \
        --verify-widths 1 4 16 --repeats 3 --out benchmarks/results/$(date +%F)-certified-head

Both heads run in the same process, in turns (the full head is the model without its
certified head). Decoding is timed after prefill; the forward cost is the median of
repeated forwards over a cache of random keys, each followed by its decisions (the
argmax of every row). Every decoded output of the certified head is checked against the full
head's. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, prompt_ids, stdlib_source_text
from longspec.runtime.argmax import row_argmax
from longspec.speculation.cost_model import commit_random_keys
from longspec.speculation.engine import EngineOptions
from longspec.speculation.tree import Tree


SETTINGS = {"greedy": {}, "sampled": {"temperature": 1.0, "top_p": 0.95, "seed": 0}}


def decode(model, prompt, method: str, new_tokens: int, setting: str = "greedy") -> tuple[float, list[int]]:
    result = model.generate(prompt, method=method, max_new_tokens=new_tokens, ignore_eos=True, **SETTINGS[setting])
    return result.stats.new_tokens / result.stats.decode_s, result.token_ids


def forward_cost(decoder, context: int, width: int, repeats: int, certified: bool) -> float:
    """Seconds of one forward of a `width`-token chain over `context` committed positions,
    with the argmax of every row (best of `repeats` after a warm-up, as the cost model
    measures forwards)."""
    cache = decoder.new_cache(context + width + 1, max_forward_tokens=max(512, width))
    commit_random_keys(decoder, cache, context, chunk=512)
    ids = torch.randint(0, decoder.config.vocab_size, (width,), generator=torch.Generator().manual_seed(0))
    tree = Tree.chain(int(ids[0]), ids[1:].tolist())
    positions = cache.length + tree.depths

    def forward():
        hidden = decoder(tree.tokens.unsqueeze(0), cache, positions=positions, with_logits=False).hidden[0]
        return decoder.decide(hidden) if certified else row_argmax(decoder.logits(hidden))

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
        cache.drop_pending()
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "auto"])
    parser.add_argument("--settings", nargs="+", default=["greedy", "sampled"], choices=sorted(SETTINGS))
    parser.add_argument("--verify-widths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(engine=EngineOptions(progress=False))
    decoder = model.model
    start = time.perf_counter()
    head = decoder.certified_head
    build_s = time.perf_counter() - start
    if head is None:
        raise SystemExit("no certified head on this machine (no native bf16 kernels, or LONGSPEC_CERTIFIED_HEAD=0)")
    rows = []
    text = stdlib_source_text(12 * max(args.contexts))
    for context in args.contexts:
        prompt = prompt_ids(model.tokenizer, text, context)
        for setting in args.settings:
            for method in args.methods:
                decode(model, prompt, method, 16, setting)  # warm-up (and auto's cost model, once)
                speeds = {"full": [], "certified": []}
                outputs = {}
                for repeat in range(args.repeats):
                    for label in (("full", "certified") if repeat % 2 == 0 else ("certified", "full")):
                        decoder._certified_head = head if label == "certified" else None
                        speed, tokens = decode(model, prompt, method, args.new_tokens, setting)
                        speeds[label].append(speed)
                        outputs.setdefault(label, tokens)
                decoder._certified_head = head
                # Sampled runs draw through different samplers (each exact): only greedy tokens must match.
                same = outputs["full"] == outputs["certified"] if setting == "greedy" else None
                row = {"kind": "decode", "context": context, "setting": setting, "method": method,
                       "full_tps": statistics.median(speeds["full"]),
                       "certified_tps": statistics.median(speeds["certified"]), "same_tokens": same, "speeds": speeds}
                rows.append(row)
                print(f"decode {context:5d} {setting:7s} {method:5s} full {row['full_tps']:6.2f} tok/s  certified "
                      f"{row['certified_tps']:6.2f} tok/s  x{row['certified_tps'] / row['full_tps']:.3f}  "
                      f"same tokens: {same}", flush=True)
        for width in args.verify_widths:
            costs = {"full": [], "certified": []}
            for repeat in range(args.repeats):
                for label in ("full", "certified") if repeat % 2 == 0 else ("certified", "full"):
                    costs[label].append(forward_cost(decoder, context, width, 5, label == "certified"))
            row = {"kind": "forward", "context": context, "width": width,
                   "full_ms": 1e3 * statistics.median(costs["full"]),
                   "certified_ms": 1e3 * statistics.median(costs["certified"])}
            rows.append(row)
            print(f"forward {context:5d} width {width:3d}: full {row['full_ms']:6.2f} ms  certified "
                  f"{row['certified_ms']:6.2f} ms  x{row['certified_ms'] / row['full_ms']:.3f}", flush=True)
    stats = head.stats
    summary = {"kind": "candidates", "rows": stats.rows, "fallbacks": stats.fallbacks,
               "median": stats.percentile(0.5), "p99": stats.percentile(0.99),
               "max": max(stats.candidates) if stats.candidates else 0, "build_s": build_s,
               "head_mib": head.nbytes / 2**20}
    rows.append(summary)
    print(f"candidates per decision: median {summary['median']}, p99 {summary['p99']}, max {summary['max']}, "
          f"fallbacks {stats.fallbacks} of {stats.rows} rows; built in {build_s:.1f} s, {summary['head_mib']:.0f} MiB")
    print(f"machine: {machine()}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps({**row, "machine": machine()}) + "\n")


if __name__ == "__main__":
    main()
