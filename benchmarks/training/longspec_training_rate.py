"""What training the LongSpec draft costs per token on this machine, against its floor.

    python benchmarks/training/longspec_training_rate.py --threads 2 --out bench-out/training-rate.jsonl

Measures, on 512-token rows of standard-library code (BOS first, as training rows are):

* the target's features: its body over the row (the K/V the draft reads and the final
  hidden states), and the self-distilled labels (the greedy token at every position over
  the 262k vocabulary) through the packed head a few rows at a time and, for
  comparison, through slices of the plain head;
* the draft's own training step (forward, backward, AdamW) over cached features, with
  its matmuls in float32 and under bf16 autocast;
* the floor: the FLOPs a token costs (2 per weight of the body, 2 x H x V for the head)
  over the best matmul rate measured here (the bf16 head product, a float32 GEMM, and
  what the body and the labels reached).

A first epoch costs features + steps per token; a later epoch over cached features costs
the steps alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import code_file_prompt, machine
from longspec.runtime.linear import packed_linear
from longspec.runtime.loading import load_target
from longspec.speculation.drafters.longspec import load_draft
from longspec.speculation.presets.longspec import shipped_draft_path
from longspec.training.data import served_prefix
from longspec.training.longspec.features import target_features
from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(target, tokens, prefix, seq_len: int, autocast: bool, steps: int, cache: Path, out: Path) -> float:
    """Median seconds of one training step (batch of one row) once its features are cached."""
    # One row per epoch: after the first step every step reads its cached features.
    options = TrainOptions(steps=steps + 1, seq_len=seq_len, batch_size=1, warmup=1, save_every=10 ** 9,
                           bf16_autocast=autocast, row_prefix=prefix, max_rows=1)
    trainer = LongSpecTrainer(target, tokens, out, options, init_from=shipped_draft_path(), feature_cache=cache,
                              progress=False)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        trainer.train_step()
        trainer.step += 1
        trainer.position += 1
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first step may compute features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per setting")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSONL of the measurements")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_target(None, dtype=torch.bfloat16)
    target, n = loaded.model, args.seq_len
    prefix = tuple(served_prefix(loaded.tokenizer))
    body = code_file_prompt(loaded.tokenizer, n * 4)[: n * 4 - len(prefix)]
    row = torch.cat([torch.tensor(prefix), body[: n - len(prefix)]])
    positions = torch.arange(n)
    layers = tuple(load_draft(shipped_draft_path()).config.target_layers)

    def forward_body():
        return target(row.unsqueeze(0), target.new_cache(n, max_forward_tokens=n), positions=positions, with_logits=False)

    hidden = forward_body().hidden[0]
    body_s = timed(forward_body, args.repeats)
    packed_s = timed(lambda: target.greedy_tokens(hidden), args.repeats)
    packed_head = target._packed_head
    try:
        target._packed_head = None
        sliced_s = timed(lambda: target.greedy_tokens(hidden), max(1, args.repeats - 2))
    finally:
        target._packed_head = packed_head
    features_s = timed(lambda: target_features(target, row, positions, layers, self_distill=True), args.repeats)

    # The matmul rate this CPU reaches: the bf16 head product at 128 rows, a float32 GEMM,
    # and what the body and the labels themselves reached; the best of them bounds all.
    rows = hidden[:128].contiguous()
    head_s = timed(lambda: packed_linear(rows, target.head_weight, target._packed_head), args.repeats)
    vocab, width = target.head_weight.shape
    body_params = sum(p.numel() for layer in target.layers for p in layer.parameters())
    a, b = torch.randn(512, 2048), torch.randn(2048, 2048)
    gemm_s = timed(lambda: a @ b, args.repeats)
    rates = {"head_product": 2 * rows.shape[0] * vocab * width / head_s, "fp32_gemm": 2 * 512 * 2048 * 2048 / gemm_s,
             "body": 2 * body_params * n / body_s, "labels": 2 * vocab * width * n / packed_s}
    flops_per_token = 2 * body_params + 2 * vocab * width

    with tempfile.TemporaryDirectory() as tmp:
        step_s = {autocast: step_seconds(target, body, prefix, n, autocast, args.steps, Path(tmp) / "features",
                                         Path(tmp) / f"run-{autocast}") for autocast in (False, True)}

    result = {
        "benchmark": "longspec-training-rate", "machine": machine(), "threads": torch.get_num_threads(),
        "seq_len": n, "body_s": body_s, "labels_packed_head_s": packed_s, "labels_head_slices_s": sliced_s,
        "features_s": features_s, "features_tok_s": n / features_s,
        "step_fp32_s": step_s[False], "step_bf16_autocast_s": step_s[True],
        "gflops": {name: rate / 1e9 for name, rate in rates.items()}, "gflop_per_token": flops_per_token / 1e9,
        "floor_features_tok_s": max(rates.values()) / flops_per_token,
    }
    best_step = min(step_s.values())
    result["first_epoch_tok_s"] = n / (features_s + best_step)
    result["later_epoch_tok_s"] = n / best_step
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=1))
    print(f"\nmachine: {result['machine']}, {result['threads']} threads, {n}-token rows\n")
    print("| what | seconds per row | tokens/s |")
    print("|---|---|---|")
    for name, seconds in [("target body", body_s), ("labels, packed head", packed_s),
                          ("labels, plain head in vocabulary slices", sliced_s), ("features (body + labels)", features_s),
                          ("draft step, float32", step_s[False]), ("draft step, bf16 autocast", step_s[True]),
                          ("first epoch (features + best step)", features_s + best_step),
                          ("later epochs (best step over cached features)", best_step)]:
        print(f"| {name} | {seconds:.2f} | {n / seconds:.0f} |")
    rates_text = ", ".join(f"{name} {rate:.0f}" for name, rate in result["gflops"].items())
    print(f"\nGFLOP/s reached: {rates_text}. Floor for features: {result['gflop_per_token']:.2f} GFLOP/token at the best "
          f"of them = {result['floor_features_tok_s']:.0f} tokens/s")


if __name__ == "__main__":
    main()
