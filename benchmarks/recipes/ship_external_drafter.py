"""Turn an external drafter's training run (`longspec train mamba` / `train draft-model`)
into the shipped directory: bfloat16 weights, and optionally its vocabulary cut to the
K most frequent training tokens (the target's EOS ids kept), which shrinks the
embedding (tied to the output layer) that dominates a small drafter's size. A target
token outside the kept ones reads as the drafter's "other" id, as tokens outside the
trained vocabulary always did; the drafter just never proposes it. Score the result
with `external_drafter_agreement.py` beside the run.

    python benchmarks/recipes/ship_external_drafter.py runs/mamba-gemma270m src/longspec/weights/mamba-gemma-3-270m \
        --shards runs/external-drafter-shards --keep 16384
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from longspec.runtime.loading import load_target
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.training.data import load_split, token_frequencies
from longspec.training.external_drafter import cut_vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory (config.json, model.safetensors, longspec-vocab.json)")
    parser.add_argument("out", type=Path, help="shipped directory (replaced)")
    parser.add_argument("--keep", type=int, default=None, help="tokens the shipped drafter keeps (default: all)")
    parser.add_argument("--shards", type=Path, default=None, help="the run's token shards (for --keep's frequencies)")
    parser.add_argument("--model", default=None, help="the target (default: embedded Gemma 3 270M): its EOS ids "
                                                      "are always kept")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(str(args.run), dtype=torch.float32)
    vocab = VocabMap.load(args.run)
    if args.keep is not None:
        if args.shards is None:
            raise ValueError("--keep needs --shards (the training tokens' frequencies)")
        frequencies = token_frequencies(load_split(args.shards, "train"), vocab.target_vocab_size)
        eos = load_target(args.model).model.config.eos_token_ids
        vocab = cut_vocabulary(model, vocab, frequencies, args.keep, list(eos))
    state = torch.load(args.run / "trainer_state.pt", weights_only=False, map_location="cpu")
    if args.out.exists():
        shutil.rmtree(args.out)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    vocab.save(args.out)
    meta = {"trained_steps": state["step"], "options": state["options"], "vocabulary_kept": vocab.draft_vocab_size,
            "source_run": args.run.name}
    (args.out / "longspec-training.json").write_text(json.dumps(meta, indent=1))
    print(f"shipped {args.run} (step {state['step']}) to {args.out}: {vocab.draft_vocab_size} ids, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
