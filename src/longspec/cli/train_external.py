"""`longspec train mamba` and `longspec train draft-model`: an external drafter (a small
Mamba, or a small transformer run by `method="draft-model"`) for a frozen target,
over a reduced vocabulary, self-distilled from the target's greedy tokens; or a trained
drafter continued (`--init-from`) on a workload's own text."""

from __future__ import annotations

from pathlib import Path

from longspec.cli.options import add_device_argument, training_process_device
from longspec.cli.train_corpus import add_corpus_arguments, training_tokens


# Each architecture's shape options and their defaults for a fresh drafter (a drafter
# continued with --init-from keeps its own).
_SHARED_DEFAULTS = {"hidden_size": 256, "draft_vocab": 32768}
ARCHITECTURE_OPTIONS = {
    "mamba": {**_SHARED_DEFAULTS, "layers": 8, "state_size": 16},
    "draft-model": {**_SHARED_DEFAULTS, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 768},
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_parser(sub) -> None:
    mamba = sub.add_parser("mamba", help="train a Mamba (state-space) drafter for a target (method mamba)")
    mamba.add_argument("--state-size", type=int, default=None, help="SSM state per channel (default: 16)")
    mamba.set_defaults(train_command=run, architecture="mamba")
    small = sub.add_parser("draft-model", help="train a small transformer drafter for a target (method draft-model)")
    small.add_argument("--heads", type=int, default=None, help="attention heads (default: 4)")
    small.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: 2)")
    small.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: 768)")
    small.set_defaults(train_command=run, architecture="draft-model")
    for p in (mamba, small):
        p.add_argument("--model", default=None, help="target (default: embedded Gemma 3 270M)")
        add_corpus_arguments(p)
        p.add_argument("--out", type=Path, required=True,
                       help="run directory: the drafter (config.json, model.safetensors, longspec-vocab.json), "
                            "trainer_state.pt, loss.csv; rerun to resume")
        p.add_argument("--label-cache", type=Path, default=None, help="store the target's greedy labels here and reuse them")
        p.add_argument("--dtype", default="bfloat16", help="target dtype (labels come from the target in this dtype)")
        add_device_argument(p)
        p.add_argument("--init-from", type=Path, default=None,
                       help="start from this trained drafter (a directory as `train` writes it or `ship_external_drafter` "
                            "ships it) instead of fresh weights; its architecture and vocabulary are kept")
        p.add_argument("--hidden-size", type=int, default=None, help="width (default: 256)")
        p.add_argument("--layers", type=int, default=None, help="drafter layers (default: 8 for mamba, 4 for draft-model)")
        p.add_argument("--draft-vocab", type=int, default=None,
                       help="the drafter reads and proposes the N most frequent corpus tokens (plus one 'other' id; "
                            "default: 32768)")
        p.add_argument("--labels", choices=("target", "data"), default="target",
                       help="target: the target's own greedy next tokens (self-distillation); data: the corpus's")
        p.add_argument("--steps", type=int, default=1000)
        p.add_argument("--seq-len", type=int, default=512)
        p.add_argument("--batch-size", type=int, default=8, help="sequences per step per process")
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--warmup", type=int, default=50)
        p.add_argument("--save-every", type=int, default=50)
        p.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this much wall time; rerun to resume")
        p.add_argument("--max-rows", type=int, default=None, help="rows one epoch visits (a seeded sample; default all)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def run(args) -> int:
    import dataclasses

    import torch

    from longspec.api import parse_dtype
    from longspec.cli.paths import check_output_directory
    from longspec.runtime.loading import load_target
    from longspec.speculation.drafters.mamba.sequence import MambaSequenceLM
    from longspec.speculation.drafters.shared.vocab_map import VocabMap
    from longspec.training.external_drafter import (
        DrafterTrainOptions,
        ExternalDrafterTrainer,
        check_initial_drafter,
        initial_drafter,
        mamba_drafter,
        reduced_vocabulary,
        transformer_drafter,
    )

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    check_output_directory(args.out)
    shape = {name: getattr(args, name) for name in ARCHITECTURE_OPTIONS[args.architecture]}
    if args.init_from is not None:
        given = [_flag(name) for name, value in shape.items() if value is not None]
        if given:
            raise ValueError(f"--init-from keeps the drafter's architecture and vocabulary: drop {', '.join(given)}")
        check_initial_drafter(args.init_from, args.architecture)  # before the target loads
    shape = {name: ARCHITECTURE_OPTIONS[args.architecture][name] if value is None else value for name, value in shape.items()}
    for name in ("steps", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(args, name)}")
    for name, value in shape.items():
        if value < 1:
            raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
    options = DrafterTrainOptions(
        steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
        self_distill=args.labels == "target", seed=args.seed, save_every=args.save_every, max_rows=args.max_rows,
    )
    device = training_process_device(args.device)
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=device)
    tokens, prefix = training_tokens(args, target)
    options = dataclasses.replace(options, row_prefix=prefix)
    if args.init_from is not None:
        model, vocab = initial_drafter(args.init_from, args.architecture, target.model.config)
    else:
        vocab = VocabMap.load(args.out) or reduced_vocabulary(tokens, target.model.config,
                                                              min(shape["draft_vocab"], target.model.config.vocab_size))
        if args.architecture == "mamba":
            model = mamba_drafter(vocab, hidden_size=shape["hidden_size"], layers=shape["layers"],
                                  state_size=shape["state_size"], seed=args.seed)
        else:
            model = transformer_drafter(vocab, target.model.config, hidden_size=shape["hidden_size"],
                                        layers=shape["layers"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                                        intermediate_size=shape["intermediate_size"], seed=args.seed)
    # Mamba rows run through the native CPU scan (transformers' CPU path loops over time in Python).
    forward_module = MambaSequenceLM(model) if args.architecture == "mamba" else None
    trainer = ExternalDrafterTrainer(model, target.model, vocab, tokens, args.out, options, label_cache=args.label_cache,
                                     forward_module=forward_module)
    if trainer.step:
        print(f"resuming at step {trainer.step} (data position {trainer.position})", flush=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.architecture} drafter: {params / 1e6:.1f}M parameters, vocabulary {vocab.draft_vocab_size} ids", flush=True)
    trainer.train(max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
    print(f"drafter written to {args.out} at step {trainer.step}; use it with --method {args.architecture} "
          f"--option model={args.out}", flush=True)
    return 0
