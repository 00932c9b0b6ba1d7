"""A GGUF file decoded with its layers kept quantized (`dtype` unset) against the same file
dequantized to bf16 (`dtype="bfloat16"`): AR greedy decode tokens/s at each prompt length,
both models in one process, their runs interleaved (order alternating per round).

    python benchmarks/ab/quantized_ab.py --gguf /tmp/gemma-3-270m-q4_k_m.gguf --contexts 1024 4096 \
        --new-tokens 128 --rounds 3 --threads 2 --out benchmarks/results/$(date +%F)-quantized-ab

Prints per round the tokens/s of each and the load average; then the medians and their ratio.
--steps N also times N decode steps of each (a 1-token forward over `context` committed keys
and its decision), alternating model by model step by step: on a machine shared with other
work the lower quartile of many short interleaved samples is steadier than whole decodes.
The steps compare three models: the quantized target (`quantized`: its head the gguf_linear
product of the file's own rows, for Gemma the Q8_0 codes read directly), the previous quantized
step (quantized layers, a bf16 copy of the head and its int8 certified screen: `dense-head`),
and the bf16 model.

    python benchmarks/ab/quantized_ab.py --gguf /tmp/gemma-3-270m-q4_k_m.gguf --rss 512

    python benchmarks/ab/quantized_ab.py --gguf /tmp/gemma-3-270m-q4_k_m.gguf --head 400

--head N: the heads alone, N decisions of each alternated on one final hidden row: the file head
(the full gguf_linear product and its argmax), the previous dense head's int8 certified screen,
and the full bf16 head. --rss N: only the quantized model, in this process: resident memory after the load, after
its certified head is built, and after an N-token generation, beside the file's size.
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
    parser.add_argument("--rss", type=int, default=0)
    parser.add_argument("--head", type=int, default=0)
    args = parser.parse_args()
    import torch

    if args.rss:
        return report_memory(args.gguf, args.rss, args.threads)
    if args.head:
        torch.set_num_threads(args.threads)
        return head_rows(args.gguf, args.head)

    sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py
    from common import prompt_ids, stdlib_source_text

    import longspec
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
        decoders = {"quantized": models["quantized"].model, "dense-head": dense_head(args.gguf),
                    "bf16": models["bf16"].model}
        for context in args.contexts:
            rows += step_rows(decoders, context, args.steps)
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
    q = next(r for r in rows if r["variant"] == "quantized")
    for other in rows:
        if other is not q:
            print(f"decode step at {context}: quantized {q['ms_lower_quartile']:.2f} ms, {other['variant']} "
                  f"{other['ms_lower_quartile']:.2f} ms (lower quartiles), {other['variant']} / quantized "
                  f"{other['ms_lower_quartile'] / q['ms_lower_quartile']:.2f}x", flush=True)
    return rows


def head_rows(gguf: Path, samples: int) -> None:
    """Each head's decision on one real final hidden row, alternated sample by sample."""
    import time

    import torch

    from longspec.runtime.argmax import row_argmax
    from longspec.runtime.linear import packed_linear

    quantized, dense = quantized_target(gguf), dense_head(gguf)
    ids = torch.tensor([[2] + [1000 + (i * 7) % 50 for i in range(40)]])
    hidden = quantized(ids, quantized.new_cache(64), with_logits=False).hidden[0, -1:]
    certified = dense.certified_head
    heads = {"file-head": lambda: row_argmax(quantized.logits(hidden)),
             "dense-int8-screen": lambda: certified.argmax(hidden, dense.logits),
             "dense-bf16-full": lambda: row_argmax(packed_linear(hidden, dense.head_weight, dense.packed_head))}
    tokens = {name: int(head()[0]) for name, head in heads.items()}
    times = {name: [] for name in heads}
    for _ in range(samples):
        for name, head in heads.items():
            start = time.perf_counter()
            head()
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        values.sort()
        print(json.dumps({"head": name, "ms_min": 1e3 * values[0], "ms_lower_quartile": 1e3 * values[len(values) // 4],
                          "ms_median": 1e3 * statistics.median(values), "token": tokens[name],
                          "load_average": os.getloadavg()[0]}), flush=True)


def quantized_target(gguf):
    from longspec.runtime.loading import load_target

    return load_target(gguf).model


def dense_head(gguf):
    """The quantized layers with a bf16 copy of the (tied) head and its int8 certified head:
    the quantized step before the file head."""
    import torch

    model = quantized_target(gguf)
    model.embed_weight = torch.nn.Parameter(model.file_embedding.dense(), requires_grad=False)
    model.file_head = None
    return model.prepare()


def report_memory(gguf: Path, tokens: int, threads: int) -> None:
    import torch

    import longspec
    from longspec.speculation.engine import EngineOptions

    def rss_mb() -> dict:
        """Resident memory: anonymous (what the process holds) and file-backed (the GGUF file's
        mapped pages it has read: the kernel may drop them)."""
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon", "RssFile")}

    torch.set_num_threads(threads)
    before = rss_mb()
    model = longspec.load(gguf, engine=EngineOptions(progress=False))
    decoder = model.model
    after_load = rss_mb()
    head = decoder.certified_head
    weights = sum(w.nbytes for layer in decoder.layers for w in layer.quantized.values())
    weights += sum(p.numel() * p.element_size() for p in decoder.parameters() if 0 not in p.stride())
    weights += decoder.packed_head.quantized.nbytes + (0 if head is None else head.nbytes)
    result = model.generate("Write a long story about a lighthouse keeper.", max_new_tokens=tokens, ignore_eos=True)
    row = {"file_mb": gguf.stat().st_size / 2**20, "weights_mb": weights / 2**20, "rss_before_load_mb": before,
           "rss_after_load_mb": after_load, "rss_after_generation_mb": rss_mb(), "new_tokens": result.stats.new_tokens,
           "head": type(head).__name__}
    row["weights_over_file"] = row["weights_mb"] / row["file_mb"]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
