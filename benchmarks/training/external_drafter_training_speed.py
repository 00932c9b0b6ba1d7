"""Training speed of the external drafters `longspec train` builds: tokens per second of
one forward + backward, for the Mamba drafter through `transformers`' own forward (its
CPU path steps through time in Python), the same Mamba through the native selective
scan (`MambaSequenceLM`, what `train mamba` runs), and the small transformer drafter
of about the same parameter count.

    python benchmarks/training/external_drafter_training_speed.py --threads 1

Weights do not change the cost, so the drafters are freshly initialised over a
32k-token reduced vocabulary (the default of `train mamba` / `train draft-model`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine, write_results
from longspec.speculation.drafters.mamba.sequence import MambaSequenceLM
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.training.external_drafter import mamba_drafter, transformer_drafter


def step_seconds(forward, parameters, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of a forward + backward of the next-token loss over `ids`."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        logits = forward(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        times.append(time.perf_counter() - start)
        for p in parameters:
            p.grad = None
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/external_drafter_training_speed.jsonl"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = VocabMap(torch.arange(args.vocab), args.vocab + 1)
    mamba = mamba_drafter(vocab)
    small = transformer_drafter(vocab, SimpleNamespace(max_position_embeddings=args.seq_len))  # reads only that
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    native = MambaSequenceLM(mamba)
    drafters = {
        "mamba, transformers' forward": (lambda x: mamba(input_ids=x).logits, mamba),
        "mamba, native scan": (lambda x: native(input_ids=x).logits, mamba),
        "transformer drafter": (lambda x: small(input_ids=x).logits, small),
    }
    rows = []
    for name, (forward, model) in drafters.items():
        seconds = step_seconds(forward, list(model.parameters()), ids, args.repeats)
        params = sum(p.numel() for p in model.parameters())
        rows.append({"drafter": name, "parameters": params, "tokens_per_s": ids.numel() / seconds})
        print(f"{name}: {params / 1e6:.1f}M parameters, {ids.numel() / seconds:.0f} tokens/s (forward + backward)",
              flush=True)
    write_results(args.out, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}, rows)


if __name__ == "__main__":
    main()
