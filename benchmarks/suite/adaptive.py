"""`auto` against the fixed methods on one long prompt, greedy and sampled, in one
run: decode tokens/s, τ and the controller's account (rounds with speculation off,
nodes per round, predicted vs realised accepted tokens per round, calls per component).

    python benchmarks/suite/adaptive.py --task lcc --prompt-tokens 4096 --new-tokens 128 --item 1

A first measurement, not the full-preset comparison the adaptive-speculation issue
asks for (`longspec bench --preset full --methods ar pld ngram longspec-ngram auto`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.bench.tasks import PromptFilter, TaskSpec, build_prompts

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
METHODS = {"ar": ("ar", None), "pld": ("pld", None), "ngram": ("ngram", None), "auto": ("auto", None),
           "auto-ucb": ("auto", {"policy": "ucb"})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="lcc")
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--item", type=int, default=1, help="which prompt of the task")
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "auto", "auto-ucb"], choices=list(METHODS))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/adaptive.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load()
    items = TaskSpec.parse(args.task, args.data_dir).load()
    prompts = build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,), limit=args.item + 1))
    ids = prompts[args.item].ids
    rows = []
    for temperature in args.temperatures:
        for name in args.methods:
            method, options = METHODS[name]
            result = model.generate(ids, max_new_tokens=args.new_tokens, method=method, method_options=options,
                                    temperature=temperature, seed=0, ignore_eos=True)
            s = result.stats
            row = {"method": name, "temperature": temperature, "tokens_per_s": s.decode_tokens_per_s, "tau": s.tau,
                   "controller": s.controller}
            rows.append(row)
            print(row, flush=True)
    header = {"benchmark": "adaptive", "machine": machine(), "task": args.task, "item": args.item,
              "prompt_tokens": ids.numel(), "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
