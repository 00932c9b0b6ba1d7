"""Score external drafters (Mamba, small transformer) side by side on held-out rows:
how often a drafter's top token is the target's greedy next token (teacher-forced, the
first drafted token's acceptance under greedy decoding).

    python benchmarks/training/external_drafter_agreement.py --shards runs/external-drafter-shards \
        runs/mamba-gemma270m runs/draft-model-gemma270m src/longspec/weights/mamba-gemma-3-270m

Rows start with what the tokenizer puts before a served prompt (BOS), as served
sequences do, and come from the held-out split (files never trained on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py

from common import machine
from longspec.runtime.loading import load_target
from longspec.speculation.drafters.mamba.sequence import MambaSequenceLM
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.training.data import load_split, prefixed_rows, served_prefix


def drafter_logits(model, ids: torch.Tensor) -> torch.Tensor:
    forward = MambaSequenceLM(model) if model.config.model_type == "mamba" else model
    return forward(input_ids=ids).logits


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", type=Path, nargs="+", help="drafter directories (config.json, model.safetensors, "
                                                                 "longspec-vocab.json)")
    parser.add_argument("--shards", type=Path, required=True, help="token shards with train and held-out splits")
    parser.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype (labels are its greedy tokens)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/external_drafter_agreement.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=getattr(torch, args.dtype))
    rows = prefixed_rows(load_split(args.shards, "heldout"), args.seq_len, served_prefix(target.tokenizer))[: args.rows]
    labels = []
    for row in rows:
        cache = target.model.new_cache(row.numel(), max_forward_tokens=row.numel())
        hidden = target.model(row.unsqueeze(0), cache, with_logits=False).hidden[0]
        labels.append(target.model.greedy_tokens(hidden))
    labels = torch.stack(labels)[:, 1:]  # the BOS position's label never counts
    results = {"machine": machine(), "rows": rows.shape[0], "seq_len": args.seq_len, "drafters": {}}
    for directory in args.drafters:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        vocab = VocabMap.load(directory)
        logits = drafter_logits(model, vocab.to_draft(rows))[:, 1:, : vocab.other]  # never the "other" id
        agreement = float((vocab.to_target(logits.argmax(-1)) == labels).double().mean())
        params = sum(p.numel() for p in model.parameters())
        results["drafters"][str(directory)] = {"model_type": model.config.model_type, "parameters": params,
                                               "vocabulary": vocab.draft_vocab_size, "agreement": agreement}
        print(f"{directory}: {model.config.model_type}, {params / 1e6:.1f}M parameters, {vocab.draft_vocab_size} ids; "
              f"agreement with the target's greedy token {agreement:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
