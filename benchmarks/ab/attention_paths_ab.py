"""The CPU's two attention routes A/B inside one process: the native kernels (ordered
attention for a target forward) against PyTorch's flash kernel, alternating round by
round so both sides see the same machine state.

    python benchmarks/ab/attention_paths_ab.py --data-dir ../shared/data --threads 2

Per round and route: the forward cost of k tokens (a binary tree below a root, best of
--repeats) over each context, then AR and prompt lookup, greedy, on a Multi-News prompt
of --prompt-tokens, with whether prompt lookup's tokens equal AR's (in bf16 they do only
where every forward's attention is fixed by positions: the native route).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.runtime import attention, ordered_keys
from longspec.speculation.cost_model import measure_forward_cost

ROUTES = ("native", "flash")


def use_route(route: str, native_ops) -> None:
    """Point both attention call sites at the native kernels, or at none (flash)."""
    ops = native_ops if route == "native" else (lambda: None)
    attention.attention_ops = ops
    ordered_keys.attention_ops = ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/attention_paths_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native_ops = attention.attention_ops
    if native_ops() is None:
        raise SystemExit("the native attention kernels are unavailable on this machine (reason logged)")
    model = longspec.load()
    row = json.loads((args.data_dir / "longbench" / "multi_news.jsonl").read_text().splitlines()[0])
    ids = model.tokenizer(row.get("context") or row.get("input"))["input_ids"][: args.prompt_tokens]
    results = []
    for round_index in range(args.rounds):
        for route in ROUTES:
            use_route(route, native_ops)
            for context in args.contexts:
                cost = measure_forward_cost(model.model, context=context, ks=args.ks, repeats=args.repeats)
                results.append({"round": round_index, "route": route, "context": context, "ks": list(cost.ks),
                                "seconds": list(cost.seconds)})
                row_ms = " ".join(f"k={k}:{s * 1e3:.1f}" for k, s in zip(cost.ks, cost.seconds))
                print(f"round {round_index} {route:6s} context {context}: {row_ms} ms", flush=True)
            outputs = {}
            for method in ("ar", "pld"):
                result = model.generate(ids, max_new_tokens=args.new_tokens, method=method, ignore_eos=True)
                outputs[method] = list(result.token_ids)
                results.append({"round": round_index, "route": route, "method": method, "prompt_tokens": len(ids),
                                "decode_tokens_per_s": result.stats.decode_tokens_per_s})
                print(f"round {round_index} {route:6s} {method}: {result.stats.decode_tokens_per_s:.1f} tok/s", flush=True)
            same = outputs["pld"] == outputs["ar"]
            results[-1]["pld_equals_ar"] = same
            print(f"round {round_index} {route:6s} prompt lookup's tokens equal AR's: {same}", flush=True)
    use_route("native", native_ops)
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}, results)


if __name__ == "__main__":
    main()
