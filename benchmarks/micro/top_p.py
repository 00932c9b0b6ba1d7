"""Cost of the top-p processor on Gemma 3 270M's real next-token logits: ours (a
growing top-k candidate set) against a full-vocabulary sort (what TopPLogitsWarper
does), in one run; also how large the nucleus is and where the two kept sets differ.
Then the cost of drawing the token from the processed distribution: `torch.multinomial`
against our inverse-CDF `sample`.

    python benchmarks/micro/top_p.py --positions 256 --threads 1
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
from common import machine
from longspec.speculation.processors import SamplingParams, processed_logits, processed_probs, sample

MULTI_NEWS = Path(__file__).resolve().parents[3] / "shared" / "data" / "longbench" / "multi_news.jsonl"


def full_sort_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The baseline: sort the whole vocabulary, as TopPLogitsWarper does."""
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    return scores.masked_fill(remove_sorted.scatter(1, sorted_idx, remove_sorted), float("-inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=256, help="next-token distributions to process")
    parser.add_argument("--top-p", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = longspec.load()
    text = json.loads(MULTI_NEWS.read_text().splitlines()[3])["context"]
    ids = torch.tensor(model.tokenizer(text).input_ids[: args.positions])
    decoder = model.target.model
    logits = decoder(ids.unsqueeze(0), decoder.new_cache(ids.numel(), max_forward_tokens=ids.numel())).logits[0].float()
    print(f"machine: {machine()}; {logits.shape[0]} positions of a Multi-News document, vocabulary {logits.shape[1]}")
    print("| top-p | full sort ms/row | ours ms/row | speedup | nucleus median / p90 / max | rows whose kept sets differ | of which only by tokens tied at the cut |")
    print("|---|---|---|---|---|---|---|")
    for top_p in args.top_p:
        params = SamplingParams(temperature=1.0, top_p=top_p)
        t_full = t_ours = 0.0
        sizes, differ, ties_only = [], 0, 0
        for row in logits.split(1):
            start = time.perf_counter()
            reference = full_sort_top_p(row, top_p)
            t_full += time.perf_counter() - start
            start = time.perf_counter()
            ours = processed_logits(row, None, params)
            t_ours += time.perf_counter() - start
            kept_ref, kept = torch.isfinite(reference), torch.isfinite(ours)
            sizes.append(int(kept.sum()))
            if not torch.equal(kept_ref, kept):
                differ += 1
                changed = row[kept_ref != kept]
                ties_only += bool((changed == row[kept].min()).all())
        sizes.sort()
        n = len(sizes)
        print(f"| {top_p} | {1e3 * t_full / n:.2f} | {1e3 * t_ours / n:.2f} | {t_full / t_ours:.1f}x | "
              f"{sizes[n // 2]} / {sizes[int(0.9 * n)]} / {sizes[-1]} | {differ} | {ties_only} |")
    print("\n| top-p | torch.multinomial ms/draw | inverse-CDF sample ms/draw | speedup |")
    print("|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for top_p in args.top_p:
        probs = processed_probs(logits, None, SamplingParams(temperature=1.0, top_p=top_p, min_p=0.05))
        t_multinomial = t_sample = 0.0
        for row in probs.split(1):
            start = time.perf_counter()
            torch.multinomial(row, 1, generator=generator)
            t_multinomial += time.perf_counter() - start
            start = time.perf_counter()
            sample(row, generator)
            t_sample += time.perf_counter() - start
        n = probs.shape[0]
        print(f"| {top_p} | {1e3 * t_multinomial / n:.2f} | {1e3 * t_sample / n:.2f} | {t_multinomial / t_sample:.1f}x |")


if __name__ == "__main__":
    main()
