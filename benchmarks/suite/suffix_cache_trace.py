"""Counts, not timings: what `auto` does each round on the suffix-cache workloads
(`suffix_cache.py`'s prompts), with the model's cache and without it.

Per round: which components proposed (cache, prompt lookup, both, nothing), how long
each one's proposal was, the tree size `auto` chose (k) and the forward rows it
verified, the accepted length, what the cost model predicts for that forward (in plain
decoding steps), and how far the cache's proposal and a 64-token lookup of the cache
(`--probe-tokens`) match the tokens the request went on to commit. The summary sums
them per arm; its `modeled_steps` (the rounds' predicted forward costs in plain steps,
the controller's own work left out) gives a load-free ratio of the arms.

    python benchmarks/suite/suffix_cache_trace.py --requests 50 --new-tokens 64 --out bench-out/suffix_trace.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # suffix_cache.py's workloads

import common  # noqa: F401  (the cost measurement policy: measured now, not a default)
import longspec
from longspec.speculation.cost_model import ForwardCost
from longspec.speculation.drafters.adaptive.drafter import _accepted_path
from longspec.speculation.drafters.suffix_cache import SuffixCache
from longspec.speculation.presets.auto import make_auto
from suffix_cache import templated, unrelated


def traced_auto(cache: SuffixCache | None, rounds: list[dict], probe_tokens: int, cost: ForwardCost | None):
    """`auto` as `generate(method="auto")` builds it, recording each round in `rounds`;
    with `cost`, it sizes trees from that curve instead of this machine's measurement."""
    drafter = make_auto(suffix_cache=cache)
    if cost is not None:
        drafter.forward_cost = cost
    names = [c.name for c in drafter.components]
    propose, observe = drafter.propose, drafter.observe

    def traced_propose(context):
        tree = propose(context)
        round_ = drafter._round
        record = {"position": int(context.tokens.numel()), "k": 0, "rows": tree.size, "skipped": bool(round_.get("skipped"))}
        if not record["skipped"]:
            merged, kept = round_["merged"], round_["kept"]
            proposed = {name: [0] for name in names}
            chosen = Counter()
            for node in range(1, len(merged.tokens)):
                for source in merged.sources[node]:
                    proposed[names[source.drafter]][0] += 1
            for node in kept[1:]:
                for name in {names[s.drafter] for s in merged.sources[node]}:
                    chosen[name] += 1
            # Each component's proposal as a chain (the tokens down its first candidate).
            chains = {}
            for name in names:
                index = names.index(name)
                node, chain = 0, []
                while True:
                    children = [n for n in range(1, len(merged.tokens)) if merged.parents[n] == node
                                and any(s.drafter == index and s.rank == 0 for s in merged.sources[n])]
                    if not children:
                        break
                    node = children[0]
                    chain.append(merged.tokens[node])
                chains[name] = chain
            record.update(k=round_["k"], proposed={n: v[0] for n, v in proposed.items()}, chosen=dict(chosen),
                          chains=chains, predicted=round_["predicted"],
                          cost=drafter._verify_seconds(round_["k"]) / drafter._verify_seconds(0),
                          cost_by_k={str(j): drafter._verify_seconds(j) / drafter._verify_seconds(0)
                                     for j in (1, 2, 4, 8, 12, 16, 24, 32)},
                          expected=[round(x, 3) for x in (round_["expected"][n] for n in round_["order"][:32])])
            if cache is not None and probe_tokens:
                suffix = context.tokens[max(context.tokens.numel() - cache.max_run, 0):].tolist()
                found = cache.lookup(suffix, probe_tokens, 1)
                record["probe"] = found[0][0] if found else []
                record["probe_run"] = found[0][1] if found else 0
        record["_merged"] = None if record["skipped"] else (round_["merged"], round_["kept"])
        rounds.append(record)
        return tree

    def traced_observe(committed):
        record = rounds[-1] if rounds else None
        if record is not None and "committed" not in record:
            record["committed"] = int(committed.numel())
            merged = record.pop("_merged", None)
            record["accepted"] = len(_accepted_path(*merged, committed)) if merged else 0
        observe(committed)

    drafter.propose, drafter.observe = traced_propose, traced_observe
    return drafter


def matched(chain: list[int], output: list[int], start: int) -> int:
    """How many leading tokens of `chain` equal the output from `start` on."""
    n = 0
    while n < len(chain) and start + n < len(output) and chain[n] == output[start + n]:
        n += 1
    return n


