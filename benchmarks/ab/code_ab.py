"""Two commits of longspec against each other, in one run: decode speed of single
sequences (B = 1) with the embedded Gemma 3 270M, per method and setting, and the cost of
a k-token verification forward, in interleaved processes.

    python benchmarks/ab/code_ab.py --before 7c90624 --after HEAD --methods ar pld auto \
        --settings greedy sampled --verify-widths 1 16 \
        --context 4096 --new-tokens 256 --pairs 3 --out benchmarks/results/$(date +%F)-code-ab

Each commit is checked out in a temporary git worktree; every pair runs one process
of each (before first in odd pairs, after first in even ones) that loads the model
and times each method's decode (prefill excluded) after a warm-up run, then (with
--verify-widths) the median of repeated forwards of a k-token chain over `context` random
committed keys, each with the decision of every row (the certified head's where the code
has one, else the argmax of the full head's logits). Prints the medians per commit and
their ratios (after / before); writes JSON lines to --out. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"greedy": {}, "sampled": {"temperature": 1.0, "top_p": 0.95, "seed": 0},
            # `longspec bench`'s sampled setting
            "sampled-min-p": {"temperature": 1.0, "top_p": 0.95, "min_p": 0.05, "seed": 0}}
HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    """Inside one checkout: time each method, print one JSON line per method."""
    import torch

    sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py
    import longspec
    from common import prompt_ids, stdlib_source_text
    from longspec.speculation.engine import EngineOptions

    torch.set_num_threads(args.threads)
    # The suffix cache off where the commit has one: the timed run repeats the warm-up's prompt, and
    # drafting it from the warm-up's own output would measure the cache, not the code.
    off = {"suffix_cache_mb": 0} if "suffix_cache_mb" in inspect.signature(longspec.load).parameters else {}
    model = longspec.load(engine=EngineOptions(progress=False), **off)
    text = args.prompt_file.read_text() if args.prompt_file else stdlib_source_text(8 * args.context)
    prompt = prompt_ids(model.tokenizer, text, args.context)
    for setting in args.settings:
        for method in args.methods:
            options = SETTINGS[setting]
            model.generate(prompt, method=method, max_new_tokens=16, **options)  # warm-up (and auto's cost model)
            result = model.generate(prompt, method=method, max_new_tokens=args.new_tokens, ignore_eos=True, **options)
            stats = result.stats
            print(json.dumps({"method": method, "setting": setting, "tokens_per_s": stats.new_tokens / stats.decode_s,
                              "tau": stats.tau, "tokens": result.token_ids}), flush=True)
    for width in args.verify_widths:
        print(json.dumps({"method": f"forward-{width}", "setting": "greedy",
                          "ms": 1e3 * forward_seconds(model.model, args.context, width)}), flush=True)


def forward_seconds(decoder, context: int, width: int, repeats: int = 15) -> float:
    """Median seconds of a forward of a `width`-token chain over `context` committed random
    keys with every row's decision."""
    import time

    import torch
    from longspec.runtime.argmax import row_argmax
    from longspec.speculation.cost_model import commit_random_keys
    from longspec.speculation.tree import Tree

    cache = decoder.new_cache(context + width + 1, max_forward_tokens=max(512, width))
    commit_random_keys(decoder, cache, context, chunk=512)
    ids = torch.randint(0, decoder.config.vocab_size, (width,), generator=torch.Generator().manual_seed(0))
    tree = Tree.chain(int(ids[0]), ids[1:].tolist())
    positions = cache.length + tree.depths
    # Code from before the certified head has no `decide`: the argmax of the full head's logits.
    decide = getattr(decoder, "decide", None) or (lambda hidden: row_argmax(decoder.logits(hidden)))
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        hidden = decoder(tree.tokens.unsqueeze(0), cache, positions=positions, with_logits=False).hidden[0]
        decide(hidden)
        times.append(time.perf_counter() - start)
        cache.drop_pending()
    return statistics.median(times[2:])


