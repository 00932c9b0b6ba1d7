"""A GGUF file decoded with its layers kept quantized (`dtype` unset) against the same file
dequantized to bf16 (`dtype="bfloat16"`): AR greedy decode tokens/s at each prompt length,
both models in one process, their runs interleaved (order alternating per round).

    python benchmarks/ab/quantized_ab.py --gguf /tmp/gemma-3-270m-q4_k_m.gguf --contexts 1024 4096 \
        --new-tokens 128 --rounds 3 --threads 2 --out benchmarks/results/$(date +%F)-quantized-ab

Prints per round the tokens/s of each and the load average; then the medians and their ratio.
--steps N also times N decode steps of each (a 1-token forward over `context` committed keys
and its decision), alternating model by model step by step: on a machine shared with other
work the lower quartile of many short interleaved samples is steadier than whole decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["ar"])
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py
    import longspec
    from common import prompt_ids, stdlib_source_text
    from longspec.speculation.engine import EngineOptions

    torch.set_num_threads(args.threads)
    options = EngineOptions(progress=False)
    models = {"quantized": longspec.load(args.gguf, engine=options),
              "bf16": longspec.load(args.gguf, dtype="bfloat16", engine=options)}
    text = stdlib_source_text(8 * max(args.contexts))
    rows = []
    for context in args.contexts:
        prompt = prompt_ids(models["bf16"].tokenizer, text, context)
        for method in args.methods if args.rounds else []:
            for name, model in models.items():  # warm-up (and auto's cost model)
                model.generate(prompt, method=method, max_new_tokens=16)
            for round_ in range(args.rounds):
                order = list(models) if round_ % 2 == 0 else list(models)[::-1]
                for name in order:
                    result = models[name].generate(prompt, method=method, max_new_tokens=args.new_tokens, ignore_eos=True)
                    row = {"variant": name, "context": context, "method": method, "round": round_,
                           "tokens_per_s": result.stats.new_tokens / result.stats.decode_s,
                           "load_average": os.getloadavg()[0]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.steps:
        for context in args.contexts:
            rows += step_rows({name: m.model for name, m in models.items()}, context, args.steps)
    print("\ncontext method   quantized tok/s   bf16 tok/s   quantized / bf16")
    for context in args.contexts:
        for method in args.methods:
            runs = {name: [r["tokens_per_s"] for r in rows if r["variant"] == name and r["context"] == context
                           and r["method"] == method] for name in models}
            if not all(runs.values()):
                continue
            median = {name: statistics.median(values) for name, values in runs.items()}
            print(f"{context:7d} {method:8s} {median['quantized']:15.1f} {median['bf16']:12.1f} "
                  f"{median['quantized'] / median['bf16']:12.2f}x")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantized_ab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def step_rows(decoders: dict, context: int, steps: int) -> list[dict]:
    """Decode steps of each decoder over `context` random committed keys, interleaved."""
    import time

    import torch
    from longspec.speculation.cost_model import commit_random_keys

    caches = {}
    for name, decoder in decoders.items():
        caches[name] = decoder.new_cache(context + 2, max_forward_tokens=512)
        commit_random_keys(decoder, caches[name], context, chunk=512)
    token = torch.tensor([[1000]])
    samples = {name: [] for name in decoders}
    for step in range(steps + 3):
        for name, decoder in decoders.items():
            cache = caches[name]
            start = time.perf_counter()
            hidden = decoder(token, cache, with_logits=False).hidden[0]
            decoder.decide(hidden)
            elapsed = time.perf_counter() - start
            cache.drop_pending()
            if step >= 3:
                samples[name].append(elapsed)
    rows = []
    for name, times in samples.items():
        times.sort()
        quartile, median = times[len(times) // 4], statistics.median(times)
        row = {"variant": name, "context": context, "method": "decode-step", "ms_lower_quartile": 1e3 * quartile,
               "ms_median": 1e3 * median, "ms_min": 1e3 * times[0], "load_average": os.getloadavg()[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    q, b = (next(r for r in rows if r["variant"] == v) for v in ("quantized", "bf16"))
    print(f"decode step at {context}: quantized {q['ms_lower_quartile']:.2f} ms, bf16 {b['ms_lower_quartile']:.2f} ms "
          f"(lower quartiles), bf16 / quantized {b['ms_lower_quartile'] / q['ms_lower_quartile']:.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
