"""Options shared by several commands: `KEY=VALUE` drafter options (`generate --option`,
`bench --option`), `--device` and `--compile`."""

from __future__ import annotations

import json
from typing import Any


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default=None,
                        help="where the model computes: cpu (default), cuda or cuda:N; refused before loading "
                             "weights when the device is missing or cannot compute in --dtype")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="run decode steps and verification trees through compiled static-shape steps "
                             "(CUDA graphs on a GPU), compiled once at load")


def training_process_device(device: str | None):
    """The device of this training process, with the process group joined when the
    command runs under `accelerate launch` / `torchrun` (NCCL between GPUs, gloo on
    CPUs): there, `--device cuda` means the GPU of the process's LOCAL_RANK."""
    import os

    import torch
    import torch.distributed as dist

    from longspec.runtime.device import resolve_device

    resolved = resolve_device(device)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and resolved.type == "cuda" and device == "cuda":
        resolved = resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(resolved)
    if launched and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if resolved.type == "cuda" else "gloo")
    return resolved


def parse_option(spec: str, example: str) -> tuple[str, Any]:
    """'KEY=VALUE' -> (KEY, VALUE), VALUE read as JSON when it parses (5, 0.5, true,
    [2,4]) and as a string otherwise (a path)."""
    key, eq, raw = spec.partition("=")
    if not (eq and key):
        raise ValueError(f"--option {spec!r}: write {example}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
