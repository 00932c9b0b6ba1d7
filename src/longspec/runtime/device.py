"""Where tensors live.

A target is loaded onto one device and everything that touches its activations —
weights, KV cache, logits, processors, the verifier's random stream, neural
drafters' weights and states — lives there too. Bookkeeping stays on the host:
committed token ids, speculation trees (a few dozen int64 nodes), retrieval
indexes. They meet once per round: the tree's tokens go to the device for the
forward and the verdict's few integers come back.
"""

from __future__ import annotations

import torch

# Committed tokens, trees and retrieval indexes: small, and read element by element.
HOST = torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a user asked for, checked before any work ("cuda" means the current GPU)."""
    if device is None:
        return HOST
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"unknown device {device!r} ({error}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if resolved.type == "cpu":
        return HOST
    if resolved.type != "cuda":
        raise ValueError(f"device {resolved} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        build = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"device {resolved} was asked for, but {build}; use --device cpu, or install a CUDA "
                         "build of torch on a machine with a GPU")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if not 0 <= index < count:
        raise ValueError(f"device {resolved} does not exist: {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def check_dtype_on_device(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a dtype the device cannot compute in, naming the alternative."""
    if device.type != "cuda":
        return
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{name} has no bfloat16 support; use --dtype float32 (or float16 where the model allows it)")


def bf16_matmuls_are_fast(device: torch.device) -> bool:
    """Whether PyTorch's own bf16 matrix products (what autograd and autocast run) outrun
    float32 on `device`: on GPUs with bf16, and on CPUs with AVX-512 BF16 or AMX. On CPUs
    with AVX2 alone oneDNN has no bf16 instructions, and bf16 products run slower than
    float32 ones (docs/lab-notes/training.md#training-the-longspec-draft-on-avx2-cpus-11-faster-first-epochs-the-noisy-shift-weighted-toward-depth-1-issue-longspec-draft-that-pays)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def available_devices() -> list[str]:
    """The devices this machine can run on: always the CPU, plus the GPU when there is one."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_name(device: torch.device) -> str:
    """"cpu", or the GPU's product name (what a measurement taken on it depends on)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer read afterwards measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
