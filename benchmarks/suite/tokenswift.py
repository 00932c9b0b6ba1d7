"""TokenSwift on long generation: AR vs TokenSwift (the paper's drafting forward over
a dynamic partial cache) vs the heads on the verification pass (one forward per
round, `tokenswift-onepass`) vs TokenSwift without token reutilization vs without the
dynamic partial cache vs the MagicDec and TriForce* self-speculation baselines, in one run, sampling as in the paper (min-p 0.1, contextual
penalty θ = 1.2 over W = 1024, temperature 1), or greedy with --greedy.

    python benchmarks/suite/tokenswift.py --prompt-tokens 2048 --new-tokens 2048 4096

Reports decode tokens/s (wall time after prefill, the drafter's warm-up
included), the ratio to AR, τ (tokens per target forward), acceptance by depth,
Distinct-1..4 of the output; writes JSON lines to --out and prints a markdown table.
Sampled outputs of different methods are different samples of the same
distribution (losslessness is proven by the tests), so they are not compared
token by token.
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
from longspec.api import parse_dtype
from longspec.speculation.metrics import distinct_n
from longspec.speculation.drafters.self_speculation import MagicDecDrafter, TriForceDrafter
from longspec.speculation.drafters.tokenswift.drafter import TokenSwiftDrafter
from longspec.speculation.drafters.shared.partial_cache import PartialKVCache
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams

BOOK = Path(__file__).resolve().parents[3] / "shared" / "data" / "books" / "austen-emma.txt"

VARIANTS = {
    "ar": None,
    "tokenswift": lambda heads: TokenSwiftDrafter(heads),
    "one-pass": lambda heads: OnePassTokenSwiftDrafter(heads),
    "one-pass-large": lambda heads: OnePassTokenSwiftDrafter(heads, widths=(4, 2, 1), k=8),
    "one-pass-wide": lambda heads: OnePassTokenSwiftDrafter(heads, widths=(3, 3, 3), k=20),
    "one-pass-full-vocab": lambda heads: OnePassTokenSwiftDrafter(heads, context_vocab=False),
    "no-reutilization": lambda heads: TokenSwiftDrafter(heads, k=0),
    "no-dynamic-cache": lambda heads: TokenSwiftDrafter(heads, dynamic_cache=False),
    # Baselines: the target drafts a chain for itself over a StreamingLLM / importance cache.
    "magicdec": lambda heads: MagicDecDrafter(),
    "triforce": lambda heads: TriForceDrafter(),
}


def book_prompt(tokenizer, tokens: int) -> torch.Tensor:
    if BOOK.is_file():
        text = BOOK.read_text(errors="replace")
    else:  # any machine: Python's documentation prose
        from common import prose_text

        text = prose_text(40 * tokens)
    ids = tokenizer(text).input_ids
    if len(ids) < 2000 + tokens:
        raise ValueError(f"the prompt corpus has {len(ids)} tokens, fewer than {2000 + tokens}")
    return torch.tensor(ids[2000 : 2000 + tokens])  # skip the front matter


def run(model, ids, new_tokens, drafter, params, seed):
    stats = GenerationStats()
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    out = torch.cat(list(model.engine.generate(ids, params=params, max_new_tokens=new_tokens, drafter=drafter,
                                               generator=generator, stats=stats)))
    wall = time.perf_counter() - start - stats.prefill_s
    return out, stats, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--heads", default=None, help="heads file (default: the shipped Gemma 3 270M heads)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--min-p", type=float, default=0.1)
    parser.add_argument("--penalty", type=float, default=1.2)
    parser.add_argument("--penalty-window", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (with the same penalty)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/tokenswift.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = (SamplingParams(penalty=args.penalty, penalty_window=args.penalty_window) if args.greedy else
              SamplingParams(temperature=1.0, min_p=args.min_p, penalty=args.penalty, penalty_window=args.penalty_window))
    model = longspec.load(args.model, dtype=parse_dtype(args.dtype))
    ids = book_prompt(model.tokenizer, args.prompt_tokens)
    for name in args.variants:
        make = VARIANTS[name]
        run(model, ids[:256], 16, make and make(args.heads), params, args.seed)
    rows = []
    header = {"benchmark": "tokenswift", "machine": machine(), "model": model.target.source, "time": time.ctime(),
              "params": {"greedy": args.greedy, "min_p": args.min_p, "penalty": args.penalty, "window": args.penalty_window},
              "threads": torch.get_num_threads()}
    for new_tokens in args.new_tokens:
        ar_tps = None
        for name in args.variants:
            make = VARIANTS[name]
            drafter = make and make(args.heads)
            out, stats, wall = run(model, ids, new_tokens, drafter, params, args.seed)
            tps = out.numel() / wall
            ar_tps = tps if name == "ar" else ar_tps
            tokens = out.tolist()
            partial = getattr(drafter, "cache", None)
            partial = partial if isinstance(partial, PartialKVCache) else None
            row = {
                "method": name, "prompt_tokens": ids.numel(), "new_tokens": out.numel(), "dtype": args.dtype,
                "tokens_per_s": tps, "ratio_to_ar": tps / ar_tps if ar_tps else None, "tau": stats.tau,
                "acceptance_by_depth": stats.acceptance_by_depth[:4],
                "distinct": [distinct_n(tokens, n) for n in (1, 2, 3, 4)],
                "time_split_s": {"draft": stats.draft_s, "verify": stats.verify_s, "bookkeeping": stats.bookkeeping_s,
                                 "warm_up_and_other": wall - stats.decode_s},
                "rebuilds": partial.rebuilds if partial is not None else None,
                "budget": partial.budget if partial is not None else None,
            }
            rows.append(row)
            print(row, flush=True)
            write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}\n")
    print("| new tokens | method | tok/s | × AR | τ | acceptance d1..d4 | draft s | verify s | Distinct-1 | -2 | -3 | -4 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"
        ratio = f"{r['ratio_to_ar']:.2f}x" if r["ratio_to_ar"] else "-"
        d = r["distinct"]
        split = r["time_split_s"]
        print(f"| {r['new_tokens']} | {r['method']} | {r['tokens_per_s']:.1f} | {ratio} | {r['tau']:.2f} | {acc} | "
              f"{split['draft']:.1f} | {split['verify']:.1f} | {d[0]:.3f} | {d[1]:.3f} | {d[2]:.3f} | {d[3]:.3f} |")


if __name__ == "__main__":
    main()
