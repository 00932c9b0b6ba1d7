"""What a sampled token's draw costs, and what that does to sampled decoding: the native
truncation-sampling kernels (`runtime/kernels/truncated_sampling.cpp`) against the
PyTorch path they replace, in one run.

Part 1: per token, the processed distribution (penalty, temperature, top-k, top-p,
min-p) and the draw, over Gemma 3 270M's real next-token logits at 256 positions of a
Multi-News document; with how many rows' kept sets each path gets wrong against the
rules computed in float64.
Part 2: sampled decoding (temperature 1, top-p 0.95, min-p 0.05, the bench's sampled
setting) by AR, prompt lookup and `auto` on Multi-News and LCC prompts, both paths
interleaved per repeat, the same seed: decode tokens per second, the ratio per row, and
whether the two paths committed the same tokens (they draw the same uniforms; only a
token whose fate sits on a cut within float rounding can differ).

    python benchmarks/micro/sampling_draw.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, write_results
from longspec.speculation import processors
from longspec.speculation.processors import SamplingParams, processed_probs, sample

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
BENCH_SAMPLING = dict(temperature=1.0, top_p=0.95, min_p=0.05)
SETTINGS = {
    "bench: T 1, top-p 0.95, min-p 0.05": (SamplingParams(**BENCH_SAMPLING), False),
    "TokenSwift: min-p 0.1, penalty 1.2": (SamplingParams(temperature=1.0, min_p=0.1, penalty=1.2), True),
    "top-k 50": (SamplingParams(temperature=1.0, top_k=50), False),
    "top-p 0.9": (SamplingParams(temperature=1.0, top_p=0.9), False),
}


@contextmanager
def pytorch_path(active: bool):
    """The PyTorch path for processing and drawing (the baseline), while `active`."""
    saved = processors.native_ops
    if active:
        processors.native_ops = lambda: None
    try:
        yield
    finally:
        processors.native_ops = saved


def exact_kept(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The kept set by the warpers' rules in float64 (ties at a cut kept), one row."""
    s = scores.double()
    kept = torch.ones_like(s, dtype=torch.bool)
    if params.top_k:
        kept &= s >= s.topk(params.top_k).values[-1]
    if params.top_p is not None and params.top_p < 1:
        probs = s.masked_fill(~kept, -math.inf).softmax(-1)
        order = probs.argsort(descending=True, stable=True)
        above = probs[order].cumsum(0) - probs[order]
        kept &= s >= s[order[max(int((above < params.top_p).sum()) - 1, 0)]]
    if params.min_p:
        probs = s.masked_fill(~kept, -math.inf).softmax(-1)
        kept &= probs >= params.min_p * probs.max()
    return kept


def per_token_costs(model, positions: int) -> list[dict]:
    text = json.loads((DATA / "longbench" / "multi_news.jsonl").read_text().splitlines()[3])["context"]
    ids = torch.tensor(model.tokenizer(text).input_ids[:positions])
    decoder = model.target.model
    with torch.inference_mode():
        logits = decoder(ids.unsqueeze(0), decoder.new_cache(ids.numel(), max_forward_tokens=ids.numel())).logits[0]
    histories = processors.history_windows(ids, torch.arange(1, ids.numel() + 1), 1024)
    print(f"\n{logits.shape[0]} positions of a Multi-News document, vocabulary {logits.shape[1]}, bf16 logits")
    print("| setting | path | processed distribution ms | draw ms | rows off the float64 rule | median kept |")
    print("|---|---|---|---|---|---|")
    results = []
    for name, (params, with_history) in SETTINGS.items():
        for path in ("pytorch", "native"):
            with pytorch_path(path == "pytorch"):
                generator = torch.Generator().manual_seed(0)
                t_probs = t_draw = 0.0
                off, kept_sizes = 0, []
                for i in range(logits.shape[0]):
                    history = histories[i : i + 1] if with_history else None
                    start = time.perf_counter()
                    probs = processed_probs(logits[i : i + 1], history, params)
                    t_probs += time.perf_counter() - start
                    start = time.perf_counter()
                    sample(probs, generator)
                    t_draw += time.perf_counter() - start
                    scores = processors._penalized(logits[i : i + 1], history, params)[0] / params.temperature
                    off += not torch.equal(probs[0] > 0, exact_kept(scores, params))
                    kept_sizes.append(int((probs[0] > 0).sum()))
            n = logits.shape[0]
            row = {"part": "per_token", "setting": name, "path": path, "probs_ms": 1e3 * t_probs / n,
                   "draw_ms": 1e3 * t_draw / n, "rows_off_exact": off, "median_kept": statistics.median(kept_sizes)}
            results.append(row)
            print(f"| {name} | {path} | {row['probs_ms']:.2f} | {row['draw_ms']:.2f} | {off} / {n} | "
                  f"{row['median_kept']:g} |")
    return results


def decoding(model, args) -> list[dict]:
    prompts = []
    for task in ("multi_news", "lcc"):
        item = json.loads((DATA / "longbench" / f"{task}.jsonl").read_text().splitlines()[0])
        ids = model.tokenizer(item["context"]).input_ids
        for context in args.contexts:
            if len(ids) >= context:
                prompts.append((task, context, ids[:context]))
    model.generate(prompts[0][2][:64], max_new_tokens=8, **BENCH_SAMPLING, seed=0)  # warm-up: kernels, caches
    runs = []
    for repeat in range(args.repeats):
        for task, context, ids in prompts:
            for method in args.methods:
                for path in ("pytorch", "native") if repeat % 2 == 0 else ("native", "pytorch"):
                    with pytorch_path(path == "pytorch"):
                        result = model.generate(ids, method=method, max_new_tokens=args.new_tokens, seed=0,
                                                ignore_eos=True, **BENCH_SAMPLING)
                    runs.append({"part": "decode", "task": task, "context": context, "method": method, "path": path,
                                 "repeat": repeat, "decode_tokens_per_s": result.stats.decode_tokens_per_s,
                                 "tau": result.stats.tau, "tokens": result.token_ids})
                    print(f"{task:10s} {context:5d} {method:5s} {path:7s} r{repeat} "
                          f"{result.stats.decode_tokens_per_s:6.1f} tok/s  tau {result.stats.tau:.2f}", flush=True)
    print("\n| task | context | method | PyTorch path tok/s | native tok/s | native / PyTorch | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for task, context, _ in prompts:
        for method in args.methods:
            mine = [r for r in runs if (r["task"], r["context"], r["method"]) == (task, context, method)]
            rate = {p: statistics.median(r["decode_tokens_per_s"] for r in mine if r["path"] == p)
                    for p in ("pytorch", "native")}
            same = all(r["tokens"] == mine[0]["tokens"] for r in mine)
            print(f"| {task} | {context} | {method} | {rate['pytorch']:.1f} | {rate['native']:.1f} | "
                  f"{rate['native'] / rate['pytorch']:.2f} | {'yes' if same else 'no'} |")
    for r in runs:
        del r["tokens"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "auto"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-decoding", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench-out/sampling_draw.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = longspec.load()
    print(f"machine: {machine()}")
    results = per_token_costs(model, args.positions)
    if not args.skip_decoding:
        results += decoding(model, args)
    write_results(args.out, {"benchmark": "sampling_draw", "machine": machine(), "threads": args.threads,
                             "args": {k: str(v) for k, v in vars(args).items()}}, results)


if __name__ == "__main__":
    main()
