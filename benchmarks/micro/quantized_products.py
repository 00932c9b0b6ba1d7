"""The quantized products against their floor: one-row time of each layer product of
Gemma 3 270M Q4_K_M (the file's own tensors, repacked), against the bytes it must read over
this machine's streaming read bandwidth, and against the bf16 kernel over the same weights
dequantized (what a dequantizing load runs). Also a few-row product (a verified chain).

    python benchmarks/micro/quantized_products.py --threads 2 --gguf /tmp/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def read_bandwidth(threads: int, megabytes: int = 512) -> float:
    """Bytes per second of a streaming read: a sum over a buffer far larger than the caches."""
    data = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def timed(fn, calls: int = 1000) -> float:
    """Lower quartile of single calls: on a machine shared with other work, a call that lost a
    core mid-way waits out a scheduler tick (milliseconds), and averages swallow those waits."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 4]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import gguf

    from longspec.runtime.linear import prepack, packed_linear
    from longspec.runtime.native import native_ops
    from longspec.runtime.quantized import segment, stacked

    print(f"path {native_ops().gguf_linear_path()}, threads {args.threads}")
    bandwidth = read_bandwidth(args.threads)
    print(f"streaming read: {bandwidth / 1e9:.1f} GB/s")
    reader = gguf.GGUFReader(args.gguf)
    tensors = {t.name: t for t in reader.tensors}
    p = f"blk.{args.layer}."
    products = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"], "gate_up": ["ffn_gate", "ffn_up"],
                "down": ["ffn_down"]}
    total_q = total_b = floor_q = floor_b = 0.0
    for label, names in products.items():
        parts, dense = [], []
        for name in names:
            t = tensors[p + name + ".weight"]
            cols, rows = (int(n) for n in t.shape)
            raw = np.asarray(t.data).reshape(rows, -1)
            parts.append(segment(t.name, int(t.tensor_type), raw, rows, cols))
            dense.append(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols).copy()))
        weight = stacked(parts, cols)
        bf16 = torch.cat(dense).bfloat16().contiguous()
        packed = prepack(bf16)
        for m in args.rows:
            x = torch.randn(m, cols).bfloat16()
            tq = timed(lambda: weight.linear(x))
            tb = timed(lambda: packed_linear(x, bf16, packed))
            fq, fb = weight.nbytes / bandwidth, bf16.numel() * 2 / bandwidth
            if m == 1:
                total_q, total_b, floor_q, floor_b = total_q + tq, total_b + tb, floor_q + fq, floor_b + fb
            print(f"{label:8s} [{bf16.shape[0]:5d} x {cols:5d}] rows {m:3d}: quantized {tq * 1e6:7.1f} us "
                  f"(floor {fq * 1e6:6.1f}, {weight.nbytes / 1e6:.2f} MB)   bf16 {tb * 1e6:7.1f} us "
                  f"(floor {fb * 1e6:6.1f})   bf16/quantized {tb / tq:.2f}x")
    print(f"one layer, one row: quantized {total_q * 1e6:.0f} us (floor {floor_q * 1e6:.0f}),"
          f" bf16 {total_b * 1e6:.0f} us (floor {floor_b * 1e6:.0f})")


if __name__ == "__main__":
    main()
