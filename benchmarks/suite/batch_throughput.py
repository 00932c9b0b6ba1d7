"""Batched speculative decoding: throughput (generated tokens/s summed over rows)
per method and batch size, in one run, on long prompts (LongBench Multi-News and
LCC, cut to --prompt-tokens by LongBench's middle truncation).

    python benchmarks/suite/batch_throughput.py --batch-sizes 1 2 4 8 --methods ar pld longspec-ngram

For each task, method and batch size B, B distinct prompts are submitted to one
`BatchEngine` with B rows; the clock starts once every row has been prefilled and
stops when the last row has produced --new-tokens tokens (EOS ignored, so every row
does the same work; tokens of the first round, which runs in the step that
prefills, are not counted). Reported: throughput, the ratio to AR at the same B (what
speculation adds at that batch size), the same ratio over the rounds in which all B
rows decode (what a server whose queue refills finished rows sees: rows that
finish early leave a speculative batch running narrower, which the whole-batch figure
counts against it), the ratio to AR at B = 1 (what batching
adds), mean τ over rows, the share of verified nodes that were padding (trees
are padded to the widest row's), and bytes per row (target cache, drafter state). The single-sequence engine's AR at B = 1 is measured too,
so the batched engine's own overhead at B = 1 is visible. Writes JSON lines to
--out, a markdown table to stdout, and a plot of the speedup over AR against the
batch size (the LongSpec paper's figure shape) to --plot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.api import parse_dtype
from longspec.bench.tasks import PromptFilter, TaskSpec, build_prompts
from longspec.speculation.batch_engine import BatchEngine, BatchOptions
from longspec.speculation.engine import EngineOptions
from longspec.speculation.methods import make_drafter
from longspec.speculation.metrics import GenerationStats
from longspec.speculation.processors import SamplingParams

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def batched_run(model, prompts, method, new_tokens, params, options, seed, forward_nodes=None, fill_padding=False,
                joint_budget=False, forward_cost_limit=BatchOptions.forward_cost_limit):
    """Throughput of one batch: all rows prefilled first, then decoded to the end."""
    B = len(prompts)
    budget = options.max_tree_nodes if method != "ar" else 0
    capacity = max(p.numel() for p in prompts) + new_tokens + budget + 1
    engine = BatchEngine(model.model, options, BatchOptions(max_rows=B, row_capacity=capacity,
                                                            max_forward_nodes=forward_nodes, fill_padding=fill_padding,
                                                            joint_budget=joint_budget,
                                                            forward_cost_limit=forward_cost_limit))
    drafters = [make_drafter(method) for _ in prompts]
    handles = [engine.submit(p, params=params, max_new_tokens=new_tokens, drafter=d,
                             generator=torch.Generator().manual_seed(seed + i), stats=GenerationStats(method=method))
               for i, (p, d) in enumerate(zip(prompts, drafters))]
    while engine.decoding_rows < B:
        engine.step()  # prefill every row (one step prefills all when no row decodes yet)
    before = sum(h.stats.new_tokens for h in handles)  # the step that prefilled also ran a first round
    start = time.perf_counter()
    steps = 0
    full_tokens, full_seconds = 0, 0.0  # rounds in which all B rows decode
    while engine.has_work:
        rows_before, tokens_before, t0 = engine.decoding_rows, sum(h.stats.new_tokens for h in handles), time.perf_counter()
        engine.step()
        steps += 1
        if rows_before == B:
            full_seconds += time.perf_counter() - t0
            full_tokens += sum(h.stats.new_tokens for h in handles) - tokens_before
    wall = time.perf_counter() - start
    produced = sum(h.stats.new_tokens for h in handles) - before
    memory = {"target_cache_bytes_per_row": engine.cache.bytes_per_row(),
              "drafter_state_bytes_per_row": max((d.state_nbytes() for d in drafters if hasattr(d, "state_nbytes")), default=0),
              "padding_fraction": engine.padding_nodes / max(engine.forward_nodes, 1),
              # What a server whose queue refills finished rows sees: throughput while all B rows decode.
              "full_batch_tokens_per_s": full_tokens / full_seconds if full_seconds else 0.0,
              "full_batch_share_of_time": full_seconds / wall}
    return produced / wall, handles, steps, memory


def single_run(model, prompt, new_tokens, params, seed):
    stats = GenerationStats()
    generator = torch.Generator().manual_seed(seed)
    rounds = model.engine.generate(prompt, params=params, max_new_tokens=new_tokens, generator=generator, stats=stats)
    out = torch.cat(list(rounds))
    return out.numel() / stats.decode_s, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tasks", nargs="+", default=["multi_news", "lcc"])
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "longspec-ngram"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-forward-nodes", type=int, default=None,
                        help="speculative nodes per forward shared by all rows (default: no shared budget)")
    parser.add_argument("--fill-padding", action="store_true",
                        help="rows whose drafter can widen its tree fill the batch's padding (BatchOptions.fill_padding)")
    parser.add_argument("--forward-cost-limit", type=float, default=BatchOptions.forward_cost_limit,
                        help="cap each row's tree by the measured batched cost (BatchOptions.forward_cost_limit)")
    parser.add_argument("--no-forward-cost-limit", dest="forward_cost_limit", action="store_const", const=None,
                        help="rows keep their whole trees")
    parser.add_argument("--joint-budget", action="store_true",
                        help="cut the rows' trees jointly from measured acceptance and cost (BatchOptions.joint_budget)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/batch_throughput.jsonl"))
    parser.add_argument("--plot", type=Path, default=Path("bench-out/batch_throughput.png"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if "ar" not in args.methods:
        args.methods.insert(0, "ar")
    params = SamplingParams(temperature=args.temperature)
    options = EngineOptions(progress=False)
    model = longspec.load(args.model, dtype=parse_dtype(args.dtype), engine=options)
    most = max(args.batch_sizes)
    header = {"benchmark": "batch_throughput", "machine": machine(), "model": model.target.source, "time": time.ctime(),
              "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "temperature": args.temperature, "threads": torch.get_num_threads(),
              "max_forward_nodes": args.max_forward_nodes, "fill_padding": args.fill_padding,
              "joint_budget": args.joint_budget, "forward_cost_limit": args.forward_cost_limit}
    print(header, flush=True)
    # Warm-up: first calls of each kernel shape and the drafters' loading.
    warm = torch.arange(300) % 1000 + 100
    for method in args.methods:
        batched_run(model, [warm, warm], method, 8, params, options, args.seed)
    # The batched forward's cost at these rows' lengths (the joint budget and the cost cap read it): measured (or
    # read) before any clock starts.
    if args.joint_budget or args.forward_cost_limit is not None:
        warm_engine = BatchEngine(model.model, options, BatchOptions(max_rows=most, row_capacity=64))
        for rows in range(1, most + 1):
            for length in (args.prompt_tokens, args.prompt_tokens + args.new_tokens):
                warm_engine.forward_cost(rows, length)
    rows = []
    for task in args.tasks:
        items = TaskSpec.parse(task, args.data_dir).load()
        prompts = [p.ids for p in build_prompts(items, model.tokenizer, PromptFilter(buckets=(args.prompt_tokens,), limit=most))]
        if len(prompts) < most:
            raise SystemExit(f"{task}: only {len(prompts)} prompts of >= {args.prompt_tokens} tokens, need {most}")
        single_tps, _ = single_run(model, prompts[0], args.new_tokens, params, args.seed)
        rows.append({"task": task, "method": "ar (single-sequence engine)", "batch": 1, "tokens_per_s": single_tps})
        print(rows[-1], flush=True)
        ar_at, ar_full_at = {}, {}
        for B in args.batch_sizes:
            for method in args.methods:
                tps, handles, steps, memory = batched_run(model, prompts[:B], method, args.new_tokens, params, options,
                                                          args.seed, args.max_forward_nodes, args.fill_padding,
                                                          args.joint_budget, args.forward_cost_limit)
                if method == "ar":
                    ar_at[B] = tps
                    ar_full_at[B] = memory["full_batch_tokens_per_s"]
                row = {
                    "task": task, "method": method, "batch": B, "tokens_per_s": tps,
                    "ratio_to_ar_same_batch": tps / ar_at[B], "ratio_to_ar_batch_1": tps / ar_at[args.batch_sizes[0]],
                    "full_batch_ratio_to_ar_same_batch": memory["full_batch_tokens_per_s"] / ar_full_at[B],
                    "tau": sum(h.stats.tau for h in handles) / B, "rounds": steps, **memory,
                }
                rows.append(row)
                print(row, flush=True)
    write_results(args.out, header, rows)
    print_table(rows)
    plot(rows, args, header)


def print_table(rows) -> None:
    print("\n| task | method | B | tokens/s | × AR at same B | × AR at B = 1 | full-batch rounds: × AR at same B "
          "(share of time) | τ | padding |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = f"{r['ratio_to_ar_same_batch']:.2f}" if "ratio_to_ar_same_batch" in r else ""
        base = f"{r['ratio_to_ar_batch_1']:.2f}" if "ratio_to_ar_batch_1" in r else ""
        full = (f"{r['full_batch_ratio_to_ar_same_batch']:.2f} ({r['full_batch_share_of_time']:.0%})"
                if "full_batch_ratio_to_ar_same_batch" in r else "")
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        padding = f"{r['padding_fraction']:.0%}" if "padding_fraction" in r else ""
        print(f"| {r['task']} | {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {same} | {base} | {full} | {tau} "
              f"| {padding} |")


def plot(rows, args, header) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for task in args.tasks:
        for method in args.methods:
            mine = [r for r in rows if r["task"] == task and r["method"] == method]
            sizes = [r["batch"] for r in mine]
            axes[0].plot(sizes, [r["ratio_to_ar_same_batch"] for r in mine], marker="o", label=f"{task} {method}")
            axes[1].plot(sizes, [r["tokens_per_s"] for r in mine], marker="o", label=f"{task} {method}")
    axes[0].set(xlabel="batch size", ylabel="speedup over AR at the same batch size", xscale="log", title="speculation")
    axes[1].set(xlabel="batch size", ylabel="generated tokens/s (all rows)", xscale="log", title="throughput")
    for ax in axes:
        ax.minorticks_off()  # a log axis would label 3 and 6 as 3x10^0
        ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{header['model']}, {args.dtype}, {args.prompt_tokens}-token prompts, {header['threads']} threads", fontsize=9)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
