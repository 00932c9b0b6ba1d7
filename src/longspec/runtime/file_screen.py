"""The certified head of a quantized GGUF target: the exact argmax of the file head's
logits (`runtime.file_rows`: the `gguf_linear` product of the file's output rows) from a
cheaper screen, without the full product.

The target's logit of output row i for an activation row h is l_i = bf16(f_i), where f_i
is the kernel's float32 chain over the row's blocks: h is quantized alone to int8 codes x
with one float32 scale dx_b per 32 values (a = dx x, per block, the activation the kernel
multiplies, exactly), and each block adds one term d_b dx_b S_b (S_b an exact integer sum
of code products; Q4_K adds two: codes and minimum). So with z_i = w_i . a exact (w_i the
row's exact values), T terms a row and gamma = m 2^-24 / (1 - m 2^-24), m = T + 4 (one
product rounding or two a term, one addition, in any order: Higham, Theorem 3.1):

    |f_i - z_i| <= gamma W_i ||a||_1           W_i = max_k |w_ik| (Q4_K: |d sc q| + |dmin m|)

The screen is the same kernel over a Q5_0 copy v_i of every row (derived once, 5.5 bits a
weight against Q8_0's 8.5; `gguf_linear` runs it), called with the same activation:

    s_i = its float32 chain         |s_i - v_i . a| <= gamma V_i ||a||_1,  V_i = max_k |v_ik|
    |z_i - v_i . a| = |(w_i - v_i) . a| <= R_i ||a||_2   (Cauchy-Schwarz, R_i = ||w_i - v_i||)

and bf16 rounds f_i by at most u |f_i| <= u F, u = 2^-8, F = max_i |f_i| <= max_i |s_i| + B.
So |l_i - s_i| <= E_i = R_i ||a||_2 + gamma (W_i + V_i) ||a||_1 + u (max |s| + B) + tiny,
B the largest first three terms over the rows and tiny the denormals flushed to zero.
Every row whose s_i + E_i reaches the largest s_j - E_j is a candidate (ties included);
the others' logits lie strictly below the largest, so the first index of the largest
exact logit among the candidates, recomputed with the kernel over just those rows of the
file (its output for a row depends on that row and the activation alone), is the full
head's argmax. R_i, W_i + V_i are computed in float64 from the file's values (the `gguf`
package's float32 dequantization, exact for Q8_0, inflated by 2^-22 for the K formats'
one rounding) and rounded up to float32; the per-call norms in float64, inflated by 2^-40.

Draws (sampled decoding) do not use this screen: they read the full quantized head, the
same logits (`CertifiedHead.draws`).

Opt-in (LONGSPEC_FILE_SCREEN=1): by measurement it does not pay on Gemma 3 270M, whose final
hidden rows have ||a||_2 of 60-90, so R_i ||a||_2 spans 3-10 logits (the errors seen stay under
1) and every row's candidates overflow the cap; its Q8_0 head read in full is the same bytes a
screen of the file's own codes would read (docs/lab-notes/quantized-targets.md)."""

from __future__ import annotations

import math

import numpy as np
import torch

from longspec.runtime.certified_head import (
    BF16_UNIT,
    CANDIDATE_CAP,
    HeadStats,
    _round_up_float32,
    decide_rows,
)
from longspec.runtime.file_rows import FileRows
from longspec.runtime.native import native_ops
from longspec.runtime.quantized import QuantizedWeight, segment

SCREEN_KIND = 6  # Q5_0: the screen's format
Q4_K = 12
ARRAYS = ("screen", "residual", "magnitude")
CHUNK = 8192  # rows derived at a time (float64 copies of a whole vocabulary would take gigabytes)


def _magnitudes(rows: FileRows, raw: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per weight, the size of what it adds to the kernel's terms (Q4_K: both terms)."""
    if rows.kind != Q4_K:
        return np.abs(values.astype(np.float64))
    import gguf.quants as q

    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = q.Q4_K.get_scale_min(b[:, 4:16].copy())
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8, 32).astype(np.float64)
    size = np.abs(d[:, :, None] * sc[:, :, None] * codes) + np.abs(dmin[:, :, None] * m[:, :, None])
    return size.reshape(values.shape)


