"""The physical floor of decoding on this machine: measured memory read
bandwidth and the bytes one autoregressive decode forward must read. Their
ratio is the AR speed no implementation can beat while memory-bound."""

from __future__ import annotations

import platform
import time

import torch

from longspec.runtime.machine import machine_identity


def machine() -> dict:
    """CPU, cores, threads and library versions, for report headers."""
    import transformers

    import longspec

    return {
        **machine_identity(),
        "torch_threads": torch.get_num_threads(),
        "longspec": longspec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-N read bandwidth: summing a large buffer reads every byte once."""
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def decode_bytes_per_forward(model, context_tokens: int) -> int:
    """Bytes one decode forward of our `Decoder` must read: every weight once (the
    embedding lookup reads one row, but a tied head reads the whole matrix) plus
    the K/V it attends (sliding layers attend at most their window)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * c.num_kv_heads * c.head_dim * model.embed_weight.element_size()
    attended = sum(
        min(context_tokens, c.sliding_window) if sliding else context_tokens for sliding in c.layer_is_sliding
    )
    return weights + kv_per_token * attended


def ar_floor_tokens_per_s(model, context_tokens: int, bandwidth_gbs: float) -> float:
    return bandwidth_gbs * 1e9 / decode_bytes_per_forward(model, context_tokens)
