"""A small LongSpec training setup: a draft config of a tiny target, a repetitive
token stream, and short training options."""

from __future__ import annotations

import torch

from longspec.speculation.drafters.longspec import DraftConfig
from longspec.training.longspec.trainer import TrainOptions
from longspec.training.longspec.visibility import NoisyShift
from tiny_models import random_ids


def small_draft_config(target, **options):
    return DraftConfig.for_target(target.config, **{"self_num_heads": 2, "self_head_dim": 8, "intermediate_size": 32, "window": 16,
                                                    **options})


def _tokens():
    return torch.cat([random_ids(12, seed=i)[0].repeat(4) for i in range(12)])


def _options(**kw):
    return TrainOptions(**{"steps": 6, "seq_len": 24, "batch_size": 2, "lr": 3e-3, "warmup": 2, "save_every": 2, "visibility": NoisyShift(3), **kw})
