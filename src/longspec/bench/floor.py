"""The physical floors on this machine: measured memory read bandwidth against the
bytes one autoregressive decode forward must read (the AR speed no implementation
can beat while memory-bound), and the measured matrix-product rate against the
FLOPs a prompt costs (the prefill speed no implementation can beat while
compute-bound)."""

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


def matmul_rate_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-N rate of a square matrix product in `dtype`, GFLOP/s."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def matmul_weights(model) -> int:
    """Parameters of the layers' matrix products (the embedding and tied head excluded)."""
    return sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name and "lm_head" not in name)


def prefill_flops(model, context_tokens: int) -> float:
    """Matrix-product FLOPs of prefilling `context_tokens` (no logits: the engine asks
    for none during prefill): every layer's products per token, plus each token's
    attention over the keys before it (sliding layers at most their window)."""
    c = model.config
    positions = torch.arange(1, context_tokens + 1, dtype=torch.float64)
    attended = sum(
        float(positions.clamp(max=c.sliding_window).sum()) if sliding else float(positions.sum())
        for sliding in c.layer_is_sliding
    )
    return 2 * matmul_weights(model) * context_tokens + 4 * c.num_heads * c.head_dim * attended


def prefill_floor_tokens_per_s(model, context_tokens: int, matmul_gflops: float) -> float:
    return context_tokens / (prefill_flops(model, context_tokens) / (matmul_gflops * 1e9))
