"""Turn a LongSpec training run's draft into the shipped file: bfloat16 weights, the
run's step and options in its meta, and a cross-attention window equal to the
training rows' length (the draft never saw a key further back than that, besides the
anchors, so training semantics are unchanged and a draft step stops growing with the
context).

    python benchmarks/recipes/ship_draft.py runs/longspec-gemma270m-v3/draft.safetensors \
        src/longspec/weights/longspec-gemma-3-270m.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from longspec.speculation.drafters.longspec.checkpoint import load_draft, load_meta, save_draft
from longspec.speculation.drafters.longspec.model import DraftModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_draft", type=Path, help="the run's draft.safetensors (with its .json)")
    parser.add_argument("out", type=Path, help="shipped .safetensors path")
    parser.add_argument("--cross-window", type=int, default=None,
                        help="default: the run's seq_len (keeps an explicit window the run already has)")
    args = parser.parse_args()
    draft = load_draft(args.run_draft)
    meta = load_meta(args.run_draft)
    config = draft.config
    window = args.cross_window or config.cross_window or meta["options"]["seq_len"]
    if config.cross_window is None and window < meta["options"]["seq_len"]:
        raise SystemExit(f"a window of {window} is shorter than the training rows ({meta['options']['seq_len']}): "
                         "it would change what the draft was trained to read")
    shipped = DraftModel(dataclasses.replace(config, cross_window=window))
    shipped.load_state_dict(draft.state_dict())
    save_draft(shipped, args.out, meta={**meta, "source": str(args.run_draft)}, dtype=torch.bfloat16)
    print(f"wrote {args.out} (step {meta.get('step')}, cross window {window})")


if __name__ == "__main__":
    main()
