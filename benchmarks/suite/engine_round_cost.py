"""What a decoding round with k speculative nodes costs inside the engine, against
the cached forward-cost measurement `auto` prices its trees with.

    python benchmarks/suite/engine_round_cost.py --book ../shared/data/books/austen-emma.txt --context 4096

A drafter proposes a chain of k tokens that the target almost never accepts in every
other round and nothing in the rounds between, so rounds with and without nodes
alternate under the same conditions (a neighbour taking memory bandwidth slows both
alike). Each round is timed from the engine's yield to the next (propose, forward,
verification with its draws, commit); the table gives the median round of each size
against the median plain round beside it, greedy and sampled, and the cost model's
ratio for the same k (`forward_cost_at`: isolated forwards, best of five).
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
from longspec.speculation.cost_model import forward_cost_at
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.processors import SamplingParams
from longspec.speculation.tree import Tree


class EveryOtherRound(Drafter):
    """k tokens no text continues with (the root's id shifted) every other round, the
    root alone between; logs the size of each round's tree."""

    def __init__(self, nodes: int, vocab: int) -> None:
        self.nodes, self.vocab = nodes, vocab
        self.sizes: list[int] = []

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        count = self.nodes if len(self.sizes) % 2 == 0 else 0
        self.sizes.append(count + 1)
        return Tree.chain(context.root, [(context.root * 7919 + 1 + i) % self.vocab for i in range(count)])

    def observe(self, committed: torch.Tensor) -> None:
        pass


def round_seconds(model, ids: torch.Tensor, drafter: EveryOtherRound, params: SamplingParams,
                  new_tokens: int) -> list[tuple[int, float]]:
    """(tree size, seconds) of each round after the first."""
    generator = torch.Generator().manual_seed(0)
    times = []
    last = None
    for _ in model.engine.generate(ids, params=params, max_new_tokens=new_tokens, drafter=drafter, generator=generator):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return list(zip(drafter.sizes[1 : len(times) + 1], times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", type=Path, required=True, help="a plain-text file; the prompt is its opening")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3, 5, 11])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/engine_round_cost.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = longspec.load()
    ids = prompt_ids(loaded.tokenizer, args.book.read_text(), args.context)
    settings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05)}
    cost = forward_cost_at(loaded.model, ids.numel())
    round_seconds(loaded, ids, EveryOtherRound(1, loaded.config.vocab_size), settings["greedy"], 8)  # warm-up
    rows = []
    print("| setting | k nodes | round with k (ms) | plain round beside it (ms) | ratio | cost model's ratio |\n"
          "|---|---|---|---|---|---|")
    for name, params in settings.items():
        for nodes in args.nodes:
            with_nodes, plain = [], []
            for _ in range(args.repeats):
                drafter = EveryOtherRound(nodes, loaded.config.vocab_size)
                for size, seconds in round_seconds(loaded, ids, drafter, params, args.new_tokens):
                    (plain if size == 1 else with_nodes).append(seconds)
            k_s, plain_s = statistics.median(with_nodes), statistics.median(plain)
            modeled = cost.seconds_for(nodes + 1) / cost.seconds_for(1)
            rows.append({"setting": name, "nodes": nodes, "round_ms": 1000 * k_s, "plain_round_ms": 1000 * plain_s,
                         "ratio": k_s / plain_s, "cost_model_ratio": modeled, "rounds": len(with_nodes)})
            print(f"| {name} | {nodes} | {1000 * k_s:.1f} | {1000 * plain_s:.1f} | {k_s / plain_s:.3f} | {modeled:.3f} |",
                  flush=True)
    header = {"benchmark": "engine_round_cost", "machine": machine(), "context": ids.numel(), "book": args.book.name,
              "threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "cost_model_ms": [round(1000 * s, 2) for s in cost.seconds], "cost_model_ks": list(cost.ks),
              "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