def derive_screen(rows: FileRows) -> dict[str, torch.Tensor]:
    """The Q5_0 screen of every row (the file's [rows, bytes] layout) and each row's bound
    constants: R_i (`residual`) and W_i + V_i (`magnitude`), float32 rounded up."""
    import gguf

    screen_type, kind = gguf.GGMLQuantizationType(SCREEN_KIND), gguf.GGMLQuantizationType(rows.kind)
    exact = rows.kind == 8 or rows.kind in (0, 1)  # Q8_0, F32, F16: float32 holds the values exactly
    inflate = 1 + 2.0**-40 + (0.0 if exact else 2.0**-22)
    parts = {name: [] for name in ARRAYS}
    for begin in range(0, rows.rows, CHUNK):
        raw = np.ascontiguousarray(rows.raw[begin : begin + CHUNK])
        values = np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32).reshape(-1, rows.cols)
        screen = gguf.quants.quantize(values, screen_type)
        v = np.asarray(gguf.quants.dequantize(screen, screen_type), dtype=np.float64).reshape(-1, rows.cols)
        w = values.astype(np.float64)
        residual = np.linalg.norm(w - v, axis=1) + (0.0 if exact else 2.0**-22 * np.linalg.norm(w, axis=1))
        magnitude = _magnitudes(rows, raw, values).max(axis=1) * (1 if exact else 1 + 2.0**-22) + np.abs(v).max(axis=1)
        parts["screen"].append(torch.from_numpy(np.ascontiguousarray(screen, dtype=np.uint8)))
        parts["residual"].append(_round_up_float32(torch.from_numpy(residual * inflate)))
        parts["magnitude"].append(_round_up_float32(torch.from_numpy(magnitude * inflate)))
    return {name: torch.cat(values) for name, values in parts.items()}


