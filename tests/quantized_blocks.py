"""GGUF quantized blocks for tests: random valid blocks of each format, and their exact
float64 values decoded here from the format's definition (cross-checked against the
`gguf` package's dequantization, which rounds some of them to float32)."""

from __future__ import annotations

import numpy as np

Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
KINDS = {"Q8_0": Q8_0, "Q5_0": Q5_0, "Q4_K": Q4_K, "Q6_K": Q6_K}
BLOCK = {Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


def random_rows(kind: int, rows: int, cols: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """[rows, row bytes] uint8 of valid blocks: the `gguf` quantizer's for Q8_0 and Q5_0
    (of random weights), random codes and small fp16 scales for the K formats (whose
    quantizer the package lacks)."""
    import gguf

    rng = np.random.default_rng(seed)
    values, nbytes = BLOCK[kind]
    if kind in (Q8_0, Q5_0):
        weights = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind))
    blocks = rows * cols // values
    raw = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    half = lambda lo, hi: rng.uniform(lo, hi, size=blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    if kind == Q4_K:
        raw[:, 0:2] = half(scale / 64, scale / 16)  # d
        raw[:, 2:4] = half(scale / 64, scale / 16)  # dmin
    else:
        raw[:, 208:210] = half(scale / 256, scale / 64)  # d
    return raw.reshape(rows, cols // values * nbytes)


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
