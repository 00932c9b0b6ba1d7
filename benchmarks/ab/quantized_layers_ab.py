"""A decode step of a GGUF file's model, layer side: the quantized layers in the fused native
layer steps, the same layers unfused (every norm, RoPE, activation and residual a PyTorch op
of its own) and the file dequantized to bf16 (fused), in one process, steps alternating
variant by variant; then the step's floor (bytes it reads over the measured streaming read
bandwidth) and a profile of the quantized step: the share of its forward spent in the
products, the rest (norms, RoPE, attention, dispatch) and the head's decision.

    python benchmarks/ab/quantized_layers_ab.py --gguf /tmp/gemma-3-270m-q4_k_m.gguf \
        --contexts 1024 4096 --steps 200 --threads 2 --out benchmarks/results/$(date +%F)-quantized-layers

Times are lower quartiles of single steps (a step that lost a core waits out a scheduler tick;
averages swallow those waits); the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PRODUCTS = ("longspec_native::gguf_linear", "longspec_native::bf16_packed_linear")


def layer_bytes(decoder) -> int:
    """Bytes of the layer products' weights a step reads (quantized segments or bf16 tiles)."""
    total = 0
    for layer in decoder.layers:
        for packed in layer.packed.values():
            if packed.quantized is not None:
                total += packed.quantized.nbytes
            elif packed.tiles is not None:
                total += packed.tiles.numel() * packed.tiles.element_size()
    return total


def head_bytes(decoder) -> int:
    """Bytes a greedy decision reads: the certified head's screen where the model has one, else
    the whole head (a quantized target's file rows, read in full by default)."""
    head = decoder.certified_head
    if head is not None:
        return head.nbytes
    packed = decoder.packed_head
    if packed is not None and packed.quantized is not None:
        return packed.quantized.nbytes
    return decoder.head_weight.numel() * decoder.head_weight.element_size()


class Unfused:
    """A decoder run with its native layer steps off (set off around each call, then back)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def __call__(self, *args, **kwargs):
        steps = [layer.native_steps for layer in self.decoder.layers]
        for layer in self.decoder.layers:
            layer.native_steps = None
        try:
            return self.decoder(*args, **kwargs)
        finally:
            for layer, ops in zip(self.decoder.layers, steps):
                layer.native_steps = ops


def steps(decoders: dict, context: int, count: int) -> list[dict]:
    """Decode steps (a 1-token forward over `context` committed keys, then its decision) of each
    decoder, alternating; the forward and the decision timed apart."""
    import torch

    from longspec.speculation.cost_model import commit_random_keys

    caches = {}
    for name, decoder in decoders.items():
        caches[name] = decoder.new_cache(context + 2, max_forward_tokens=512)
        commit_random_keys(decoder, caches[name], context, chunk=512)
    token = torch.tensor([[1000]])
    samples = {name: ([], []) for name in decoders}
    for step in range(count + 3):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            hidden = decoder(token, caches[name], with_logits=False).hidden[0]
            middle = time.perf_counter()
            decoder.decide(hidden)
            end = time.perf_counter()
            caches[name].drop_pending()
            if step >= 3:
                samples[name][0].append(middle - start)
                samples[name][1].append(end - start)
    rows = []
    for name, (forward, whole) in samples.items():
        forward.sort(), whole.sort()
        row = {"variant": name, "context": context, "steps": count, "ms_step": 1e3 * whole[len(whole) // 4],
               "ms_forward": 1e3 * forward[len(forward) // 4], "ms_step_median": 1e3 * statistics.median(whole),
               "load_average": os.getloadavg()[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile(decoder, context: int, count: int) -> dict:
    """Share of the forward in the products (self time of the product ops, wherever called:
    from the fused layer steps too) over `count` quantized steps."""
    import torch

    from longspec.speculation.cost_model import commit_random_keys

    cache = decoder.new_cache(context + 2, max_forward_tokens=512)
    commit_random_keys(decoder, cache, context, chunk=512)
    token = torch.tensor([[1000]])
    for _ in range(3):
        decoder(token, cache, with_logits=False)
        cache.drop_pending()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(count):
            decoder(token, cache, with_logits=False)
            cache.drop_pending()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCTS) / 1e6
    calls = sum(e.count for e in events) / count
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    row = {"variant": "quantized-profile", "context": context, "ms_forward_profiled": 1e3 * wall / count,
           "ms_products": 1e3 * products / count, "share_outside_products": 1 - products / wall,
           "ops_per_forward": calls, "top_self_ms": {e.key: round(e.self_cpu_time_total / 1e3 / count, 3) for e in top},
           "load_average": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    import longspec
    from longspec.speculation.engine import EngineOptions

    torch.set_num_threads(args.threads)
    options = EngineOptions(progress=False)
    quantized = longspec.load(args.gguf, engine=options).model
    bf16 = longspec.load(args.gguf, dtype="bfloat16", engine=options).model
    assert all(layer.native_steps is not None for layer in quantized.layers), "the quantized layers are not fused"
    decoders = {"quantized": quantized, "quantized-unfused": Unfused(quantized), "bf16": bf16}
    from longspec.bench.floor import read_bandwidth_gbs

    bandwidth = 1e9 * read_bandwidth_gbs()
    rows = []
    for name in ("quantized", "bf16"):
        decoder = decoders[name]
        layers, head = layer_bytes(decoder), head_bytes(decoder)
        row = {"variant": name, "layer_mb": layers / 1e6, "head_mb": head / 1e6, "read_gb_s": bandwidth / 1e9,
               "floor_ms": 1e3 * (layers + head) / bandwidth, "layers_floor_ms": 1e3 * layers / bandwidth}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for context in args.contexts:
        measured = steps(decoders, context, args.steps)
        rows += measured + [profile(quantized, context, max(20, args.steps // 4))]
        ms = {r["variant"]: r["ms_step"] for r in measured}
        print(f"context {context}: step ms quantized {ms['quantized']:.2f}, unfused {ms['quantized-unfused']:.2f}, "
              f"bf16 {ms['bf16']:.2f}; unfused / fused {ms['quantized-unfused'] / ms['quantized']:.2f}x, "
              f"bf16 / quantized {ms['bf16'] / ms['quantized']:.2f}x", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantized_layers_ab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
