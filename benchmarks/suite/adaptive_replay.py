"""`auto`'s controller against fixed prompt lookup on recorded continuations: the same
tokens for every variant, so the comparison is free of the sampling lottery and of
bf16 near-ties that make the methods' own runs diverge.

    python benchmarks/suite/adaptive_replay.py --record      # once: continuations to bench-out/replay/
    python benchmarks/suite/adaptive_replay.py               # replay every variant over them
    python benchmarks/suite/adaptive_replay.py --from-bench bench-out/full/results.jsonl  # a bench run's outputs
    python benchmarks/suite/adaptive_replay.py --measure-machine-now ...  # the machine changed since its cost was cached
    python benchmarks/suite/adaptive_replay.py --draw-cost ...  # sampled tokens' draws charged as the engine pays them
    python benchmarks/suite/adaptive_replay.py --engine-round-cost RESULTS ...  # rounds priced as `engine_round_cost.py` measured them

Recording runs the target (prompt lookup, greedy and sampled) on Multi-News and LCC
prompts and keeps prompt and output ids. Replaying needs no target: each round, a
variant's drafter proposes a tree over the committed tokens, the recorded continuation
decides how much of it is accepted (greedy: exactly what verification accepts; sampled:
the verification rule for deterministic candidates accepts the path the sample takes),
and the round costs the measured forward of that many tokens (`cost_model`, this
machine, the sequence's context bucket) plus the drafter's own measured time (propose
and observe) plus a fixed engine overhead per round. Tokens per second are therefore a
model of a run, built from measured parts, not a wall-clock run; `longspec bench`
gives those. `auto` times its rounds by a clock that runs these modeled forwards too, so
it sees the costs a real run would show it. With `--measure-machine-now` the rounds cost
forwards measured at the start of the replay while `auto` is given the cached
measurement, as in a run on a machine that changed since (another tenant taking
memory bandwidth), which the cost fits of `adaptive_cost_fits.py` were tried for. With
`--engine-round-cost` the rounds cost what a round of that size cost inside the engine
(`engine_round_cost.py`: the first node dearer than isolated forwards say), again while
`auto` prices its trees with the cached measurement.

Each `auto` variant also reports its calibration: predicted / realised accepted tokens
per round, summed over the rows of each setting and task (the adaptive issue's goal:
within 10%). `--from-bench` replays the outputs a `longspec bench` run recorded (its
AR rows by default; prompts rebuilt from the run's task files), so the calibration of a
wall-clock run can be studied, and changed, without the target.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from adaptive_cost_fits import NodesOnlyCostFit, ThreeTermCostFit
from common import machine, write_results
from longspec.bench.tasks import PromptFilter, TaskSpec, build_prompts
from longspec.speculation.cost_model import DEFAULT_KS, ForwardCost, forward_cost_at, measure_forward_cost
from longspec.speculation.drafters.adaptive.acceptance import AcceptanceTable, CrossFittedAcceptance
from longspec.speculation.presets.auto import make_auto
from longspec.speculation.drafters.base import DraftContext, Drafter
from longspec.speculation.drafters.prompt_lookup import PromptLookupDrafter
from longspec.speculation.joint_budget import walk_down
from longspec.speculation.processors import SamplingParams, processed_probs, sample
from longspec.speculation.tree import Tree

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
RECORDED = Path("bench-out/replay/continuations.jsonl")
ROUND_OVERHEAD_S = 1e-3  # engine work per round outside the forward and the drafter (measured 0.5-1.5 ms)


class WithoutCopiedRuns(Drafter):
    """A drafter whose trees do not carry `copied_runs`: `auto` then ranks its nodes by
    depth alone (the controller before copied runs)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def begin(self, context: DraftContext) -> None:
        self.drafter.begin(context)

    def observe(self, committed: torch.Tensor) -> None:
        self.drafter.observe(committed)

    def propose(self, context: DraftContext) -> Tree:
        tree = self.drafter.propose(context)
        return Tree.assembled(tree.tokens, tree.parents, tree.depths)


