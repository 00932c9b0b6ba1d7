"""Cost of Mamba tree drafting by batched states against a chain of the same depth,
and drafter state memory by context length (Mamba against a transformer drafter).

    python benchmarks/micro/mamba_drafting.py --threads 1

Weights do not change what a draft round costs, so the drafter is a randomly
initialised Mamba the size of the paper's (mamba-130m: 24 layers, d_model 768, state
16; `--layers 8 --hidden 256` is the drafter `train mamba` builds) with a 32k
vocabulary (the reduced drafter vocabulary a 262k-vocabulary target needs).
`transformers_chain_ms` times the same chain stepped through `transformers`' own
decoding step and cache (what the drafter ran before its states and step moved to
`drafters/mamba/state.py`), in the same run. The memory table sets the Mamba state
beside the KV caches of the small transformer drafter and of Gemma 3 270M itself.
Acceptance is `external_drafters.py`'s; this measures the mechanics.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import MambaConfig, MambaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine, write_results
from longspec.speculation.drafters.base import DraftContext
from longspec.speculation.drafters.draft_model import DraftModelDrafter
from longspec.speculation.drafters.mamba import PAPER_TREES, MambaDrafter, tree_nodes


def round_seconds(drafter: MambaDrafter, tokens: torch.Tensor, repeats: int) -> float:
    """Median seconds of one propose after the catch-up (the tree's own drafting)."""
    drafter.begin(DraftContext(tokens, None, 256))
    drafter.propose(DraftContext(tokens, None, 256))  # catch-up over the prompt
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        drafter.propose(DraftContext(tokens, None, 256))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.inference_mode()
def transformers_chain_seconds(mamba, tokens: torch.Tensor, depth: int, repeats: int) -> float:
    """Median seconds of `depth - 1` single-token steps of `transformers`' Mamba from a
    cached prompt state, each followed by its argmax (a chain round's drafting)."""
    cache = mamba(tokens.unsqueeze(0), use_cache=True).cache
    times = []
    for _ in range(repeats + 1):
        token = tokens[-1:].unsqueeze(0)
        start = time.perf_counter()
        for _ in range(depth - 1):
            logits = mamba(token, cache=cache, use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--draft-model", default=None,
                        help="small transformer drafter directory for the memory table (default: the shipped one)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the drafter's weights (its recurrence runs in float32 either way)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/mamba_drafting.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = MambaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, state_size=16,
                         expand=2, conv_kernel=4)
    mamba = MambaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    tokens = torch.randint(0, args.vocab, (args.prompt,))
    rows = []
    for widths in PAPER_TREES:
        chain = (1,) * len(widths)
        tree_s = round_seconds(MambaDrafter(mamba, widths=widths), tokens, args.repeats)
        chain_s = round_seconds(MambaDrafter(mamba, widths=chain), tokens, args.repeats)
        reference_s = transformers_chain_seconds(mamba, tokens, len(widths), args.repeats)
        row = {"widths": list(widths), "nodes": tree_nodes(widths), "depth": len(widths), "tree_ms": 1e3 * tree_s,
               "chain_ms": 1e3 * chain_s, "tree_vs_chain": tree_s / chain_s, "transformers_chain_ms": 1e3 * reference_s}
        rows.append(row)
        print(f"tree {widths} ({row['nodes']} nodes): {row['tree_ms']:.1f} ms, chain of {len(widths)}: "
              f"{row['chain_ms']:.1f} ms -> {row['tree_vs_chain']:.2f}x; transformers' step, chain: "
              f"{row['transformers_chain_ms']:.1f} ms", flush=True)

    import longspec

    target = longspec.load(dtype="bfloat16").model
    small = DraftModelDrafter(args.draft_model).model.to(torch.bfloat16)  # its KV cache is its state
    drafter = MambaDrafter(mamba, widths=(1,))
    for context in args.contexts:
        drafter.begin(DraftContext(tokens, None, 8))
        drafter.propose(DraftContext(tokens, None, 8))
        mamba_bytes = drafter.state_nbytes()  # constant: it never depends on how many tokens were seen
        small_bytes = small.new_cache(context, max_forward_tokens=1).nbytes()
        target_bytes = target.new_cache(context, max_forward_tokens=1).nbytes()
        rows.append({"context": context, "mamba_state_bytes": mamba_bytes, "draft_model_cache_bytes": small_bytes,
                     "target_cache_bytes": target_bytes})
        print(f"context {context}: Mamba state {mamba_bytes / 2**20:.2f} MiB, small transformer drafter's KV cache "
              f"{small_bytes / 2**20:.1f} MiB, Gemma 3 270M KV cache {target_bytes / 2**20:.1f} MiB", flush=True)
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}, rows)


if __name__ == "__main__":
    main()
