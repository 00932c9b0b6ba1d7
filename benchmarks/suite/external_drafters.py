"""The external drafters (Mamba with fixed trees and with the paper's test-time tree
search, the small transformer drafter) beside plain decoding and prompt lookup on long
prompts, greedy and sampled, in one run: decode tokens/s, τ and each configuration's
speed over AR on the same prompt and setting.

    python benchmarks/suite/external_drafters.py --tasks multi_news lcc --prompt-tokens 4096 --new-tokens 256

Drafters default to the ones shipped for Gemma 3 270M; `--mamba DIR` / `--draft-model DIR`
score a training run instead (the `auto` rows always use the shipped ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.bench.tasks import PromptFilter, TaskSpec, build_prompts
from longspec.speculation.drafters.mamba import PAPER_TREES
from longspec.training.data import load_split, served_prefix

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
# Trees a CPU can verify cheaply (a 49-token verification costs ~5x a 1-token one at 4k:
# docs/lab-notes/forward-cost.md#forward-cost-of-k-new-tokens-with-the-tiled-product-issue-runtime-speed-adaptive),
# searched like the paper's arms.
SMALL_TREES = ((1, 1, 1), (2, 1, 1), (1, 1, 1, 1, 1))


def configurations(mamba: str | None, draft_model: str | None) -> dict[str, tuple[str, dict]]:
    m = {} if mamba is None else {"model": mamba}
    d = {} if draft_model is None else {"model": draft_model}
    return {
        "ar": ("ar", {}),
        "pld": ("pld", {}),
        "draft-model": ("draft-model", {**d, "length": 4}),
        "draft-model-sampled-chain": ("draft-model", {**d, "length": 4, "sample": True}),
        "mamba-chain": ("mamba", {**m, "widths": [1, 1, 1, 1]}),
        "mamba-paper-tree": ("mamba", {**m, "widths": list(PAPER_TREES[0])}),
        "mamba-search-paper": ("mamba", {**m, "search": [list(w) for w in PAPER_TREES]}),
        "mamba-search-small": ("mamba", {**m, "search": [list(w) for w in SMALL_TREES]}),
        # auto's components are the shipped drafters (no path option).
        "auto": ("auto", {}),
        "auto-mamba": ("auto", {"components": ["pld", "ngram", "mamba"]}),
        "auto-draft-model": ("auto", {"components": ["pld", "ngram", "draft-model"]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=["multi_news", "lcc"])
    parser.add_argument("--heldout", type=Path, default=None,
                        help="also a prompt from these token shards' held-out split (text from files the shipped "
                             "drafters never trained on, in their training domain): BOS + the first tokens")
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--item", type=int, default=0, help="which prompt of each task")
    parser.add_argument("--mamba", default=None, help="Mamba drafter directory (default: the shipped one)")
    parser.add_argument("--draft-model", default=None, help="small transformer drafter directory (default: shipped)")
    parser.add_argument("--configs", nargs="+", default=None, help="run only these configurations")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/external_drafters.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = configurations(args.mamba, args.draft_model)
    names = args.configs or list(configs)
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {', '.join(configs)}")
    if "ar" not in names:
        names = ["ar", *names]  # every ratio is over AR on the same prompt and setting
    model = longspec.load()
    prompts = {}
    for task in args.tasks:
        items = TaskSpec.parse(task, args.data_dir).load()
        prompts[task] = build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,),
                                                                          limit=args.item + 1))[args.item].ids
    if args.heldout is not None:
        stream = load_split(args.heldout, "heldout")[: args.prompt_tokens - 1]
        prompts["heldout"] = torch.cat([torch.tensor(served_prefix(model.tokenizer), dtype=torch.long), stream])
    rows = []
    for task, ids in prompts.items():
        for temperature in args.temperatures:
            ar_rate = None
            for name in names:
                method, options = configs[name]
                result = model.generate(ids, max_new_tokens=args.new_tokens, method=method,
                                        method_options=options or None, temperature=temperature, seed=0,
                                        ignore_eos=True)
                s = result.stats
                ar_rate = s.decode_tokens_per_s if name == "ar" else ar_rate
                row = {"task": task, "temperature": temperature, "config": name, "method": method,
                       "options": json.dumps(options), "tokens_per_s": s.decode_tokens_per_s, "tau": s.tau,
                       "speedup_vs_ar": s.decode_tokens_per_s / ar_rate, "draft_s": s.draft_s,
                       "verify_s": s.verify_s}
                rows.append(row)
                print(f"{task} T={temperature} {name}: {s.decode_tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, "
                      f"{row['speedup_vs_ar']:.2f}x AR (draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s)",
                      flush=True)
    header = {"benchmark": "external_drafters", "machine": machine(), "item": args.item,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "mamba": args.mamba or "shipped", "draft_model": args.draft_model or "shipped", "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
