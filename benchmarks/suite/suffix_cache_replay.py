"""The suffix cache's workloads replayed without the target: `auto` with the cache
against `auto` without it over recorded greedy outputs, each round priced by a forward
cost curve, so variants of the cache's lookup and of `auto` can be compared by
counting, whatever the machine's load.

    python benchmarks/suite/suffix_cache_replay.py --record      # once: the greedy outputs (runs the target)
    python benchmarks/suite/suffix_cache_replay.py --cost-curve ~/.cache/longspec/cost-model/<file>.json

Recording runs `suffix_cache.py`'s prompts (templated, then unrelated) once, plain greedy
decoding in a batch, and keeps prompt and output ids. Replaying
feeds the requests in order: each round `auto` proposes a tree over the committed
tokens, the recorded output decides how much of it is accepted (what greedy
verification accepts), and the round costs the curve's forward of that tree's tokens
plus `ROUND_OVERHEAD_S`; after each request, its prompt and output go into the cache
(as `LongSpecModel` inserts a finished request). `auto` times its rounds by a clock
that runs these modeled forwards, so it sees the costs a run would show it. A model of
a run, built from a measured curve: the wall-clock check is `suffix_cache.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # suffix_cache.py's workloads, adaptive_replay's clock

from adaptive_replay import ROUND_OVERHEAD_S
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.suffix_cache import SuffixCache
from longspec.speculation.joint_budget import walk_down
from longspec.speculation.presets.auto import make_auto

RECORDED = Path("bench-out/suffix_replay/outputs.json")
# What `auto`'s own work costs a round with proposals (lookups, merge, ranking), fixed so
# that a replay counts the same on a loaded machine: measured 0.3-0.6 ms on the 2-core EPYC.
DRAFTING_S = 0.5e-3


class CountingClock:
    """Modeled time only: the forwards and `DRAFTING_S` per round, never the wall clock
    (which other processes on the machine would move)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def record(path: Path, requests: int, unrelated_count: int, new_tokens: int) -> None:
    import longspec
    from suffix_cache import templated, unrelated
    model = longspec.load(None)
    model.suffix_cache = None
    rows = []
    for workload, prompts in (("templated", templated(requests)), ("unrelated", unrelated(unrelated_count))):
        # Batched (a row's tokens are its single run's), plain decoding, no cache.
        results = model.generate_batch(prompts, method="ar", max_new_tokens=new_tokens, ignore_eos=True, max_rows=16)
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            rows.append({"workload": workload, "i": i, "prompt": model.encode(prompt).tolist(),
                         "output": result.token_ids})
        print(workload, len(prompts), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


def replay_request(drafter, prompt: list[int], output: list[int], cost: ForwardCost, counts: Counter) -> float:
    """Modeled seconds of one request; `counts` gains its rounds, rows and accepted tokens."""
    tokens = torch.tensor(prompt + output)
    committed = len(prompt)
    clock = CountingClock()
    drafter.forward_cost, drafter.clock = cost, clock
    drafter.begin(DraftContext(tokens=tokens[:committed]))
    seconds = 0.0
    while committed < tokens.numel():
        context = DraftContext(tokens=tokens[:committed])
        tree = drafter.propose(context)
        accepted, _ = walk_down(tree, 0, tokens[committed:].tolist())
        step = tokens[committed : committed + accepted + 1]
        spent = cost.seconds_for(tree.size) + ROUND_OVERHEAD_S + DRAFTING_S
        clock.advance(spent)
        if committed + step.numel() < tokens.numel():  # the engine does not observe the last round
            drafter.observe(step)
        seconds += spent
        counts["rounds"] += 1
        counts["rows"] += tree.size
        counts["accepted"] += accepted
        counts["speculating_rounds"] += tree.size > 1
        committed += step.numel()
    telemetry = drafter.telemetry() or {}
    for name, credited in telemetry.get("credited_tokens", {}).items():
        counts[f"credited_{name}"] += credited
    return seconds


def replay(rows: list[dict], make: Callable[[SuffixCache | None], object], cost: ForwardCost,
           cache: SuffixCache) -> dict:
    """Each workload's requests in order, with the cache (fed as they finish) and without."""
    report = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        arms = {}
        for arm in ("on", "off"):
            counts, seconds = Counter(), 0.0
            for row in mine:
                drafter = make(cache if arm == "on" else None)
                seconds += replay_request(drafter, row["prompt"], row["output"], cost, counts)
                if arm == "on":
                    cache.insert(row["prompt"], row["output"])
            tokens = sum(len(r["output"]) for r in mine)
            arms[arm] = {"tokens_per_s": tokens / seconds, **counts}
        report[workload] = {"ratio": arms["on"]["tokens_per_s"] / arms["off"]["tokens_per_s"], **arms}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--recorded", type=Path, default=RECORDED)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--unrelated", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cost-curve", type=Path, help="a cached forward-cost JSON to price rounds with")
    parser.add_argument("--cache-mb", type=float, default=64)
    args = parser.parse_args()
    if args.record:
        record(args.recorded, args.requests, args.unrelated, args.new_tokens)
        return
    data = json.loads(args.cost_curve.read_text())
    cost = ForwardCost(data["key"], tuple(data["ks"]), tuple(data["seconds"]))
    rows = json.loads(args.recorded.read_text())
    report = replay(rows, lambda cache: make_auto(suffix_cache=cache), cost, SuffixCache.of_megabytes(args.cache_mb))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