class PlainDecoding(Drafter):
    """Plain decoding as a drafter: the root alone every round (the baseline `auto`
    must not fall below)."""

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, context: DraftContext) -> Tree:
        return Tree.chain(context.root, [])

    def observe(self, committed: torch.Tensor) -> None:
        pass


def auto_over(components: str, *, depth_only: bool = False) -> Callable[[], object]:
    def make():
        drafter = make_auto(components=components)
        if depth_only:
            for component in drafter.components:
                component.drafter = WithoutCopiedRuns(component.drafter)
        return drafter
    return make


def set_in_tables(drafter, **constants) -> None:
    """Set acceptance-table constants in `auto`'s cross-fitted table (both halves)."""
    for name, value in constants.items():
        setattr(drafter.table.table, name, value)


def auto_with_cost(cost_fit_type) -> Callable[[], object]:
    """auto over pld whose measured forward cost is corrected by `cost_fit_type`."""
    def make():
        drafter = make_auto(components="pld")
        drafter.cost_fit_type = cost_fit_type
        return drafter
    return make


def auto_one_timescale() -> object:
    """auto over pld whose acceptance table weighs every round alike (before the
    recent counts): its recent counts are emptied at the end of each round."""
    drafter = make_auto(components="pld")
    set_in_tables(drafter, RETAINED=0.0)
    return drafter


def auto_pooled_first_token() -> object:
    """auto over pld whose acceptance table counts depth-1 nodes and nodes continuing
    a speculative parent in the same cells (before the split)."""
    drafter = make_auto(components="pld")
    set_in_tables(drafter, SEPARATE_FIRST_TOKEN=False)
    return drafter


def auto_before_continued_copies() -> object:
    """auto as it was before continued copies: 10-token copies that stop at the
    sequence's end, the first token after the bonus pooled with the others."""
    drafter = auto_pld_chain(10, False)()
    set_in_tables(drafter, SEPARATE_FIRST_TOKEN=False)
    return drafter


def auto_flat_prior() -> object:
    """auto over pld before the copy prior: the continuing nodes of copies start from a
    flat prior, as first tokens do."""
    drafter = make_auto(components="pld")
    set_in_tables(drafter, COPY_CONTINUES_PRIOR=AcceptanceTable.FLAT_PRIOR)
    return drafter


def auto_sampled_priors(first: tuple[float, float], continues: tuple[float, float]) -> Callable[[], object]:
    """auto over pld whose sampled requests start from these priors (pseudo-counts,
    accepted and rejected) for first tokens and for continuing copies."""
    def make():
        drafter = make_auto(components="pld")
        drafter.table = SampledFirstPrior(len(drafter.components), first)
        set_in_tables(drafter, SAMPLED_COPY_CONTINUES_PRIOR=continues)
        return drafter
    return make


class SampledFirstPrior(CrossFittedAcceptance):
    """Cross-fitted halves whose first-token prior under sampling is `first` (auto keeps
    the flat prior there): the sweep's other axis."""

    def __init__(self, drafters: int, first: tuple[float, float]) -> None:
        super().__init__(drafters)
        self.first = first
        self.flat = self.table.FLAT_PRIOR

    def expect_sampling(self, sampled: bool) -> None:
        self.table.FLAT_PRIOR = self.first if sampled else self.flat
        self.table._prior = self.table._rates = None
        super().expect_sampling(sampled)


# The sampled priors swept (first tokens, continuing copies): the greedy priors (1:1, 8:2)
# and rates down toward sampled first tokens' and copies' measured ones.
SAMPLED_PRIOR_GRID = [((a, b), (c, d)) for a, b in ((1, 1), (1, 3), (1, 7), (1, 15)) for c, d in ((8, 2), (4, 4), (2, 6))]


def auto_pld_chain(num_tokens: int, continue_copies: bool) -> Callable[[], object]:
    """auto over a prompt lookup offering copies of up to `num_tokens` tokens, which
    stop at the sequence's end or (`continue_copies`) continue into their own draft."""
    def make():
        drafter = make_auto(components="pld")
        drafter.components[0].drafter = PromptLookupDrafter(num_tokens=num_tokens, continue_copies=continue_copies)
        return drafter
    return make