class FileCertifiedHead:
    """Exact argmax of a quantized target's file head from its Q5_0 screen."""

    draws = False  # sampled decoding reads the full quantized head (the same logits)
    group = 32  # activation values per scale (what the cost model's key records)

    def __init__(self, rows: FileRows, arrays: dict[str, torch.Tensor], cap: int = CANDIDATE_CAP) -> None:
        self.rows, self.cap = rows, cap
        screen, self.residual, self.magnitude = (arrays[name] for name in ARRAYS)
        if tuple(self.residual.shape) != (rows.rows,) or screen.shape[0] != rows.rows:
            raise ValueError(f"the screen's arrays do not fit the {rows.rows} rows of {rows.name!r}")
        self.screen_weight = QuantizedWeight((segment(rows.name + ".screen", SCREEN_KIND, screen, rows.rows,
                                                      rows.cols),), rows.cols)
        self.maxima = (float(self.residual.max()), float(self.magnitude.max()))
        self.residual64, self.magnitude64 = self.residual.double(), self.magnitude.double()
        terms = rows.cols // 32 * (2 if rows.kind == Q4_K else 1) + 4
        self.gamma = terms * 2.0**-24 / (1 - terms * 2.0**-24)
        self.tiny = terms * 2.0**-100
        self.stats = HeadStats()

    @property
    def nbytes(self) -> int:
        return self.screen_weight.nbytes + 8 * self.rows.rows  # + the two float32 constants a row

    def describe(self) -> str:
        """What its decisions read (for `longspec doctor`)."""
        return (f"a Q5_0 screen of the file's {self.rows.rows:,} x {self.rows.cols} head rows "
                f"({self.nbytes / 2**20:.0f} MiB), recomputing the candidates from the file's rows")

    def _norms(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """||a||_2 and ||a||_1 [N] of each row's quantized activation, float64, inflated."""
        codes, scales = native_ops().gguf_quantize_rows(hidden)
        a = (codes.double().view(codes.shape[0], -1, 32) * scales.double().unsqueeze(-1)).view(codes.shape[0], -1)
        inflate = 1 + 2.0**-40
        return a.norm(dim=1) * inflate, a.abs().sum(dim=1) * inflate

    def candidates(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Per row of `hidden` [N, H] (bf16): the ascending output rows whose logit could be
        the largest (allowed) one, or None (no certificate: not finite, over the cap)."""
        hidden = hidden.to(torch.bfloat16).contiguous()
        scores = self.screen_weight.linear(hidden.float())  # float32: the activation's codes are the bf16 row's
        two, one = self._norms(hidden)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)
        found: list[torch.Tensor | None] = []
        for row in range(hidden.shape[0]):
            found.append(self._row_candidates(scores[row], float(two[row]), float(one[row])))
        return found

    def _widest(self, two: float, one: float) -> float:
        """B: the largest of the rows' first three terms for these activation norms."""
        return (self.maxima[0] * two + self.gamma * self.maxima[1] * one + self.tiny) * (1 + 2.0**-40)

    def _own(self, rows: torch.Tensor, two: float, one: float, rounding: float) -> torch.Tensor:
        """E_i of output `rows` (float64)."""
        return (self.residual64[rows] * two + self.gamma * self.magnitude64[rows] * one + self.tiny) * (1 + 2.0**-40) \
            + rounding

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The screen's scores [N, V] (float32) and each logit's bound E [N, V] (float64):
        |l_i - s_i| <= E_i (what `candidates` decides with; for tests)."""
        hidden = hidden.to(torch.bfloat16).contiguous()
        scores = self.screen_weight.linear(hidden.float())
        two, one = self._norms(hidden)
        every = torch.arange(self.rows.rows)
        bounds = []
        for row in range(hidden.shape[0]):
            widest = self._widest(float(two[row]), float(one[row]))
            rounding = BF16_UNIT * (float(scores[row].abs().max()) + widest) * (1 + 2.0**-40)
            bounds.append(self._own(every, float(two[row]), float(one[row]), rounding))
        return scores, torch.stack(bounds)

    def _row_candidates(self, s: torch.Tensor, two: float, one: float) -> torch.Tensor | None:
        kept = s[s != -math.inf]
        if kept.numel() == 0 or not bool(torch.isfinite(kept).all()) or not (math.isfinite(two) and math.isfinite(one)):
            return None
        top, size = float(kept.max()), float(kept.abs().max())
        widest = self._widest(two, one)
        rounding = BF16_UNIT * (size + widest) * (1 + 2.0**-40)
        # A superset first (every row's bound at most widest + rounding), compared in float32
        # against a floor rounded down; then each survivor's own bound.
        reach = 2 * (widest + rounding)
        floor = torch.tensor(top - reach - 2.0**-45 * (abs(top) + reach), dtype=torch.float64)
        floor32 = floor.float()
        if floor32.double() > floor:
            floor32 = torch.nextafter(floor32, torch.tensor(-math.inf))
        rows = torch.nonzero(s >= floor32).flatten()
        if rows.numel() > self.cap:
            return None
        own = self._own(rows, two, one, rounding)
        values = s[rows].double()
        keep = values + own >= (values - own).max() - 2.0**-40 * (abs(top) + reach)
        return rows[keep]

    def argmax(self, hidden: torch.Tensor, full_logits, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The full head's argmax for every row of `hidden` [N, H] (bf16): int64 [N]. As
        `CertifiedHead.argmax` (allowed: a grammar's mask; full_logits: the fallback)."""
        found = self.candidates(hidden, allowed)
        for rows in found:
            if rows is None:
                self.stats.fallbacks += 1
            else:
                self.stats.candidates[rows.numel()] += 1
        self.stats.rows += hidden.shape[0]
        return decide_rows(hidden, found, self._exact_logits, full_logits, allowed)

    def _exact_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The file head's logits of output `rows`: the kernel over just those file rows."""
        return self.rows.select(rows).linear(hidden.to(torch.bfloat16).contiguous())
