"""Sampled plain decoding with and without the certified sampler's narrower margin for rows
whose candidates overflow the cap (`certified_sampling.NARROW_MARGIN`; without it such a
row takes the full head), in turns in one process, per book and seed.

    python benchmarks/ab/narrow_margin_ab.py --books ../shared/data/books/chesterton-thursday.txt \
        ../shared/data/books/austen-emma.txt --seeds 0 1 2 --repeats 2

Prints ms per decoded token, the rows that took the full head and the rows drawn through
the narrower margin, per run, and the mean per side; writes JSON lines to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, prompt_ids, write_results
from longspec.speculation import certified_sampling
from longspec.speculation.processors import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--books", type=Path, nargs="+", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/narrow_margin_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = longspec.load()
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05)
    prompts = {book.stem: prompt_ids(loaded.tokenizer, book.read_text(), args.context) for book in args.books}
    head = loaded.model.certified_head
    narrow = certified_sampling.NARROW_MARGIN
    list(loaded.engine.generate(next(iter(prompts.values())), params=params, max_new_tokens=4))  # warm-up
    rows = []
    for repeat in range(args.repeats):
        for book, ids in prompts.items():
            for seed in args.seeds:
                sides = ("narrow", "full head") if (repeat + seed) % 2 else ("full head", "narrow")
                for side in sides:
                    certified_sampling.NARROW_MARGIN = narrow if side == "narrow" else float("inf")
                    head.stats = type(head.stats)()
                    tokens = loaded.engine.generate(ids, params=params, max_new_tokens=args.new_tokens,
                                                    generator=torch.Generator().manual_seed(seed))
                    next(tokens)  # the first token comes from prefill
                    start = time.perf_counter()
                    decoded = sum(t.numel() for t in tokens)
                    ms = 1e3 * (time.perf_counter() - start) / decoded
                    rows.append({"book": book, "seed": seed, "repeat": repeat, "side": side, "ms_per_token": ms,
                                 "fallbacks": head.stats.fallbacks, "narrowed": head.stats.narrowed})
                    print(f"{book} seed {seed} {side}: {ms:.2f} ms/token, full head {head.stats.fallbacks}, "
                          f"narrowed {head.stats.narrowed}", flush=True)
    certified_sampling.NARROW_MARGIN = narrow
    for side in ("full head", "narrow"):
        print(f"{side}: mean {statistics.mean(r['ms_per_token'] for r in rows if r['side'] == side):.2f} ms/token")
    header = {"benchmark": "narrow_margin_ab", "machine": machine(), "context": args.context,
              "new_tokens": args.new_tokens, "threads": args.threads, "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
