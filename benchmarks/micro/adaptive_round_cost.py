"""`auto`'s own work per round, on this machine's host CPU: what a round costs besides
the target's forward, for plain decoding, prompt lookup, `auto` over prompt lookup, a
fixed oracle chain and `auto` over that oracle and over garbage (`gpu_check.py`'s pairs), timed as the engine
runs them (the drafter's propose, the engine's check of its tree, observe and the
controller's telemetry) over the same token stream, and the modeled speed of each
(tokens over the modeled forwards plus the host's time).

    python benchmarks/micro/adaptive_round_cost.py                      # Python source, 2 ms forwards
    python benchmarks/micro/adaptive_round_cost.py --forward-ms 30 --per-token-ms 0.5   # a CPU's forwards

No model and no data files: the stream is Python's standard library split into words
(each distinct word one token id), and verification accepts what the stream continues
with (greedy decoding of a target that writes that text). The forwards are modeled:
`auto` prices its trees with the given cost and times its rounds by a clock that runs
those forwards, so it decides as it would on a machine with that cost; only the host
work is timed. A compiled GPU step costs ~2 ms for a 270M target, where `auto`'s own
~0.9 ms a round cost 18-29% of its speed
(docs/lab-notes/gpu.md#on-an-h100-what-a-short-decode-step-asks-of-the-controller): run this
on the GPU machine's host to see its share there without a GPU. The methods "learning
during forwards" let `auto` learn while each forward runs, as the engines have it on a
GPU (`EngineOptions.learn_while_verifying`): its learning is then free up to the
forward's time, a model of that overlap, to be confirmed on a GPU (`gpu_check.py`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "suite"))  # adaptive_replay.py

from adaptive_replay import ModeledClock
from common import GarbageDrafter, machine, stdlib_source_text, write_results
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters.adaptive.drafter import AdaptiveDrafter
from longspec.speculation.presets.auto import make_auto
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.speculation.decode_round import checked_proposal
from longspec.speculation.joint_budget import walk_down
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.tree import Tree

MAX_NODES = 64  # the engine's default tree budget


def word_stream(tokens: int, skip: int) -> tuple[list[int], int]:
    """`tokens` ids of Python source split into words, spaces and punctuation, and the vocabulary size."""
    text = stdlib_source_text(12 * tokens, skip=skip)
    vocabulary: dict[str, int] = {}
    ids = [vocabulary.setdefault(word, len(vocabulary)) for word in re.findall(r"\w+|[^\w\s]|\s+", text)]
    if len(ids) < tokens:
        raise ValueError(f"the corpus gave {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens], len(vocabulary)


class OracleChain(Drafter):
    """The stream's next `length` tokens every round (as `gpu_check.py`'s oracle): all accepted."""

    def __init__(self, stream: list[int], length: int = 8) -> None:
        self.stream, self.length = stream, length

    def begin(self, context: DraftContext) -> None:
        pass

    def observe(self, committed: torch.Tensor) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        done = context.tokens.numel()
        return Tree.chain(context.root, self.stream[done : done + min(self.length, context.max_nodes)])


def linear_cost(forward_s: float, per_token_s: float) -> ForwardCost:
    ks = (1, 2, 4, 8, 16, 32, 64, 128)
    return ForwardCost({"modeled": True}, ks, tuple(forward_s + per_token_s * (k - 1) for k in ks))


def replay(stream: list[int], prompt: int, vocab: int, drafter, cost: ForwardCost, overlap: bool = False) -> dict:
    """Host seconds per round (`kind` -> list), rounds and tokens per round. With
    `overlap`, the drafter's `learn` runs during each modeled forward, as the engine
    calls it on a GPU, and its time is hidden up to the forward's."""
    tokens = torch.tensor(stream)
    clock = ModeledClock()
    if drafter is not None and hasattr(drafter, "forward_cost"):
        drafter.forward_cost, drafter.clock = cost, clock
    committed = prompt
    learning = {"learns_while_verifying": True} if overlap else {}  # code before `learn` runs without it
    if drafter is not None:
        drafter.begin(DraftContext(tokens=tokens[:committed], max_nodes=MAX_NODES, **learning))
    stats, kinds = GenerationStats(), {"with nodes": [], "root only": []}
    forwards = 0.0
    plain_rounds = drafter.plain_rounds if drafter is not None else None
    plain_left, plain_start = 0, committed  # rounds left to plain decoding, as the engine runs them
    while committed < tokens.numel():
        context = DraftContext(tokens=tokens[:committed], max_nodes=MAX_NODES, **learning)
        start = time.perf_counter()
        if plain_rounds is not None and not plain_left:
            plain_left, plain_start = plain_rounds(), committed
        if drafter is None or plain_left:
            tree = Tree.chain(int(tokens[committed - 1]), [])
        else:
            tree = checked_proposal(drafter, context, vocab)
        spent = time.perf_counter() - start
        accepted, _ = walk_down(tree, 0, tokens[committed:].tolist())  # what greedy verification accepts
        step = tokens[committed : committed + accepted + 1]
        forward = cost.seconds_for(tree.size)
        clock.advance(forward)  # the forward `auto` times its round by
        forwards += forward
        if overlap:
            start = time.perf_counter()
            drafter.learn()
            spent += max(0.0, time.perf_counter() - start - forward)  # beyond the forward, the host is late
        start = time.perf_counter()
        if plain_left:
            plain_left -= 1
            if not plain_left:  # the last of them: the drafter is told of them all at once
                drafter.observe(tokens[plain_start : committed + step.numel()])
                stats.controller = drafter.telemetry()
        elif drafter is not None:
            drafter.observe(step)
            stats.controller = drafter.telemetry()
        spent += time.perf_counter() - start
        kinds["with nodes" if tree.size > 1 else "root only"].append(spent)
        committed += step.numel()
    rounds = sum(len(v) for v in kinds.values())
    host = sum(sum(v) for v in kinds.values())
    return {"kinds": kinds, "rounds": rounds, "tokens_per_round": (tokens.numel() - prompt) / rounds,
            "tokens_per_s": (tokens.numel() - prompt) / (forwards + host), "controller": stats.controller}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=4, help="token streams (from successive stdlib files)")
    parser.add_argument("--forward-ms", type=float, default=2.0, help="modeled forward of one token")
    parser.add_argument("--per-token-ms", type=float, default=0.02, help="modeled cost of each further token")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="also run auto learning during the forwards (--no-overlap: code without `learn`)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/adaptive_round_cost.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cost = linear_cost(args.forward_ms / 1e3, args.per_token_ms / 1e3)

    def over_oracle(stream: list[int]) -> AdaptiveDrafter:
        return AdaptiveDrafter([("oracle", OracleChain(stream))])

    def over_garbage(stream: list[int]) -> AdaptiveDrafter:
        return AdaptiveDrafter([("garbage", GarbageDrafter(max(stream) + 1))])

    # name -> (drafter from the stream, whether it learns during the forwards)
    methods = {"ar": (lambda stream: None, False), "pld": (lambda stream: PromptLookupDrafter(), False),
               "auto": (lambda stream: make_auto(), False),
               "auto, learning during forwards": (lambda stream: make_auto(), True),
               "oracle chain": (OracleChain, False), "auto over the oracle": (over_oracle, False),
               "auto over the oracle, learning during forwards": (over_oracle, True),
               "auto over garbage": (over_garbage, False),
               "auto over garbage, learning during forwards": (over_garbage, True)}
    if not args.overlap:
        methods = {name: method for name, method in methods.items() if not method[1]}
    rows = []
    for index in range(args.streams):
        stream, vocab = word_stream(args.prompt_tokens + args.new_tokens, skip=40 * index)
        for name, (make, overlap) in methods.items():
            result = replay(stream, args.prompt_tokens, vocab, make(stream), cost, overlap)
            row = {"stream": index, "method": name, "rounds": result["rounds"],
                   "tokens_per_round": round(result["tokens_per_round"], 3),
                   "modeled_tokens_per_s": round(result["tokens_per_s"], 1)}
            for kind, seconds in result["kinds"].items():
                row[f"{kind} rounds"] = len(seconds)
                row[f"{kind} median us"] = round(1e6 * statistics.median(seconds), 1) if seconds else None
            row["mean us"] = round(1e6 * sum(sum(s) for s in result["kinds"].values()) / result["rounds"], 1)
            if result["controller"]:
                row["rounds without proposals"] = result["controller"]["rounds_without_proposals"]
            rows.append(row)
            print(row, flush=True)
    print(f"\n| method | mean µs a round | × a {args.forward_ms:g} ms forward | median with nodes | median root only "
          "| tokens a round | modeled tok/s × AR (geometric mean) |\n|---|---|---|---|---|---|---|")
    ar = {r["stream"]: r["modeled_tokens_per_s"] for r in rows if r["method"] == "ar"}
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        mean = statistics.fmean(r["mean us"] for r in mine)
        speed = statistics.geometric_mean(r["modeled_tokens_per_s"] / ar[r["stream"]] for r in mine)
        per_round = statistics.fmean(r["tokens_per_round"] for r in mine)
        with_nodes = [r["with nodes median us"] for r in mine if r["with nodes median us"] is not None]
        root = [r["root only median us"] for r in mine if r["root only median us"] is not None]
        print(f"| {name} | {mean:.0f} | {mean / (1e3 * args.forward_ms):.3f} | "
              f"{statistics.median(with_nodes) if with_nodes else float('nan'):.0f} | "
              f"{statistics.median(root) if root else float('nan'):.0f} | {per_round:.2f} | {speed:.3f} |")
    header = {"benchmark": "adaptive_round_cost", "machine": machine(), "forward_ms": args.forward_ms,
              "per_token_ms": args.per_token_ms, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
