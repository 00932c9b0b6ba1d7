"""Every method with and without the native CPU kernels, in one run on the same
prompts: decode tokens/s, the ratio, τ, and whether the two runs produced the same
tokens (in bf16 a near-tie may round differently; exactness is proven in float32/64).

    python benchmarks/ab/native_kernels.py --tasks multi_news lcc --prompt-tokens 4096 --new-tokens 128

The native kernels serve products of 1-3 rows and the attention of up to 65 new tokens
per row, so plain decoding gains the most in its products; a method whose verification
forwards are wider keeps oneDNN for their products and gains in their attention.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["multi_news", "lcc"])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "longspec-ngram", "longspec"])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/native_kernels.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load()
    rows = []
    for task in args.tasks:
        items = TaskSpec.parse(task, args.data_dir).load()
        ids = build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,), limit=1))[0].ids
        for temperature in args.temperatures:
            for method in args.methods:
                runs = {}
                for native in (False, True):
                    model.model.prepare(native_kernels=native)
                    runs[native] = model.generate(ids, max_new_tokens=args.new_tokens, method=method,
                                                  temperature=temperature, top_p=0.95 if temperature else 1.0,
                                                  seed=0, ignore_eos=True)
                off, on = runs[False].stats, runs[True].stats
                row = {"task": task, "temperature": temperature, "method": method,
                       "tokens_per_s_without": off.decode_tokens_per_s, "tokens_per_s_native": on.decode_tokens_per_s,
                       "speedup": on.decode_tokens_per_s / off.decode_tokens_per_s, "tau_without": off.tau,
                       "tau_native": on.tau, "same_tokens": runs[False].token_ids == runs[True].token_ids}
                rows.append(row)
                print(row, flush=True)
    header = {"benchmark": "native_kernels", "machine": machine(), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "time": time.ctime()}
    write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}, {header['threads']} threads\n")
    print("| task | T | method | tok/s without | tok/s native | × | τ without / native | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['temperature']:g} | {r['method']} | {r['tokens_per_s_without']:.1f} "
              f"| {r['tokens_per_s_native']:.1f} | {r['speedup']:.2f} | {r['tau_without']:.2f} / {r['tau_native']:.2f} "
              f"| {'yes' if r['same_tokens'] else 'no'} |")


if __name__ == "__main__":
    main()
