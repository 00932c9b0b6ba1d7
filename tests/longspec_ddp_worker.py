"""Worker of the 2-process gloo training test (tests/test_longspec_training.py).

Kept apart from the test module so spawned processes import only longspec and
torch, not transformers (the pickled tiny target arrives ready-made)."""

from __future__ import annotations

import os

import torch


def train_rank(rank: int, world: int, port: int, target_file: str, tokens_file: str, config_file: str, out_dir: str, result_dir: str) -> None:
    import torch.distributed as dist

    from longspec.speculation.drafters.longspec.config import DraftConfig
    from longspec.training.longspec.trainer import LongSpecTrainer, TrainOptions
    from longspec.training.longspec.visibility import NoisyShift

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        target = torch.load(target_file, weights_only=False)
        config = DraftConfig.from_dict(torch.load(config_file))
        options = TrainOptions(steps=3, seq_len=24, batch_size=1, lr=3e-3, warmup=2, save_every=2, visibility=NoisyShift(3))
        trainer = LongSpecTrainer(target, torch.load(tokens_file), out_dir, options, draft_config=config, progress=False)
        trainer.train()
        torch.save(trainer.draft.state_dict(), os.path.join(result_dir, f"rank{rank}.pt"))
        # Both ranks reach the teardown together: a rank that tears down gloo while the
        # other still holds its connections can abort that one ("terminate called
        # without an active exception", seen once in a parallel test run).
        dist.barrier()
    finally:
        dist.destroy_process_group()
