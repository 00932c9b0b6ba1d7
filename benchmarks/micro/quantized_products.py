"""The quantized products against their floor: one-row time of each layer product of
Gemma 3 270M Q4_K_M (the file's own tensors, repacked), against the bytes it must read over
this machine's streaming read bandwidth, and against the bf16 kernel over the same weights
dequantized (what a dequantizing load runs). Also a few-row product (a verified chain).

    python benchmarks/micro/quantized_products.py --threads 2 --gguf /tmp/gemma-3-270m-q4_k_m.gguf \
        --previous 1ad6055

--previous COMMIT builds that commit's `kernels/gguf_linear.cpp` as a library of its own and
times it beside today's kernel in the same process, the two alternated call by call (the
repacked layout is the same): the ratio previous / today per product and row count.

--head: the output layer instead (the file's `output.weight`, else the tied `token_embd.weight`:
Gemma 3 270M's 262,144 x 640 Q8_0 rows), at --rows, against its floor; with --previous, each
kernel on its own repack (where the weight lies in memory is the repack's choice).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from longspec.bench.floor import read_bandwidth_gbs


def previous_kernel(commit: str):
    """`torch.ops.longspec_previous`: gguf_linear.cpp (and its header) as of `commit`, built
    under another library name so both kernels load in one process."""
    import subprocess
    import tempfile

    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parents[2]
    kernels = "src/longspec/runtime/kernels"
    directory = Path(tempfile.mkdtemp(prefix="longspec-previous-"))
    for name in ("gguf_linear.cpp", "cpu_features.h"):
        text = subprocess.run(["git", "show", f"{commit}:{kernels}/{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        (directory / name).write_text(text.replace("TORCH_LIBRARY_FRAGMENT(longspec_native", "TORCH_LIBRARY_FRAGMENT(longspec_previous"))
    load(name=f"longspec_previous_{commit}", sources=[str(directory / "gguf_linear.cpp")],
         extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.longspec_previous


def alternated(first, second, calls: int = 1000) -> tuple[float, float]:
    """Lower quartiles of single calls of two functions, alternated call by call."""
    for _ in range(20):
        first(), second()
    samples = ([], [])
    for _ in range(calls):
        for fn, times in zip((first, second), samples):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return tuple(sorted(times)[len(times) // 4] for times in samples)


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
    parser.add_argument("--previous", default=None, help="a commit whose gguf_linear.cpp to time beside today's")
    parser.add_argument("--head", action="store_true", help="the output layer's product instead of a layer's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    previous = previous_kernel(args.previous) if args.previous else None
    import gguf

    from longspec.runtime.linear import packed_linear, prepack
    from longspec.runtime.native import native_ops
    from longspec.runtime.quantized import segment, stacked

    print(f"path {native_ops().gguf_linear_path()}, threads {args.threads}")
    bandwidth = 1e9 * read_bandwidth_gbs()
    print(f"streaming read: {bandwidth / 1e9:.1f} GB/s")
    reader = gguf.GGUFReader(args.gguf)
    tensors = {t.name: t for t in reader.tensors}
    if args.head:
        return head_rows(tensors, args.rows, bandwidth, previous)
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
                  f"(floor {fb * 1e6:6.1f})   bf16/quantized {tb / tq:.2f}x", flush=True)
            if previous is not None:
                segments = weight.segments
                args_of = ([s.packed for s in segments], [s.kind for s in segments], [s.rows for s in segments], None)
                tn, tp = alternated(lambda x=x, a=args_of: native_ops().gguf_linear(x, *a),
                                    lambda x=x, a=args_of: previous.gguf_linear(x, *a))
                same = torch.equal(native_ops().gguf_linear(x, *args_of), previous.gguf_linear(x, *args_of))
                print(f"{'':8s} today {tn * 1e6:7.1f} us, previous {tp * 1e6:7.1f} us: previous / today {tp / tn:.2f}x, "
                      f"same bits {same}, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"one layer, one row: quantized {total_q * 1e6:.0f} us (floor {floor_q * 1e6:.0f}),"
          f" bf16 {total_b * 1e6:.0f} us (floor {floor_b * 1e6:.0f})")


def head_rows(tensors: dict, row_counts: list[int], bandwidth: float, previous) -> None:
    from longspec.runtime.native import native_ops

    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    cols, rows = (int(n) for n in t.shape)
    raw = torch.from_numpy(np.array(np.asarray(t.data).reshape(rows, -1)))
    kind, ops = int(t.tensor_type), native_ops()
    today = ops.gguf_repack(raw, kind, cols)
    floor = today.numel() / bandwidth
    print(f"{t.name} [{rows} x {cols}] GGML type {kind}: {today.numel() / 1e6:.1f} MB, floor {floor * 1e3:.2f} ms")
    before = previous.gguf_repack(raw, kind, cols) if previous is not None else None
    for m in row_counts:
        x = torch.randn(m, cols).bfloat16()
        run = lambda: ops.gguf_linear(x, [today], [kind], [rows], None)  # noqa: E731
        if previous is None:
            tt = timed(run, calls=100)
            print(f"head rows {m:3d}: {tt * 1e3:6.2f} ms = {tt / floor:.2f}x floor, load {os.getloadavg()[0]:.1f}", flush=True)
            continue
        old = lambda: previous.gguf_linear(x, [before], [kind], [rows], None)  # noqa: E731
        tn, tp = alternated(run, old, calls=100)
        same = torch.equal(run(), old())
        print(f"head rows {m:3d}: today {tn * 1e3:6.2f} ms ({tn / floor:.2f}x floor), previous {tp * 1e3:6.2f} ms: "
              f"previous / today {tp / tn:.2f}x, same bits {same}, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