def run_arm(model, cache, prompts, new_tokens, probe_tokens, cost) -> tuple[list[dict], list[list[int]]]:
    all_rounds, outputs = [], []
    for i, prompt in enumerate(prompts):
        model.suffix_cache = cache
        rounds: list[dict] = []
        drafter = traced_auto(cache, rounds, probe_tokens, cost)
        ids = model.encode(prompt).tolist()
        result = model.generate(prompt, method=drafter, max_new_tokens=new_tokens, ignore_eos=True)
        sequence = ids + result.token_ids
        for r in rounds:
            r.pop("_merged", None)
            r["request"] = i
            for name, chain in r.get("chains", {}).items():
                r.setdefault("chain_match", {})[name] = matched(chain, sequence, r["position"])
            if "probe" in r:
                r["probe_match"] = matched(r["probe"], sequence, r["position"])
                r["probe_len"] = len(r.pop("probe"))
            r.pop("chains", None)
        all_rounds += rounds
        outputs.append(result.token_ids)
    return all_rounds, outputs


def summary(rounds: list[dict], tokens: int) -> dict:
    kinds = Counter()
    by_kind: dict[str, Counter] = {}
    for r in rounds:
        if r["skipped"]:
            kind = "skipped (speculation off)"
        else:
            proposers = sorted(n for n, v in r["proposed"].items() if v)
            kind = "+".join(proposers) or "nothing proposed"
            if r["k"] == 0:
                kind += ", k=0"
        kinds[kind] += 1
        c = by_kind.setdefault(kind, Counter())
        c["rounds"] += 1
        c["k"] += r["k"]
        c["rows"] += r["rows"]
        c["accepted"] += r.get("accepted", 0)
        c["committed"] += r.get("committed", 1)
        c["cost"] += r.get("cost", 1.0)
        for name, n in r.get("chain_match", {}).items():
            c[f"{name}_proposed"] += r["proposed"][name]
            c[f"{name}_chain_match"] += n
        if "probe_match" in r:
            c["probe_match"] += r["probe_match"]
            c["probe_len"] += r["probe_len"]
    modeled = sum(r.get("cost", 1.0) for r in rounds)
    return {"tokens": tokens, "rounds": len(rounds), "modeled_steps": modeled,
            "modeled_speedup_over_plain": tokens / modeled,
            "rows_verified": sum(r["rows"] for r in rounds),
            "k_histogram": dict(sorted(Counter(r["k"] for r in rounds).items())),
            "accepted_histogram": dict(sorted(Counter(r.get("accepted", 0) for r in rounds).items())),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["rounds"])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--unrelated", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-mb", type=float, default=64)
    parser.add_argument("--probe-tokens", type=int, default=64)
    parser.add_argument("--cost-curve", type=Path, default=None,
                        help="a cached forward-cost JSON (~/.cache/longspec/cost-model/*.json) to size trees from: "
                             "the same curve for every run, whatever the machine's load")
    parser.add_argument("--out", type=Path, default=Path("bench-out/suffix_cache_trace.json"))
    args = parser.parse_args()
    cost = None
    if args.cost_curve is not None:
        data = json.loads(args.cost_curve.read_text())
        cost = ForwardCost(data["key"], tuple(data["ks"]), tuple(data["seconds"]))
    model = longspec.load(args.model)
    # With a given curve nothing is measured (a warm-up through auto would measure one).
    model.generate("Warm up.", method="auto" if cost is None else "ar", max_new_tokens=8)
    cache = SuffixCache.of_megabytes(args.cache_mb)
    report = {"command": " ".join(sys.argv), "cost_curve": None if cost is None else list(zip(cost.ks, cost.seconds))}
    for workload, prompts in (("templated", templated(args.requests)), ("unrelated", unrelated(args.unrelated))):
        if not prompts:
            continue
        on, out_on = run_arm(model, cache, prompts, args.new_tokens, args.probe_tokens, cost)
        off, out_off = run_arm(model, None, prompts, args.new_tokens, 0, cost)
        if out_on != out_off:
            raise AssertionError(f"{workload}: the outputs differ with and without the cache")
        tokens = len(prompts) * args.new_tokens
        s_on, s_off = summary(on, tokens), summary(off, tokens)
        report[workload] = {"on": s_on, "off": s_off,
                            "modeled_ratio": s_off["modeled_steps"] / s_on["modeled_steps"],
                            "rounds_on": on, "rounds_off": off, "outputs": out_on}
        print(json.dumps({workload: {"modeled_ratio": report[workload]["modeled_ratio"], "on": s_on, "off": s_off}},
                         indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
