"""What a round's cache bookkeeping costs the host: `begin_forward` + `commit` of the
KV caches, no model forward, for the commits a decode loop makes (AR's one token, a
chain of 9 of which 3 are kept, a tree path that moves tokens) and for a batch of AR
rows. On a GPU each tensor operation here is a kernel launch or a wait the host pays
every round, beside a ~2 ms compiled decode step
(docs/lab-notes/gpu.md#auto-on-an-h100-again-the-overlap-measured-compiled-auto-over-the-oracle-at-095096-the-chain-issue-adaptive-speculation);
on the CPU it is host time the same.

    python benchmarks/micro/cache_commit_cost.py                   # this checkout
    PYTHONPATH=/tmp/base/src python benchmarks/micro/cache_commit_cost.py   # another one, to compare

The cache shapes are a tiny Gemma 3 config's (sliding and full layers, so the ring
bookkeeping runs); the bookkeeping does not depend on the layers' sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tiny_models

from common import machine  # noqa: E402
from longspec.runtime.batch_cache import BatchKVCache  # noqa: E402
from longspec.runtime.cache import KVCache  # noqa: E402
from tiny_models import tiny_decoder  # noqa: E402

TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 2, 3, 3, 4, 6])  # kept below: root, node 2, node 4 (a move)


def single_round_us(config, forward: int, kept: torch.Tensor, rounds: int) -> float:
    cache = KVCache(config, rounds * forward + forward, max_forward_tokens=65)
    depths = torch.zeros(forward, dtype=torch.long)
    if forward == TREE_PARENTS.numel():
        for node in range(1, forward):
            depths[node] = depths[TREE_PARENTS[node]] + 1
    else:
        depths = torch.arange(forward)
    start = time.perf_counter()
    for _ in range(rounds):
        cache.begin_forward(cache.length + depths)
        cache.commit(kept)
    return 1e6 * (time.perf_counter() - start) / rounds


def batch_round_us(config, rows: int, rounds: int) -> float:
    cache = BatchKVCache(config, rounds + 2, rows, max_forward_tokens=65)
    for _ in range(rows):
        cache.acquire()
    kept = [torch.tensor([0])] * rows
    start = time.perf_counter()
    for _ in range(rounds):
        view = cache.rows()
        view.begin_forward(view.lengths.unsqueeze(1))
        view.commit(kept)
    return 1e6 * (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7, help="timed passes; the median is reported")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = tiny_decoder("gemma3").config
    cases = {
        "AR: 1 token, kept": lambda: single_round_us(config, 1, torch.tensor([0]), args.rounds),
        "chain of 9, 3 kept": lambda: single_round_us(config, 9, torch.arange(3), args.rounds),
        "tree of 9, a path that moves (0, 2, 4)": lambda: single_round_us(config, 9, torch.tensor([0, 2, 4]),
                                                                          args.rounds),
        **{f"batch of {rows} AR rows": (lambda rows=rows: batch_round_us(config, rows, args.rounds // 2))
           for rows in args.rows},
    }
    print(f"{machine()['cpu']}, torch {torch.__version__}, one thread; median of {args.repeats} passes")
    print("| begin_forward + commit | µs a round |\n|---|---|")
    for name, run in cases.items():
        run()  # warm-up
        print(f"| {name} | {statistics.median(run() for _ in range(args.repeats)):.1f} |")


if __name__ == "__main__":
    main()
