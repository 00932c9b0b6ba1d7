"""Cost of the LongSpec draft against the target it drafts for, by context length:
one draft step (a 1-token draft forward and its reduced head) and one chain round
(catch-up over the committed tokens, then the chain's steps), each relative to one
target decode forward measured in the same run. The first round of a request, which
also catches the draft up on the prompt's last window (once, like a prefill), is
reported apart; the chain round is the mean of the rounds after it.

    python benchmarks/micro/longspec_step_cost.py --draft RUN/draft.safetensors --contexts 1024 4096 16384 --threads 1

The draft's own state is constant in the context; what grows is the target K/V its
cross-attention reads (all committed keys, or the sinks and a window when the draft
has `cross_window`). Prompts are standard-library source (on every machine).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

import longspec
from common import machine, stdlib_source_text, write_results
from longspec.bench.floor import read_bandwidth_gbs
from longspec.speculation.presets.longspec import make_longspec


def draft_bytes_per_step(drafter) -> int:
    """Weights one draft step reads: its layers plus the head rows it scores."""
    draft = drafter.draft
    layers = sum(p.numel() * p.element_size() for p in draft.layers.parameters())
    fuse = sum(p.numel() * p.element_size() for n, p in draft.named_parameters() if n.startswith("hidden_"))
    scored = len(drafter._vocab) if drafter._vocab is not None else drafter._head_rows.shape[0]
    head = scored * drafter._head_rows.shape[1] * drafter._head_rows.element_size()
    return layers + fuse + head


def measure(model, ids: list[int], checkpoint: Path, length: int, new_tokens: int, repeats: int,
            context_vocab: bool = False) -> dict:
    ar = model.generate(ids, max_new_tokens=new_tokens, method="ar", ignore_eos=True).stats
    target_s = ar.decode_s / ar.target_forwards
    drafter = make_longspec(strategy="chain", checkpoint=checkpoint, length=length, context_vocab=context_vocab)
    contexts, rounds = [], []
    original = drafter.propose

    def recording(context):
        contexts.append(context)
        start = time.perf_counter()
        tree = original(context)
        rounds.append(time.perf_counter() - start)
        return tree

    drafter.propose = recording
    stats = model.generate(ids, max_new_tokens=new_tokens, method=drafter, ignore_eos=True).stats
    # The first round also catches the draft up on the prompt's last window (once per
    # request, like a prefill); the rounds after it are what decoding pays each round.
    first_s, round_s = rounds[0], statistics.mean(rounds[1:])
    # A repeated propose finds nothing new to catch up on: its time is the chain's
    # length - 1 expansion steps alone.
    last = contexts[-1]
    for _ in range(2):
        original(last)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        original(last)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times) / (length - 1)
    return {
        "context": len(ids), "target_forward_ms": 1e3 * target_s, "draft_step_ms": 1e3 * step_s,
        "chain_round_ms": 1e3 * round_s, "step_vs_target": step_s / target_s, "round_vs_target": round_s / target_s,
        "first_round_ms": 1e3 * first_s,
        "tau": stats.tau, "draft_step_bytes": draft_bytes_per_step(drafter), "context_vocab": context_vocab,
        "scored_tokens": len(drafter._vocab) if drafter._vocab is not None else drafter._head_rows.shape[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="draft .safetensors (with its .json)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--length", type=int, default=5, help="chain length (draft steps per round)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--heads", nargs="+", choices=["draft-vocab", "context-vocab"], default=["draft-vocab"],
                        help="what the draft's head scores: its whole vocabulary, or the part the sequence used "
                             "(each measured in the same run)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/longspec_step_cost.jsonl"))
    args = parser.parse_args()
    if args.length < 2:
        parser.error("--length must be >= 2 (a chain with at least one expansion step)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = longspec.load(dtype=args.dtype)
    text = stdlib_source_text(max(args.contexts) * 6, skip=40)
    ids = model.tokenizer(text).input_ids
    if len(ids) < max(args.contexts):
        raise SystemExit(f"the corpus gave {len(ids)} tokens, fewer than {max(args.contexts)}")
    bandwidth = read_bandwidth_gbs()
    rows = []
    for context, heads in itertools.product(args.contexts, args.heads):
        row = measure(model, ids[:context], args.draft, args.length, args.new_tokens, args.repeats,
                      context_vocab=heads == "context-vocab")
        row["draft_step_floor_ms"] = 1e3 * row["draft_step_bytes"] / (bandwidth * 1e9)
        rows.append(row)
        print(f"context {context:6d}, {heads} ({row['scored_tokens']} tokens): target forward {row['target_forward_ms']:6.1f} ms | "
              f"draft step {row['draft_step_ms']:5.2f} ms ({row['step_vs_target']:.3f}x, weight floor "
              f"{row['draft_step_floor_ms']:.2f} ms) | chain round {row['chain_round_ms']:5.1f} ms "
              f"({row['round_vs_target']:.2f}x; the first, with the prompt's window, {row['first_round_ms']:.0f} ms) | "
              f"tau {row['tau']:.2f}", flush=True)
    for heads in args.heads:
        mine = [row for row in rows if row["context_vocab"] == (heads == "context-vocab")]
        for row in mine[1:]:
            print(f"{heads}, context {row['context']} vs {mine[0]['context']}: draft step "
                  f"{row['draft_step_ms'] / mine[0]['draft_step_ms']:.2f}x, chain round "
                  f"{row['chain_round_ms'] / mine[0]['chain_round_ms']:.2f}x")
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                             "read_bandwidth_gbs": bandwidth}, rows)


if __name__ == "__main__":
    main()