class OneTable(AcceptanceTable):
    """The acceptance table before cross-fitting: one table both decides and predicts."""

    def deciding_rates(self) -> np.ndarray:
        return self.rates(optimistic=True)

    def predicting_rates(self) -> np.ndarray:
        return self.rates()


def auto_one_table() -> object:
    drafter = make_auto(components="pld")
    drafter.table = OneTable(len(drafter.components))
    return drafter


class FixedRoles(CrossFittedAcceptance):
    """Cross-fitted halves whose roles never swap: the first always decides, the other
    always predicts (whether the swap each round biases the predictions)."""

    def end_round(self) -> None:
        self.table.end_round()


class RandomFeed(CrossFittedAcceptance):
    """Cross-fitted halves fed by a seeded coin instead of in turn per cell (whether
    the alternation, in step with the rounds, biases the predictions)."""

    def __init__(self, drafters: int) -> None:
        super().__init__(drafters)
        self.coin = np.random.default_rng(0)

    def record(self, source, accepted: bool, agreed: bool = False) -> None:
        cell = self.cell(source, agreed)
        half = int(self.coin.integers(2))
        self.table.record_cell((cell[0] + half * self.drafters, *cell[1:]), accepted)


def auto_with_table(table_type) -> Callable[[], object]:
    def make():
        drafter = make_auto(components="pld")
        drafter.table = table_type(len(drafter.components))
        return drafter
    return make


VARIANTS: dict[str, Callable[[], object]] = {
    "ar": PlainDecoding,
    "pld": PromptLookupDrafter,  # the fixed method: a 10-token chain every round
    "auto-pld-by-depth": auto_over("pld", depth_only=True),
    "auto-pld-one-timescale": auto_one_timescale,
    "auto-pld": auto_over("pld"),
    "auto-pld-cost-fit": auto_with_cost(ThreeTermCostFit),
    "auto-pld-nodes-only-cost-fit": auto_with_cost(NodesOnlyCostFit),
    "auto-pld-ngram": auto_over("pld,ngram"),
    "auto-pld-pooled-first": auto_pooled_first_token,
    "auto-before-continued-copies": auto_before_continued_copies,
    "auto-pld-flat-prior": auto_flat_prior,
    "auto-pld-one-table": auto_one_table,
    "auto-pld-fixed-roles": auto_with_table(FixedRoles),
    "auto-pld-random-feed": auto_with_table(RandomFeed),
    # Lookup lengths (auto-pld10: the fixed method's copies, auto's before; auto-pld
    # itself offers 12 tokens that continue into their own draft).
    **{f"auto-pld{n}{'-continue' if c else ''}": auto_pld_chain(n, c) for n in (10, 12, 16, 24) for c in (False, True)},
    **{f"auto-pld-sampled-{a:g}:{b:g}-{c:g}:{d:g}": auto_sampled_priors((a, b), (c, d))
       for (a, b), (c, d) in SAMPLED_PRIOR_GRID},
}


def record(args) -> None:
    model = longspec.load()
    args.recorded.parent.mkdir(parents=True, exist_ok=True)
    with args.recorded.open("w") as out:
        for task in args.tasks:
            items = TaskSpec.parse(task, args.data_dir).load()
            for prompt in build_prompts(items, model.tokenizer, PromptFilter(buckets=tuple(args.buckets), limit=args.limit)):
                for temperature in args.temperatures:
                    sampling = dict(temperature=temperature, top_p=0.95, min_p=0.05) if temperature else {}
                    result = model.generate(prompt.ids, max_new_tokens=args.new_tokens, method="pld", seed=0,
                                            ignore_eos=True, **sampling)
                    row = {"task": task, "bucket": prompt.bucket, "item": prompt.item_id, "temperature": temperature,
                           "sampling": sampling, "prompt": prompt.ids.tolist(), "output": result.token_ids}
                    out.write(json.dumps(row) + "\n")
                    print(task, prompt.bucket, prompt.item_id[:8], temperature, flush=True)


