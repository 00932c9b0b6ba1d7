"""Few-query attention per call: the native kernel against PyTorch's flash kernel
(the CPU backend's two routes), over Gemma 3 270M's head shape (4 query heads on 1
K/V head of dim 256), rows B, keys S and new tokens per row T, in one run. "native"
reads the slots in order; "ordered" is the call a target forward makes (keys listed by
position: a committed prefix seen by all, then T pending tokens under a causal mask,
chunks of 128 positions up to 1024 keys and 512 beyond, as for sliding / full layers).

    python benchmarks/micro/few_query_attention.py --threads 2
    python benchmarks/micro/few_query_attention.py --baseline-source OLD.cpp   # also time another kernel source

--baseline-source builds a second copy of `few_query_attention.cpp` (e.g. the file from
an earlier commit, `git show REV:src/longspec/runtime/kernels/few_query_attention.cpp`)
under its own library name, so an old and a new kernel are timed side by side.
Median of --repeats calls after warm-up; K/V of one call are distinct tensors per
shape but stay warm in the caches across repeats (a forward reads them cold).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import baseline_library, machine, write_results
from longspec.runtime.native import attention_ops
from longspec.runtime.ordered_keys import FULL_CHUNK_POSITIONS, RING_CHUNK_POSITIONS, prefix_then_pending

BASELINE_LIBRARY = "longspec_baseline_attention"


def median_ms(call, repeats: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def baseline_kernel(source: Path):
    """The op of another kernel source, built under its own library name."""
    return baseline_library(source, BASELINE_LIBRARY).few_query_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x16384", "1x4096", "1x512", "8x4096", "8x512"],
                        help="rows x keys")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 9, 17, 33, 65, 129])
    parser.add_argument("--query-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--baseline-source", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/few_query_attention.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = attention_ops()
    if ops is None:
        raise SystemExit("the native kernels are unavailable on this machine (AVX-512 BF16 or AVX2, and a compiler needed)")
    baseline = baseline_kernel(args.baseline_source) if args.baseline_source else None
    group = args.query_heads // args.kv_heads
    scale = args.head_dim**-0.5
    rows = []
    print("| rows | keys | tokens | native ms | ordered ms | flash ms | flash / native | ordered / native |"
          + (" baseline ms | baseline / native |" if baseline else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if baseline else ""))
    for shape in args.shapes:
        B, S = (int(x) for x in shape.split("x"))
        k = torch.randn(B, args.kv_heads, S, args.head_dim).bfloat16()
        v = torch.randn(B, args.kv_heads, S, args.head_dim).bfloat16()
        for T in args.tokens:
            q = torch.randn(B, args.query_heads, T, args.head_dim).bfloat16()
            stacked = q.reshape(B, args.kv_heads, group * T, args.head_dim)  # how the flash route calls it
            native = median_ms(lambda: ops.few_query_attention(q, k, v, None, scale), args.repeats)
            flash = median_ms(lambda: F.scaled_dot_product_attention(stacked, k, v, scale=scale), args.repeats)
            chunk = RING_CHUNK_POSITIONS if S <= 1024 else FULL_CHUNK_POSITIONS
            causal = torch.ones(T, T, dtype=torch.bool).tril_()
            one = prefix_then_pending(S - T, torch.arange(S - T, S), causal, chunk)
            keys = [t.expand(B, *t.shape[1:]).contiguous() for t in (one.slots, one.positions, one.visible)]
            counts, shared = one.counts.expand(B).contiguous(), one.shared.expand(B).contiguous()
            ordered = median_ms(lambda: ops.ordered_attention(q, k, v, keys[0], keys[1], counts, shared, keys[2],
                                                              chunk, scale), args.repeats)
            row = {"rows": B, "keys": S, "tokens": T, "native_ms": native, "ordered_ms": ordered, "flash_ms": flash}
            line = (f"| {B} | {S} | {T} | {native:.3f} | {ordered:.3f} | {flash:.3f} | {flash / native:.2f} |"
                    f" {ordered / native:.2f} |")
            if baseline is not None:
                row["baseline_ms"] = median_ms(lambda: baseline(q, k, v, None, scale), args.repeats)
                line += f" {row['baseline_ms']:.3f} | {row['baseline_ms'] / native:.2f} |"
            print(line, flush=True)
            rows.append(row)
    write_results(args.out, {"machine": machine(), "threads": torch.get_num_threads(),
                             "query_heads": args.query_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                             "baseline_source": None if args.baseline_source is None else str(args.baseline_source)}, rows)


if __name__ == "__main__":
    main()
