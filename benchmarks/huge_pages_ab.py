"""Huge pages A/B inside one process: AR `generate` on a 4k-token Multi-News prompt
(128 new tokens), the same weights moved between ordinary and huge pages each round,
so both sides of a round see the same machine state.

    python benchmarks/huge_pages_ab.py --data-dir ../shared/data --rounds 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import longspec
from longspec.runtime.huge_pages import HUGE_PAGE_BYTES, move_to_huge_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = longspec.load()
    row = json.loads((args.data_dir / "longbench" / "multi_news.jsonl").read_text().splitlines()[0])
    ids = model.tokenizer(row.get("context") or row.get("input"))["input_ids"][: args.prompt_tokens]
    large = [p for p in model.model.parameters() if p.numel() * p.element_size() >= HUGE_PAGE_BYTES]

    def rate() -> float:
        return model.generate(ids, max_new_tokens=args.new_tokens, method="ar", ignore_eos=True).stats.decode_tokens_per_s

    rate()  # warm-up
    for _ in range(args.rounds):
        huge = rate()
        for p in large:
            p.data = p.data.clone()  # ordinary pages
        ordinary = rate()
        move_to_huge_pages(large)
        print(f"AR {len(ids)} tokens: huge pages {huge:.1f} tok/s, ordinary {ordinary:.1f}, huge/ordinary {huge / ordinary:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