class ModeledClock:
    """Wall time plus the modeled forwards the replay did not run."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def bench_rows(path: Path, data_dir: Path, tokenizer, method: str) -> list[dict]:
    """The outputs of one method in a `longspec bench` results file, with their prompts
    rebuilt from the run's task files, as replay rows."""
    lines = [json.loads(line) for line in path.open()]
    header = lines[0]
    runs = [r for r in lines[1:] if r.get("kind") == "run" and r["method"] == method
            and r.get("repeat", 0) == 0]  # repeats (`bench --repeats`) hold the same tokens
    prompts = {}
    for spec in header["tasks"]:  # a task's name, or name=FILE (e.g. several books)
        task = spec.partition("=")[0]
        mine = [r for r in runs if r["task"] == task]
        items = [i for i in TaskSpec.parse(spec, data_dir).load() if i.item_id in {r["item"] for r in mine}]
        buckets = tuple(sorted({r["bucket"] for r in mine} - {0}))
        for prompt in build_prompts(items, tokenizer, PromptFilter(buckets=buckets)):
            prompts[(task, prompt.item_id, prompt.bucket)] = prompt.ids.tolist()
    return [{"task": r["task"], "bucket": r["bucket"], "item": r["item"], "temperature": r["sampling"]["temperature"],
             "sampling": {k: v for k, v in r["sampling"].items() if v is not None},
             "prompt": prompts[(r["task"], r["item"], r["bucket"])], "output": r["output_ids"]} for r in runs]


def measured_draw_seconds(model, row: dict, tokens: int = 64, context: int = 192) -> float:
    """Seconds to draw one token of a sampled row on this machine: its processed
    distribution over the whole vocabulary and the draw, timed over the target's own
    logits for the first `tokens` tokens of its continuation after `context` prompt
    tokens, one forward (the engine pays it for every committed token of a sampled
    sequence, whatever the method)."""
    ids = torch.tensor(row["prompt"][-context:] + row["output"][:tokens])
    with torch.inference_mode():
        logits = model(ids.unsqueeze(0), model.new_cache(ids.numel() + 1)).logits[0, -tokens:]
    params = SamplingParams(**row.get("sampling") or dict(temperature=row["temperature"], top_p=0.95, min_p=0.05))
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for i in range(tokens):
        sample(processed_probs(logits[i : i + 1], None, params), generator)
    return (time.perf_counter() - start) / tokens


