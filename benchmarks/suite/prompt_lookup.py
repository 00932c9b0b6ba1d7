"""Prompt lookup on long prompts: our PLD vs our AR vs `transformers` generate and
generate(prompt_lookup_num_tokens=...), greedy, in one run.

Tasks: `code` continues a long Python file (lookup helps); `prose` continues a
novel (lookup rarely helps: the method must fall back to AR speed).

    python benchmarks/suite/prompt_lookup.py --context 4096 --new-tokens 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import code_file_prompt, hf_generate, machine, transformers_peer, write_results
from longspec.api import parse_dtype
from longspec.speculation.drafters import PromptLookupDrafter
from longspec.speculation.metrics import GenerationStats

BOOK = Path(__file__).resolve().parents[3] / "shared" / "data" / "books" / "austen-emma.txt"


def prose_prompt(tokenizer, tokens: int) -> torch.Tensor:
    if BOOK.is_file():
        text = BOOK.read_text(errors="replace")
    else:  # any machine: Python's documentation prose
        from common import prose_text

        text = prose_text(40 * tokens)
    ids = tokenizer(text).input_ids
    return torch.tensor(ids[2000 : 2000 + tokens])  # skip the front matter


def ours(model, ids, new_tokens, drafter):
    stats = GenerationStats()
    out = torch.cat(list(model.engine.generate(ids, max_new_tokens=new_tokens, drafter=drafter, stats=stats)))
    return out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="draft tokens per lookup (both libraries)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/prompt_lookup.jsonl"))
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    model = longspec.load(args.model, dtype=dtype)
    peer = transformers_peer(model.target.source, dtype)
    tasks = {
        "code": code_file_prompt(model.tokenizer, args.context, file_name="argparse.py"),
        "prose": prose_prompt(model.tokenizer, args.context),
    }
    warm = tasks["code"][:64]
    ours(model, warm, 8, None)
    hf_generate(peer, warm, 8)
    rows = []
    for task, ids in tasks.items():
        ar_tokens, ar = ours(model, ids, args.new_tokens, None)
        pld_tokens, pld = ours(model, ids, args.new_tokens, PromptLookupDrafter(num_tokens=args.lookup_tokens))
        _, hf_prefill = hf_generate(peer, ids, 1)
        hf_tokens, hf_s = hf_generate(peer, ids, args.new_tokens)
        hf_pld_tokens, hf_pld_s = hf_generate(peer, ids, args.new_tokens, prompt_lookup_num_tokens=args.lookup_tokens)
        # Decode rates: new tokens over time after prefill (transformers: total minus a 1-token generate).
        row = {
            "task": task,
            "context": ids.numel(),
            "new_tokens": args.new_tokens,
            "dtype": args.dtype,
            "ours_ar_tps": ar.decode_tokens_per_s,
            "ours_pld_tps": pld.decode_tokens_per_s,
            "ours_pld_tau": pld.tau,
            "ours_pld_acceptance": pld.acceptance_by_depth[:10],
            "hf_tps": args.new_tokens / (hf_s - hf_prefill),
            "hf_pld_tps": args.new_tokens / (hf_pld_s - hf_prefill),
            "pld_equals_ar": bool(torch.equal(pld_tokens, ar_tokens)),
            "ar_equals_hf": bool(torch.equal(ar_tokens, hf_tokens)),
            "hf_pld_equals_hf": bool(torch.equal(hf_pld_tokens, hf_tokens)),
            "pld_time_split_s": {"draft": pld.draft_s, "verify": pld.verify_s, "bookkeeping": pld.bookkeeping_s},
        }
        rows.append(row)
        print(row, flush=True)
    header = {"benchmark": "prompt_lookup", "machine": machine(), "model": model.target.source, "time": time.ctime()}
    write_results(args.out, header, rows)
    print(f"\nmachine: {header['machine']}\n")
    print("| task | context | ours PLD tok/s | τ | ours AR | transformers | transformers PLD | PLD / tf PLD | PLD / our AR "
          "| PLD / tf generate | PLD == AR | tf PLD == tf |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['context']} | {r['ours_pld_tps']:.1f} | {r['ours_pld_tau']:.2f} | {r['ours_ar_tps']:.1f} | "
            f"{r['hf_tps']:.1f} | {r['hf_pld_tps']:.1f} | {r['ours_pld_tps'] / r['hf_pld_tps']:.2f}x | "
            f"{r['ours_pld_tps'] / r['ours_ar_tps']:.2f}x | {r['ours_pld_tps'] / r['hf_tps']:.2f}x | "
            f"{'yes' if r['pld_equals_ar'] else 'no'} | {'yes' if r['hf_pld_equals_hf'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
