"""GGUF quantized blocks for tests: weights quantized to each format (a plain Q4_K / Q6_K
quantizer here, the `gguf` package has none), and their exact float64 values decoded from
the format's definition (cross-checked against the `gguf` package's dequantization, which
rounds some of them to float32)."""

from __future__ import annotations

import numpy as np

Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
KINDS = {"Q8_0": Q8_0, "Q5_0": Q5_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
BLOCK = {Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


def random_rows(kind: int, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """[rows, row bytes] uint8 blocks of random normal weights (times `scale`): the `gguf`
    quantizer's for Q8_0 and Q5_0, `quantize_k`'s for the K formats."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    return quantize(kind, weights)


def quantize(kind: int, weights: np.ndarray) -> np.ndarray:
    import gguf

    if kind in (Q8_0, Q5_0):
        return gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), gguf.GGMLQuantizationType(kind))
    return quantize_k(kind, weights)


def exact_values(kind: int, raw: np.ndarray, cols: int) -> np.ndarray:
    """The weight a block stands for, exactly, in float64 [rows, cols]."""
    import gguf.quants as q

    values, nbytes = BLOCK[kind]
    rows = raw.shape[0]
    b = raw.reshape(-1, nbytes)
    if kind == Q8_0:
        d = b[:, :2].copy().view(np.float16).astype(np.float64)
        w = d * b[:, 2:].view(np.int8).astype(np.float64)
    elif kind == Q5_0:
        d = b[:, :2].copy().view(np.float16).astype(np.float64)
        qh = b[:, 2:6].copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
        low = np.concatenate([b[:, 6:] & 0x0F, b[:, 6:] >> 4], axis=1).astype(np.int64)
        w = d * ((low | ((qh & 1).astype(np.int64) << 4)) - 16)
    elif kind == Q4_K:
        d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
        sc, m = q.Q4_K.get_scale_min(b[:, 4:16].copy())
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 8, 32).astype(np.float64)
        w = (d[:, :, None] * sc[:, :, None] * codes - dmin[:, :, None] * m[:, :, None]).reshape(-1, 256)
    else:
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), b[:, 208:210].copy().view(np.float16)
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = (low.reshape(-1, 256).astype(np.int64) | (high.reshape(-1, 256).astype(np.int64) << 4)) - 32
        w = (d.astype(np.float64) * sc.astype(np.float64)).repeat(16, axis=1) * codes
    return w.reshape(rows, cols)


def magnitudes(kind: int, raw: np.ndarray, cols: int) -> np.ndarray:
    """Per weight, the size of what its value adds to the kernel's float32 terms: |w|, and for
    Q4_K, whose blocks add the code and the minimum as separate terms, |d sc q| + |dmin m|."""
    if kind != Q4_K:
        return np.abs(exact_values(kind, raw, cols))
    import gguf.quants as q

    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = q.Q4_K.get_scale_min(b[:, 4:16].copy())
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8, 32).astype(np.float64)
    size = np.abs(d[:, :, None] * sc[:, :, None] * codes) + np.abs(dmin[:, :, None] * m[:, :, None])
    return size.reshape(raw.shape[0], cols)


def terms_per_output(kind: int, cols: int) -> int:
    """Float32 terms the kernel adds into each output: one per 32 values, two for Q4_K."""
    return cols // 32 * (2 if kind == Q4_K else 1)


def quantize_k(kind: int, weights: np.ndarray) -> np.ndarray:
    """A plain round-to-nearest Q4_K or Q6_K quantizer (the `gguf` package has none):
    [rows, cols] float -> [rows, row bytes] uint8 blocks of the format."""
    rows, cols = weights.shape
    w = weights.astype(np.float32).reshape(-1, 256)
    n = w.shape[0]
    if kind == Q4_K:
        sub = w.reshape(n, 8, 32)
        low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
        scale, minimum = (high - low) / 15, -low
        d = (scale.max(-1) / 63).astype(np.float16)
        dmin = (minimum.max(-1) / 63).astype(np.float16)
        safe = lambda v: np.where(v == 0, 1, v).astype(np.float32)
        sc = np.clip(np.rint(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(minimum / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
        step = d.astype(np.float32)[:, None] * sc
        codes = np.clip(np.rint((sub + (dmin.astype(np.float32)[:, None] * m)[..., None]) / safe(step)[..., None]), 0, 15)
        codes = codes.astype(np.uint8).reshape(n, 4, 2, 32)
        qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, 128)
        packed = np.zeros((n, 12), dtype=np.uint8)
        packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
        blocks = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed, qs], axis=1)
    else:
        sub = w.reshape(n, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16)
        safe = lambda v: np.where(v == 0, 1, v).astype(np.float32)
        sc = np.clip(np.rint(scale / safe(d)[:, None]), -128, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None] * sc
        codes = (np.clip(np.rint(sub / safe(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
        low, high = codes & 0x0F, codes >> 4
        ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
        h = high.reshape(n, 2, 4, 32)
        qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(n, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)
    return np.ascontiguousarray(blocks).reshape(rows, cols // 256 * BLOCK[kind][1])
