"""Autoregressive decoding: our runtime vs `transformers` generate, same model,
dtype, prompt and greedy decoding, in one run; with the memory-bandwidth floor.

    python benchmarks/suite/ar_decode.py --contexts 1024 4096 --new-tokens 128 --dtype bfloat16

Prints a markdown table (ratios against transformers and against the floor) and
writes JSON lines to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import (
    decode_bytes_per_forward,
    hf_generate,
    machine,
    prompt_ids,
    read_bandwidth_gbs,
    stdlib_source_text,
    transformers_peer,
    write_results,
)
from longspec.api import parse_dtype
from longspec.speculation.metrics import GenerationStats


def ours(model, ids, new_tokens):
    stats = GenerationStats()
    out = torch.cat(list(model.engine.generate(ids, max_new_tokens=new_tokens, stats=stats)))
    return out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("bench-out/ar_decode.jsonl"))
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)

    model = longspec.load(args.model, dtype=dtype)
    peer = transformers_peer(model.target.source, dtype)
    bandwidth = read_bandwidth_gbs()
    text = stdlib_source_text(60 * max(args.contexts))
    rows = []
    warm = prompt_ids(model.tokenizer, text, 64)
    ours(model, warm, 8)
    hf_generate(peer, warm, 8)
    for context in args.contexts:
        ids = prompt_ids(model.tokenizer, text, context)
        our_tokens, stats = ours(model, ids, args.new_tokens)
        _, hf_prefill_s = hf_generate(peer, ids, 1)
        hf_tokens, hf_total_s = hf_generate(peer, ids, args.new_tokens)
        hf_decode_tps = (args.new_tokens - 1) / (hf_total_s - hf_prefill_s)
        floor_tps = bandwidth * 1e9 / decode_bytes_per_forward(model.model, context + args.new_tokens // 2)
        row = {
            "context": context,
            "new_tokens": args.new_tokens,
            "dtype": args.dtype,
            "ours_decode_tps": stats.decode_tokens_per_s,
            "ours_e2e_tps": args.new_tokens / (stats.prefill_s + stats.decode_s),
            "ours_prefill_tps": stats.prefill_tokens_per_s,
            "hf_decode_tps": hf_decode_tps,
            "hf_e2e_tps": args.new_tokens / hf_total_s,
            "hf_prefill_tps": context / hf_prefill_s,
            "floor_tps": floor_tps,
            "bandwidth_gbs": bandwidth,
            "equal_to_hf": bool(torch.equal(our_tokens, hf_tokens)),
            "first_divergence": None
            if torch.equal(our_tokens, hf_tokens)
            else int((our_tokens != hf_tokens).nonzero()[0]),
        }
        rows.append(row)
        print(row, flush=True)
    header = {"benchmark": "ar_decode", "machine": machine(), "model": model.target.source, "time": time.ctime()}
    write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}\n")
    print("| context | dtype | ours decode tok/s | transformers decode tok/s | ratio | floor tok/s | floor/ours "
          "| ours prefill tok/s | transformers prefill tok/s | ratio | e2e ratio | tokens equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['dtype']} | {r['ours_decode_tps']:.1f} | {r['hf_decode_tps']:.1f} | "
            f"{r['ours_decode_tps'] / r['hf_decode_tps']:.2f}x | {r['floor_tps']:.1f} | "
            f"{r['floor_tps'] / r['ours_decode_tps']:.2f}x | {r['ours_prefill_tps']:.0f} | {r['hf_prefill_tps']:.0f} | "
            f"{r['ours_prefill_tps'] / r['hf_prefill_tps']:.2f}x | {r['ours_e2e_tps'] / r['hf_e2e_tps']:.2f}x | "
            f"{'yes' if r['equal_to_hf'] else 'no (first at ' + str(r['first_divergence']) + ')'} |"
        )


if __name__ == "__main__":
    main()
