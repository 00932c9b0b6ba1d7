"""The prefill policy of continuous batching: while R rows decode, a request with a
long prompt joins. Its prefill runs in the engine's prefill chunks, at most
`prefill_tokens_per_step` tokens per step, between the decoding rounds. Small budgets keep the
decoding rows' inter-token latency low; large ones give the joining request its
first token sooner. For each budget this reports the decoding rows' worst and mean
step time while the join is under way, and the joining request's time to first
token, against the steady step time with no join (one run, same machine).

    python benchmarks/suite/batch_join.py --rows 4 --prompt-tokens 4096 --budgets 64 128 256 512 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 4096])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/batch_join.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(engine=EngineOptions(progress=False))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.prompt_tokens,), generator=generator) for _ in range(args.rows + 1)]
    rows = []
    for budget in args.budgets:
        batch = BatchOptions(max_rows=args.rows + 1, row_capacity=args.prompt_tokens + 600,
                             prefill_tokens_per_step=budget)
        engine = BatchEngine(model.model, EngineOptions(progress=False), batch)
        for prompt in prompts[:-1]:
            engine.submit(prompt, max_new_tokens=500)
        while engine.decoding_rows < args.rows:
            engine.step()
        steady = []
        for _ in range(5):
            t0 = time.perf_counter()
            engine.step()
            steady.append(time.perf_counter() - t0)
        joiner = engine.submit(prompts[-1], max_new_tokens=8)
        arrived = time.perf_counter()
        during = []
        while not joiner.stats.new_tokens:
            t0 = time.perf_counter()
            engine.step()
            during.append(time.perf_counter() - t0)
        ttft = time.perf_counter() - arrived
        row = {"budget": budget, "steady_step_s": statistics.median(steady), "join_steps": len(during),
               "max_step_s": max(during), "mean_step_s": statistics.mean(during), "joiner_ttft_s": ttft}
        rows.append(row)
        print(row, flush=True)
    header = {"benchmark": "batch_join", "machine": machine(), "rows": args.rows, "prompt_tokens": args.prompt_tokens,
              "threads": torch.get_num_threads(), "time": time.ctime()}
    write_results(args.out, header, rows)
    print("\n| prefill tokens per step | steps to join | worst step / steady | mean step / steady | joiner TTFT (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['join_steps']} | {r['max_step_s'] / r['steady_step_s']:.1f}× | "
              f"{r['mean_step_s'] / r['steady_step_s']:.1f}× | {r['joiner_ttft_s']:.2f} |")


if __name__ == "__main__":
    main()
