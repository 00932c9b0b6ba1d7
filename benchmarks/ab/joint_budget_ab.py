"""The batched engine's joint node budget (`BatchOptions.joint_budget`) against uncut
trees, in one process: PLD at B rows against AR at the same B, 4k-token LongBench
prompts, greedy, each configuration right after the other on the same prompts. The
batched forward's cost is measured (or read from the cache) before any clock starts,
and printed.

    python benchmarks/ab/joint_budget_ab.py --batch-sizes 2 4 8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "suite"))  # batch_throughput.py

import longspec
from batch_throughput import DATA, batched_run
from common import machine, write_results
from longspec.bench.tasks import PromptFilter, TaskSpec, build_prompts
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions
from longspec.speculation.processors import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["multi_news", "lcc"])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/joint_budget_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = EngineOptions(progress=False)
    model = longspec.load(engine=options)
    params = SamplingParams(temperature=args.temperature)
    warm = torch.arange(300) % 1000 + 100
    for method in ("ar", "pld"):
        batched_run(model, [warm, warm], method, 8, params, options, 0)
    most = max(args.batch_sizes)
    costs = BatchEngine(model.model, options, BatchOptions(max_rows=most, row_capacity=64))
    rows = []
    for B in sorted({min(1 << (b - 1).bit_length(), most) for b in range(1, most + 1)}):
        for length in (args.prompt_tokens, args.prompt_tokens + args.new_tokens):
            cost = costs.forward_cost(B, length)
            rows.append({"part": "batched forward cost", "rows": B, "context": cost.key["context"],
                         "tokens_per_row": list(cost.ks), "seconds": list(cost.seconds)})
            print(rows[-1], flush=True)
    for task in args.tasks:
        items = TaskSpec.parse(task, args.data_dir).load()
        prompts = [p.ids for p in build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,), limit=most))]
        for B in args.batch_sizes:
            ar = batched_run(model, prompts[:B], "ar", args.new_tokens, params, options, 0)[0]
            for joint in (True, False):
                tps, handles, steps, _ = batched_run(model, prompts[:B], "pld", args.new_tokens, params, options, 0,
                                                     joint_budget=joint, forward_cost_limit=None)  # against whole trees
                rows.append({"part": "throughput", "task": task, "batch": B, "joint_budget": joint, "ar_tokens_per_s": ar,
                             "pld_tokens_per_s": tps, "pld_over_ar": tps / ar, "rounds": steps,
                             "tau": [round(h.stats.tau, 2) for h in handles]})
                print(rows[-1], flush=True)
    header = {"benchmark": "joint_budget_ab", "machine": machine(), "time": time.ctime(), "threads": args.threads,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "temperature": args.temperature}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
