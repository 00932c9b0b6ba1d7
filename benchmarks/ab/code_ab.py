"""Two commits of longspec against each other, in one run: decode speed of single
sequences (B = 1) with the embedded Gemma 3 270M, per method, in interleaved processes.

    python benchmarks/ab/code_ab.py --before 7c90624 --after HEAD --methods ar pld auto \
        --context 4096 --new-tokens 256 --pairs 3 --out benchmarks/results/$(date +%F)-code-ab

Each commit is checked out in a temporary git worktree; every pair runs one process
of each (before first in odd pairs, after first in even ones) that loads the model
and times each method's greedy decode (prefill excluded) after a warm-up run. Prints
the median tokens/s per commit and method and their ratio (after / before); writes
JSON lines to --out. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    """Inside one checkout: time each method, print one JSON line per method."""
    import torch

    sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py
    import longspec
    from common import prompt_ids, stdlib_source_text
    from longspec.speculation.engine import EngineOptions

    torch.set_num_threads(args.threads)
    model = longspec.load(engine=EngineOptions(progress=False))
    prompt = prompt_ids(model.tokenizer, stdlib_source_text(8 * args.context), args.context)
    for method in args.methods:
        model.generate(prompt, method=method, max_new_tokens=16)  # warm-up (and auto's cost model, once)
        result = model.generate(prompt, method=method, max_new_tokens=args.new_tokens, ignore_eos=True)
        stats = result.stats
        print(json.dumps({"method": method, "tokens_per_s": stats.new_tokens / stats.decode_s,
                          "tau": stats.tau, "tokens": result.token_ids}), flush=True)


def checkout(ref: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), ref], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return into


def run_one(tree: Path, args) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--context", str(args.context),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--methods", *args.methods]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD~1")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "auto"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import machine

    with tempfile.TemporaryDirectory() as scratch:
        trees = {label: checkout(ref, Path(scratch) / label) for label, ref in (("before", args.before),
                                                                                  ("after", args.after))}
        try:
            rows = []
            for pair in range(args.pairs):
                order = ("before", "after") if pair % 2 == 0 else ("after", "before")
                for label in order:
                    for row in run_one(trees[label], args):
                        rows.append({"pair": pair, "code": label, **row})
                        print(f"pair {pair} {label:6s} {row['method']:5s} {row['tokens_per_s']:7.2f} tok/s "
                              f"tau {row['tau']:.2f}", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    refs = {label: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True,
                                  text=True).stdout.strip() for label, ref in (("before", args.before),
                                                                               ("after", args.after))}
    print(f"\nmachine: {machine()}; context {args.context}, {args.new_tokens} new tokens, {args.threads} threads, "
          f"{args.pairs} interleaved pairs; before {refs['before']}, after {refs['after']}\n")
    print("| method | before tok/s | after tok/s | after / before | same tokens |")
    print("|---|---|---|---|---|")
    for method in args.methods:
        speed = {label: statistics.median(r["tokens_per_s"] for r in rows if r["code"] == label
                                          and r["method"] == method) for label in ("before", "after")}
        outputs = {tuple(r["tokens"]) for r in rows if r["method"] == method}
        print(f"| {method} | {speed['before']:.2f} | {speed['after']:.2f} | {speed['after'] / speed['before']:.3f} "
              f"| {'yes' if len(outputs) == 1 else 'NO'} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps({**row, "refs": refs, "machine": machine(), "context": args.context,
                                      "new_tokens": args.new_tokens}) + "\n")


if __name__ == "__main__":
    main()
