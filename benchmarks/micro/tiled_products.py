"""The tiled bf16 product (`kernels/bf16_packed_linear.cpp`; AVX-512 BF16, or its AVX2 path)
against oneDNN's prepacked product (or PyTorch's plain bf16 product where oneDNN declines
the weight, as on AVX2-only CPUs), in one run: per Gemma 3 270M weight shape and row count (random weights,
products repeated; the 262k head streams from memory, the small matrices stay in cache),
then end to end in the batched engine with the target's weights prepared either way
(AR at B = 1 and 8, AR and PLD at B = 4, 4k-token LongBench prompts, greedy), the two
sides alternating in one process.

    python benchmarks/micro/tiled_products.py --threads 2 --new-tokens 64
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
from longspec.runtime import linear
from longspec.speculation.engine import EngineOptions
from longspec.speculation.processors import SamplingParams

SHAPES = {"head": (262144, 640), "qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)}


def per_call_ms(product, reps: int) -> float:
    product()
    start = time.perf_counter()
    for _ in range(reps):
        product()
    return (time.perf_counter() - start) / reps * 1e3


def products(rows_list, reps_small: int) -> list[dict]:
    ops = linear.bf16_linear_ops()
    results = []
    for name, (N, K) in SHAPES.items():
        weight = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
        tiles = ops.bf16_pack_weight(weight)
        fallback = linear.PackedWeight(onednn=linear._onednn_prepack(weight))  # what runs without the tiles
        for rows in rows_list:
            x = torch.randn(rows, K, dtype=torch.bfloat16)
            reps = 10 if name == "head" else reps_small
            tiled = per_call_ms(lambda: ops.bf16_packed_linear(x, tiles, N, None), reps)
            other = per_call_ms(lambda: linear.packed_linear(x, weight, fallback), reps)
            results.append({"part": "product", "matrix": name, "rows": rows, "tiled_ms": tiled,
                            "baseline": "onednn" if fallback.onednn is not None else "torch", "baseline_ms": other,
                            "tiled_speedup": other / tiled})
            print(results[-1], flush=True)
    return results


def end_to_end(args) -> list[dict]:
    options = EngineOptions(progress=False)
    model = longspec.load(engine=options)
    params = SamplingParams(temperature=0.0)
    native_ops = linear.bf16_linear_ops

    def prepare(tiled: bool) -> None:
        linear.bf16_linear_ops = native_ops if tiled else (lambda: None)  # None: prepack falls back to oneDNN
        model.model.prepare(True)

    warm = torch.arange(300) % 1000 + 100
    for method in ("ar", "pld"):
        batched_run(model, [warm, warm], method, 8, params, options, 0)
    results = []
    for task in args.tasks:
        items = TaskSpec.parse(task, args.data_dir).load()
        prompts = [p.ids for p in build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,), limit=8))]
        for round_ in range(args.rounds):
            for tiled in (True, False):
                prepare(tiled)
                rate = {f"{m} B{B}": batched_run(model, prompts[:B], m, args.new_tokens, params, options, 0)[0]
                        for m, B in (("ar", 1), ("ar", 8), ("ar", 4), ("pld", 4))}
                results.append({"part": "end_to_end", "task": task, "round": round_, "tiled": tiled, **rate,
                                "ar B8 / ar B1": rate["ar B8"] / rate["ar B1"], "pld B4 / ar B4": rate["pld B4"] / rate["ar B4"]})
                print(results[-1], flush=True)
    prepare(True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 65, 128])
    parser.add_argument("--tasks", nargs="+", default=["multi_news", "lcc"])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench-out/tiled_products.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if linear.bf16_linear_ops() is None:
        raise SystemExit("no native bf16 product runs on this CPU (it needs AVX-512 BF16 or AVX2 with FMA): "
                         "nothing to compare")
    header = {"benchmark": "tiled_products", "machine": machine(), "time": time.ctime(), "threads": args.threads}
    rows = products(args.rows, reps_small=200)
    if not args.skip_end_to_end:
        rows += end_to_end(args)
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