def checkout(ref: str, into: Path) -> Path:
    if (into / ".git").exists():  # kept from an earlier run (--worktrees): moved to `ref`, its kernels' build kept
        subprocess.run(["git", "-C", str(into), "checkout", "--detach", "--quiet", ref], check=True)
        return into
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), ref], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return into


def run_one(tree: Path, args) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--context", str(args.context),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--methods", *args.methods,
               "--settings", *args.settings]
    if args.verify_widths:
        command += ["--verify-widths", *map(str, args.verify_widths)]
    if args.prompt_file:
        command += ["--prompt-file", str(args.prompt_file.resolve())]
    # Each checkout keeps its own build of the native kernels: sharing one cache would rebuild them every turn.
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "TORCH_EXTENSIONS_DIR": str(tree / ".torch-extensions")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD~1")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "auto"])
    parser.add_argument("--settings", nargs="+", default=["greedy"], choices=sorted(SETTINGS))
    parser.add_argument("--verify-widths", type=int, nargs="+", default=[])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prompt-file", type=Path, default=None,
                        help="a text file whose first --context tokens are the prompt (default: Python source)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worktrees", type=Path, default=None,
                        help="keep the two checkouts (and their kernels' builds) here for later runs, e.g. a "
                             "--pairs 1 --new-tokens 8 run that builds them before the timed one on an idle machine")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py
    from common import machine

    with tempfile.TemporaryDirectory() as scratch:
        place = args.worktrees or Path(scratch)
        trees = {label: checkout(ref, place / label) for label, ref in (("before", args.before),
                                                                         ("after", args.after))}
        try:
            rows = []
            for pair in range(args.pairs):
                order = ("before", "after") if pair % 2 == 0 else ("after", "before")
                for label in order:
                    for row in run_one(trees[label], args):
                        rows.append({"pair": pair, "code": label, **row})
                        speed = (f"{row['ms']:7.2f} ms" if "ms" in row
                                 else f"{row['tokens_per_s']:7.2f} tok/s tau {row['tau']:.2f}")
                        print(f"pair {pair} {label:6s} {row['setting']:13s} {row['method']:10s} {speed}",
                              file=sys.stderr, flush=True)
        finally:
            for tree in trees.values() if args.worktrees is None else ():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    refs = {label: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True,
                                  text=True).stdout.strip() for label, ref in (("before", args.before),
                                                                               ("after", args.after))}
    source = args.prompt_file.name if args.prompt_file else "Python source"
    print(f"\nmachine: {machine()}; {source}, context {args.context}, {args.new_tokens} new tokens, {args.threads} threads, "
          f"{args.pairs} interleaved pairs; before {refs['before']}, after {refs['after']}\n")
    print("| setting | method | before | after | after / before | same tokens |")
    print("|---|---|---|---|---|---|")
    for setting, method in dict.fromkeys((r["setting"], r["method"]) for r in rows):
        mine = [r for r in rows if r["setting"] == setting and r["method"] == method]
        unit = "ms" if "ms" in mine[0] else "tokens_per_s"
        value = {label: statistics.median(r[unit] for r in mine if r["code"] == label) for label in ("before", "after")}
        # Sampled runs draw through each code's own exact sampler: the same distribution, not the same draws.
        same = "" if unit == "ms" or setting != "greedy" else "yes" if len({tuple(r["tokens"]) for r in mine}) == 1 else "NO"
        print(f"| {setting} | {method} | {value['before']:.2f} | {value['after']:.2f} "
              f"| {value['after'] / value['before']:.3f} | {same} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as out:
            for row in rows:
                out.write(json.dumps({**row, "refs": refs, "machine": machine(), "context": args.context,
                                      "prompt": source, "new_tokens": args.new_tokens}) + "\n")


if __name__ == "__main__":
    main()
