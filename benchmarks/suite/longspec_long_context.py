"""Does the LongSpec draft hold up at long context? Draft-alone τ and decode speed at
two context lengths on the same documents, continuing from the same point.

    python benchmarks/suite/longspec_long_context.py --draft RUN/draft.safetensors --contexts 4096 16384 --threads 1

Documents: the longest LongBench LCC rows (code; not in the training corpus). For
each, the prompt is BOS plus the `context` tokens that end where the longest context
ends, so every context length continues the same text and only the amount of earlier
text differs. Greedy and sampled (temperature 1, top-p 0.95) runs of the LongSpec
chain against our AR in the same run.
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
from longspec.speculation.presets.longspec import make_longspec

LCC = Path(__file__).resolve().parents[3] / "shared" / "data" / "longbench" / "lcc.jsonl"
SETTINGS = {"greedy": {}, "sampled": {"temperature": 1.0, "top_p": 0.95, "seed": 0}}


def long_documents(tokenizer, tokens: int, count: int) -> list[tuple[str, list[int]]]:
    rows = [json.loads(line)["context"] for line in LCC.read_text().splitlines()]
    found = []
    for number in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        ids = tokenizer(rows[number], add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            found.append((f"lcc row {number}", ids[:tokens]))
        if len(found) == count:
            return found
    raise SystemExit(f"only {len(found)} LCC rows have {tokens} tokens; lower --contexts or --documents")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--strategy", default="chain", help="LongSpec strategy: chain, cape or beam")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/longspec_long_context.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(dtype=args.dtype)
    bos = model.tokenizer("", add_special_tokens=True).input_ids
    longest = max(args.contexts)
    rows = []
    for name, ids in long_documents(model.tokenizer, longest - len(bos), args.documents):
        for context in sorted(args.contexts):
            prompt = bos + ids[len(ids) - (context - len(bos)):]
            for setting, sampling in SETTINGS.items():
                ar = model.generate(prompt, max_new_tokens=args.new_tokens, method="ar", ignore_eos=True, **sampling).stats
                drafter = make_longspec(strategy=args.strategy, checkpoint=args.draft)
                draft = model.generate(prompt, max_new_tokens=args.new_tokens, method=drafter, ignore_eos=True, **sampling).stats
                row = {"document": name, "context": context, "setting": setting, "tau": draft.tau,
                       "draft_tok_s": draft.decode_tokens_per_s, "ar_tok_s": ar.decode_tokens_per_s,
                       "speedup": draft.decode_tokens_per_s / ar.decode_tokens_per_s,
                       "acceptance_by_depth": draft.acceptance_by_depth}
                rows.append(row)
                print(f"{name} | {context:6d} | {setting:7s} | tau {row['tau']:.2f} | {row['draft_tok_s']:.1f} tok/s "
                      f"vs AR {row['ar_tok_s']:.1f} ({row['speedup']:.2f}x)", flush=True)
    for setting in SETTINGS:
        taus = {c: [r["tau"] for r in rows if r["setting"] == setting and r["context"] == c] for c in args.contexts}
        means = {c: sum(t) / len(t) for c, t in taus.items()}
        low, high = min(args.contexts), max(args.contexts)
        print(f"{setting}: mean tau {means[low]:.2f} at {low}, {means[high]:.2f} at {high} "
              f"({means[high] / means[low]:.2f}x)")
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}, rows)


if __name__ == "__main__":
    main()