def replay(row: dict, make: Callable[[], object], cost_of: Callable[[int], ForwardCost], count_drafting: bool,
           clock_cost_of: Callable[[int], ForwardCost] | None = None, draw_s: float = 0.0) -> dict:
    """One variant over one row; rounds cost `clock_cost_of`'s forwards (by default the
    measurement the controller itself is given, `cost_of`) and `draw_s` per committed
    token of a sampled row (each one drawn from the processed distribution)."""
    tokens = torch.tensor(row["prompt"] + row["output"])
    committed = len(row["prompt"])
    cost = cost_of(committed)
    machine_cost = (clock_cost_of or cost_of)(committed)
    drafter = make()
    clock = ModeledClock()
    if hasattr(drafter, "forward_cost"):
        drafter.forward_cost = cost
        drafter.clock = clock
    sampled = bool(row["temperature"])
    drafter.begin(DraftContext(tokens=tokens[:committed], sampled=sampled))
    seconds, rounds, drafting = 0.0, 0, 0.0
    while committed < tokens.numel():
        context = DraftContext(tokens=tokens[:committed], sampled=sampled)
        start = time.perf_counter()
        tree = drafter.propose(context)
        spent = time.perf_counter() - start
        # What verification accepts: how deep the tree follows the continuation (not timed).
        accepted, _ = walk_down(tree, 0, tokens[committed:].tolist())
        step = tokens[committed: committed + accepted + 1]
        # The forward runs between propose and observe: `auto` times the round it verifies.
        verification = machine_cost.seconds_for(tree.size) + ROUND_OVERHEAD_S
        if row["temperature"]:
            verification += draw_s * step.numel()
        clock.advance(verification)
        start = time.perf_counter()
        drafter.observe(step)
        spent += time.perf_counter() - start
        drafting += spent
        seconds += verification + (spent if count_drafting else 0.0)
        rounds += 1
        committed += step.numel()
    new = len(row["output"])
    measured = {"tokens_per_s": new / seconds, "tau": new / rounds, "drafting_ms_per_round": 1000 * drafting / rounds}
    telemetry = drafter.telemetry()
    if telemetry is not None:  # a controller's account (fixed drafters keep none)
        measured["predicted_accepted"] = telemetry["predicted_accepted_per_round"] * telemetry["rounds"]
        measured["realised_accepted"] = telemetry["realised_accepted_per_round"] * telemetry["rounds"]
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="run the target and record continuations, then stop")
    parser.add_argument("--recorded", type=Path, default=RECORDED)
    parser.add_argument("--from-bench", type=Path, default=None, metavar="RESULTS",
                        help="replay the outputs of a `longspec bench` results file instead of --recorded")
    parser.add_argument("--bench-method", default="ar", help="whose outputs --from-bench replays")
    parser.add_argument("--tasks", nargs="+", default=["multi_news", "lcc"])
    parser.add_argument("--buckets", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--limit", type=int, default=3, help="items per task and bucket")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--settings", nargs="+", choices=("greedy", "sampled"), default=("greedy", "sampled"),
                        help="replay only these rows")
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--without-drafting-time", action="store_true",
                        help="leave the drafters' own time out (the acceptance model alone)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the forward-cost measurement")
    parser.add_argument("--draw-cost", action="store_true",
                        help="charge each committed token of a sampled row the time its draw takes on this machine "
                             "(timed at the start), as the engine pays it")
    parser.add_argument("--measure-machine-now", action="store_true",
                        help="rounds cost forwards measured now, while `auto` is given the cached measurement "
                             "(as in a run on a machine that changed since it was measured)")
    parser.add_argument("--engine-round-cost", type=Path, default=None, metavar="RESULTS",
                        help="rounds cost what `engine_round_cost.py` measured inside the engine (a round with k nodes "
                             "that share of a plain round, per setting) while `auto` is given the cached measurement")
    parser.add_argument("--out", type=Path, default=Path("bench-out/adaptive_replay.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.record:
        record(args)
        return
    loaded = longspec.load()
    model = loaded.model
    if args.from_bench is not None:
        rows = bench_rows(args.from_bench, args.data_dir, loaded.tokenizer, args.bench_method)
    else:
        rows = [json.loads(line) for line in args.recorded.open()]
    rows = [row for row in rows if ("sampled" if row["temperature"] else "greedy") in args.settings]
    costs: dict[int, ForwardCost] = {}

    def cost_of(length: int) -> ForwardCost:  # what `auto` itself uses for this length
        cost = forward_cost_at(model, length)
        return costs.setdefault(cost.key["context"], cost)

    now: dict[int, ForwardCost] = {}

    def measured_now(length: int) -> ForwardCost:
        context = cost_of(length).key["context"]
        if context not in now:
            now[context] = measure_forward_cost(model, context=context, ks=DEFAULT_KS)
        return now[context]

    clock_cost_of = measured_now if args.measure_machine_now else None
    engine_shares = engine_round_shares(args.engine_round_cost) if args.engine_round_cost else None
    sampled = [row for row in rows if row["temperature"]]
    draw_s = measured_draw_seconds(model, sampled[0]) if args.draw_cost and sampled else 0.0
    variants = list(dict.fromkeys(["ar", "pld", *args.variants]))  # the baselines first
    results = []
    for index, row in enumerate(rows):
        line = f"{row['task'][:10]:10s} {row['bucket']:6d} {row['item'][:8]} T={row['temperature']:g}"
        for name in variants:
            clock = clock_cost_of
            if engine_shares is not None:
                clock = engine_clock(cost_of, engine_shares["sampled" if row["temperature"] else "greedy"])
            measured = replay(row, VARIANTS[name], cost_of, not args.without_drafting_time, clock, draw_s)
            results.append({"row": index, "task": row["task"], "bucket": row["bucket"], "item": row["item"],
                            "temperature": row["temperature"], "variant": name, **measured})
            line += f" | {name} {measured['tokens_per_s']:6.1f}"
        print(line, flush=True)
    print_ratios(results, variants)
    print_calibration(results)
    header = {"benchmark": "adaptive_replay", "machine": machine(), "rows": len(rows), "threads": args.threads,
              "drafting_time_counted": not args.without_drafting_time, "round_overhead_s": ROUND_OVERHEAD_S,
              "forward_cost_ms": {str(c): [round(1000 * s, 2) for s in cost.seconds] for c, cost in costs.items()},
              "draw_ms_per_sampled_token": round(1000 * draw_s, 3),
              "machine_forward_cost_ms": {str(c): [round(1000 * s, 2) for s in cost.seconds]
                                          for c, cost in now.items()},
              "engine_round_cost": str(args.engine_round_cost) if args.engine_round_cost else None,
              "time": time.ctime()}
    write_results(args.out, header, results)


def engine_round_shares(path: Path) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
    """Per setting, the forward sizes k (the root and its nodes) `engine_round_cost.py`
    measured and what a round of that size cost against a plain round inside the engine."""
    rows = [json.loads(line) for line in path.open()][1:]
    shares = {}
    for setting in ("greedy", "sampled"):
        mine = sorted((r["nodes"] + 1, r["ratio"]) for r in rows if r["setting"] == setting)
        shares[setting] = ((1, *(k for k, _ in mine)), (1.0, *(ratio for _, ratio in mine)))
    return shares


def engine_clock(cost_of: Callable[[int], ForwardCost], shares: tuple[tuple[int, ...], tuple[float, ...]]
                 ) -> Callable[[int], ForwardCost]:
    """Forward costs at a context: the cached measurement's plain forward times what a
    round of k tokens cost against a plain round inside the engine."""
    ks, ratios = shares

    def cost(length: int) -> ForwardCost:
        measured = cost_of(length)
        base = measured.seconds_for(1)
        return ForwardCost(measured.key, ks, tuple(base * ratio for ratio in ratios))
    return cost


def print_ratios(results: list[dict], variants: list[str]) -> None:
    """Each variant's tokens per second over plain decoding's and prompt lookup's, row
    by row, per setting: geometric mean and worst row."""
    speed = {(r["row"], r["variant"]): r["tokens_per_s"] for r in results}
    print("\n| variant | setting | rows | geometric mean x ar | min x ar | geometric mean x pld | min x pld "
          "| drafting ms per round |\n|---|---|---|---|---|---|---|---|")
    for name in variants:
        for setting in ("greedy", "sampled"):
            mine = [r for r in results if r["variant"] == name and ("sampled" if r["temperature"] else "greedy") == setting]
            if not mine:
                continue
            cells = []
            for baseline in ("ar", "pld"):
                ratios = [r["tokens_per_s"] / speed[(r["row"], baseline)] for r in mine]
                cells += [f"{math.exp(sum(math.log(x) for x in ratios) / len(ratios)):.3f}", f"{min(ratios):.2f}"]
            drafting = sum(r["drafting_ms_per_round"] for r in mine) / len(mine)
            print(f"| {name} | {setting} | {len(mine)} | {' | '.join(cells)} | {drafting:.2f} |")


def print_calibration(results: list[dict]) -> None:
    """Predicted / realised accepted tokens per variant, setting and task (rows summed)."""
    sums: dict[tuple, list[float]] = {}
    for r in results:
        if "predicted_accepted" in r:
            setting = "sampled" if r["temperature"] else "greedy"
            total = sums.setdefault((r["variant"], setting, r["task"]), [0.0, 0.0])
            total[0] += r["predicted_accepted"]
            total[1] += r["realised_accepted"]
    if sums:
        print("\n| variant | setting | task | predicted / realised accepted tokens |\n|---|---|---|---|")
        for (variant, setting, task), (predicted, realised) in sorted(sums.items()):
            print(f"| {variant} | {setting} | {task} | {predicted / max(realised, 1e-9):.2f} |")


if __name__ == "__main__":
    main()
