"""Cost of one target forward of k new tokens against its physical floor: the
knee where verifying a tree stops being free.

    python benchmarks/micro/forward_cost.py --contexts 1024 8192 --threads 2

For each context and tree shape (a chain, a star — every node a child of the root —
and the binary tree the library's cost model uses), times forwards of k = 1..64
tokens (best of N) and prints them relative to k = 1, beside two floors: the bytes
a forward must read (weights + attended K/V) over the measured read bandwidth, and
its FLOPs over the measured bf16/fp32 matmul rate. Writes JSON lines to --out.
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
from longspec.bench.floor import decode_bytes_per_forward, matmul_rate_gflops, matmul_weights, read_bandwidth_gbs
from longspec.speculation.cost_model import binary_tree_parents, measure_forward_cost

SHAPES = {
    "chain": lambda n: torch.arange(-1, n, dtype=torch.long),
    "star": lambda n: torch.tensor([-1] + [0] * n, dtype=torch.long),
    "binary": binary_tree_parents,
}


def forward_flops(model, k: int, context: int) -> float:
    """Matrix-product FLOPs of a forward of k tokens: 2 x (matmul weights) x k, the
    tied head included, plus the attention over the attended keys."""
    c = model.config
    weights = matmul_weights(model)
    head = c.vocab_size * c.hidden_size
    attended = sum(min(context, c.sliding_window) if s else context for s in c.layer_is_sliding)
    attention = 4 * c.num_heads * c.head_dim * attended * k
    return 2 * (weights + head) * k + attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", help="'file': a GGUF's own quantization (dtype unset)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/forward_cost.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(args.model, dtype=None if args.dtype == "file" else args.dtype).model
    bandwidth = read_bandwidth_gbs()
    rate = matmul_rate_gflops(model.dtype)
    header = {"benchmark": "forward_cost", "machine": machine(), "dtype": str(model.dtype), "bandwidth_gbs": bandwidth,
              "matmul_gflops": rate, "time": time.ctime()}
    rows = []
    for context in args.contexts:
        for shape in args.shapes:
            cost = measure_forward_cost(model, context=context, ks=args.ks, repeats=args.repeats,
                                        parents_for=SHAPES[shape])
            for k, seconds in zip(cost.ks, cost.seconds):
                memory_floor = decode_bytes_per_forward(model, context) / (bandwidth * 1e9)
                compute_floor = forward_flops(model, k, context) / (rate * 1e9)
                rows.append({"context": context, "shape": shape, "k": k, "ms": 1e3 * seconds,
                             "relative": seconds / cost.seconds[0], "floor_ms": 1e3 * max(memory_floor, compute_floor),
                             "memory_floor_ms": 1e3 * memory_floor, "compute_floor_ms": 1e3 * compute_floor})
                print(rows[-1], flush=True)
            write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}; read bandwidth {bandwidth:.1f} GB/s; {model.dtype} matmul {rate:.0f} GFLOP/s\n")
    print("| context | shape | k | ms | × k=1 | floor ms (max of memory, compute) | × floor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['shape']} | {r['k']} | {r['ms']:.1f} | {r['relative']:.2f} | {r['floor_ms']:.1f} | "
              f"{r['ms'] / r['floor_ms']:.2f} |")


if __name__ == "__main__":
    main()
