"""Two sources of the attention kernel against each other on a target forward's own calls:
the arguments of `ordered_attention` are captured from a forward of Gemma 3 270M over a
real prompt (one sliding-window layer, one global layer), then each kernel is called on
them in turns (warm caches), and whole forwards with every row's decision are timed with
each kernel in turns.

    git show REV:src/longspec/runtime/kernels/few_query_attention.cpp > /tmp/old.cpp
    python benchmarks/ab/attention_kernel_ab.py --baseline-source /tmp/old.cpp \
        --book ../shared/data/books/pg19_frank_merriwell_down_south.txt --tokens 1 2 4 16

Prints µs per call and ms per forward (medians), new / old; writes JSON lines to --out.
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
import longspec.runtime.model as model_module
import longspec.runtime.ordered_keys as ordered_keys
from common import baseline_library, machine, prompt_ids, write_results
from longspec.speculation.decode_round import prefill_piece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-source", type=Path, required=True, help="the old few_query_attention.cpp")
    parser.add_argument("--book", type=Path, required=True, help="a plain-text file; the prompt is its opening")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 5], help="Gemma 3: 0 sliding, 5 global")
    parser.add_argument("--calls", type=int, default=41)
    parser.add_argument("--forwards", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-out/attention_kernel_ab.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = baseline_library(args.baseline_source, "longspec_baseline_attention")
    new = ordered_keys.attention_ops()
    loaded = longspec.load()
    model = loaded.model
    ids = prompt_ids(loaded.tokenizer, args.book.read_text(), args.context)
    cache = model.new_cache(ids.numel() + max(args.tokens) + 1, max_forward_tokens=256)
    captured = []
    calls = model_module.ordered_attention

    def capture(q, k, v, keys, scale):
        captured.append((q.contiguous().clone(), k, v, keys, scale))
        return calls(q, k, v, keys, scale)

    rows = []
    with torch.inference_mode():
        for begin in range(0, ids.numel() - 1, 256):  # the prompt but its last token, as the engine prefills it
            prefill_piece(model, cache, ids, begin, min(begin + 256, ids.numel() - 1), keep_from=ids.numel())
        tokens = torch.cat([ids[-1:], torch.arange(1000, 1000 + max(args.tokens))])
        model.decide(model(tokens[:1].unsqueeze(0), cache, with_logits=False).hidden[0])  # builds the certified head
        cache.drop_pending()
        print("| tokens | layer | keys | old µs | new µs | new / old |\n|---|---|---|---|---|---|")
        for T in args.tokens:
            positions = cache.length + torch.arange(T)
            captured.clear()
            model_module.ordered_attention = capture
            model(tokens[:T].unsqueeze(0), cache, positions=positions, with_logits=False)
            model_module.ordered_attention = calls
            cache.drop_pending()
            for layer in args.layers:
                q, k, v, keys, scale = captured[layer]
                call = (q, k, v, keys.slots, keys.positions, keys.counts, keys.shared, keys.visible, keys.chunk, scale)
                times = {"old": [], "new": []}
                for _ in range(args.calls):
                    for name, ops in (("old", old), ("new", new)):
                        start = time.perf_counter()
                        ops.ordered_attention(*call)
                        times[name].append(time.perf_counter() - start)
                o, n = (1e6 * statistics.median(times[name]) for name in ("old", "new"))
                rows.append({"kind": "call", "tokens": T, "layer": layer, "keys": int(keys.counts[0]), "old_us": o,
                             "new_us": n, "ratio": n / o})
                print(f"| {T} | {layer} | {int(keys.counts[0])} | {o:.1f} | {n:.1f} | {n / o:.2f} |", flush=True)
        print("\n| tokens | old ms a forward | new ms | new / old |\n|---|---|---|---|")
        for T in args.tokens:
            positions = cache.length + torch.arange(T)
            times = {"old": [], "new": []}
            for turn in range(args.forwards):
                order = (("old", old), ("new", new)) if turn % 2 else (("new", new), ("old", old))
                for name, ops in order:
                    ordered_keys.attention_ops = lambda ops=ops: ops
                    start = time.perf_counter()
                    out = model(tokens[:T].unsqueeze(0), cache, positions=positions, with_logits=False)
                    model.decide(out.hidden[0])
                    times[name].append(time.perf_counter() - start)
                    cache.drop_pending()
            o, n = (1e3 * statistics.median(times[name]) for name in ("old", "new"))
            rows.append({"kind": "forward", "tokens": T, "old_ms": o, "new_ms": n, "ratio": n / o})
            print(f"| {T} | {o:.2f} | {n:.2f} | {n / o:.3f} |", flush=True)
    header = {"benchmark": "attention_kernel_ab", "machine": machine(), "book": args.book.name, "context": ids.numel(),
              "threads": args.threads, "baseline_source": str(args.baseline_source), "time": time.ctime()}
    write_results(args.out, header, rows)


if __name__ == "__main__":
    main()
