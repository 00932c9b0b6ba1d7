"""The certified head: the exact argmax of the output layer without computing most of it.

A decision (greedy decoding, greedy verification of a tree) needs the argmax of a row
of logits, and on a small big-vocabulary model the output layer is most of a decode
step's bytes (Gemma 3 270M: 262,144 x 640). So:

1. a screen reads an int8 copy of the head, one scale per `GROUP` columns of each row
   (`kernels/int8_screen.cpp`), giving s_i for every output row i;
2. a rigorous bound says how far the plain head's bf16 logit l_i can lie from s_i;
   only the rows whose upper bound reaches the largest lower bound are candidates;
3. the candidates' logits are recomputed with the plain head's own kernel over a
   packed copy of just those rows: every output of that kernel is one float32 sum in
   an order that depends on k alone, so they are the plain head's bits, and the first
   index of the largest is the plain head's argmax (ties included: every row that
   could tie the largest is a candidate).

The bound, for an activation row h (bf16, exact in float32) quantized per group to
int16 codes x with scales alpha (h = alpha x + d, the remainder d known exactly), and
an output row i with weights w_i (bf16), int8 codes q_i and scales sigma_ig, residual
r_i = w_i - sigma q_i. The screen's integer sums are exact; so, by Cauchy-Schwarz,

    z_i = w_i . h (exact)    |z_i - s_i| <= ||r_i|| ||alpha x|| + ||w_i|| ||d|| + gamma M_i ||alpha x||_1
    f_i = the float32 sum    |f_i - z_i| <= gamma W_i ||h||_1
    l_i = bf16(f_i)          |l_i - f_i| <= u |f_i|,  u = 2^-8

with ||alpha x|| <= ||h|| + ||d|| (both norms), M_i = max_k |sigma q_ik|, W_i =
max_k |w_ik|, gamma = n 2^-24 / (1 - n 2^-24) for n = K + 3 groups + 4 roundings of a
float32 sum in any order (Higham, Theorem 3.1; bf16 products are exact in float32;
AVX-512 BF16 dot products round at most twice a pair; the screen rounds three times a
group), and a tiny absolute term for denormals flushed to zero. So with B_i the first
two lines' sum, l_i lies in s_i +- (B_i + u (|s_i| + B_i)). The per-row constants
||r_i||, ||w_i||, M_i + W_i are computed in float64 and rounded up to float32; the
per-call norms in float64, inflated by 2^-40 for their own rounding.

It applies where the plain head is the native packed bf16 kernel on the CPU (the
recomputation must be that kernel) and the logits are not soft-capped; elsewhere, and
for rows whose screen is not finite or has more than `cap` candidates (counted), the
full head runs.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from longspec.runtime.argmax import row_argmax
from longspec.runtime.native import bf16_linear_ops, native_ops
from longspec.runtime.setup_time import one_time

if TYPE_CHECKING:
    from longspec.runtime.file_screen import FileCertifiedHead

GROUP = 64  # columns per int8 scale, and per int16 activation scale (docs/lab-notes/certified-head.md)
LANES = 16  # output rows per packed block
CANDIDATE_CAP = 4096  # beyond this a row's full head is cheaper to read than its candidates
BF16_UNIT = 2.0**-8  # bf16 rounds to 8 significant bits: |bf16(x) - x| <= 2^-8 |x|
DISABLE_VARIABLE = "LONGSPEC_CERTIFIED_HEAD"
FILE_SCREEN_VARIABLE = "LONGSPEC_FILE_SCREEN"  # 1: a quantized GGUF head's Q5_0 screen (`runtime/file_screen.py`)


@dataclass
class HeadStats:
    """What the certified head decided: rows certified, candidates per row, fallbacks."""

    rows: int = 0
    fallbacks: int = 0  # rows that took the full head (no certificate: cap, non-finite)
    narrowed: int = 0  # rows whose candidates overflowed the cap and fit a narrower margin (draws)
    undecided: int = 0  # draws whose truncation the bound could not decide (they took the full head)
    widened: int = 0  # top-p decisions the bounds left open, settled over a wider selection instead
    tails: int = 0  # draws that counted the rows outside their candidates in bins (certified_sampling.py)
    candidates: Counter = field(default_factory=Counter)  # candidates per certified row -> rows

    def percentile(self, q: float) -> int:
        total, seen = sum(self.candidates.values()), 0
        for count in sorted(self.candidates):
            seen += self.candidates[count]
            if seen >= q * total:
                return count
        return 0


@dataclass(frozen=True)
class Candidates:
    """One activation row's candidates: ascending output rows, and `cut`, a bound every
    other output row's plain logit lies below (the largest lower bound less `margin`)."""

    rows: torch.Tensor
    cut: float
    margin: float


@dataclass
class Screen:
    """The screen of some activation rows: approximate logits [N, V] and each row's bound
    coefficients; candidates and the rows outside them are read from it. `summary`
    [N, spans]: the kernel's largest score of each span of output rows, so that only the
    spans near the top are read (None: every row is scanned, as after a mask)."""

    head: CertifiedHead
    scores: torch.Tensor
    coefficients: torch.Tensor
    finite: torch.Tensor
    summary: torch.Tensor | None = None

    def select(self, margins: torch.Tensor | None = None, rows: list[int] | None = None,
               narrower: torch.Tensor | None = None, tally: bool = True) -> list[Candidates | None]:
        """Candidates of `rows` (default: every row) within `margins` [len(rows)] of the
        largest. `narrower` [len(rows)]: margins to try instead for the rows whose
        candidates overflow the cap (a flat distribution), before giving up on them.
        tally=False: a second look at rows already counted, left out of the stats."""
        head = self.head
        rows = list(range(self.scores.shape[0])) if rows is None else rows
        if margins is None:
            margins = torch.zeros(len(rows), dtype=torch.float64)
        found = self._candidates(rows, margins)
        if narrower is not None:
            overflowing = [i for i, (row, c) in enumerate(zip(rows, found)) if c is None and bool(self.finite[row])]
            if overflowing:
                retried = self._candidates([rows[i] for i in overflowing], narrower[overflowing])
                for i, candidates in zip(overflowing, retried):
                    found[i] = candidates
                head.stats.narrowed += sum(c is not None for c in retried)
        if not tally:
            return found
        for row, candidates in zip(rows, found):
            if candidates is None:
                head.stats.fallbacks += 1
            else:
                head.stats.candidates[candidates.rows.numel()] += 1
            head.stats.rows += 1
        return found

    def _candidates(self, rows: list[int], margins: torch.Tensor) -> list[Candidates | None]:
        head = self.head
        every = rows == list(range(self.scores.shape[0]))
        # One row is a view (a row of a contiguous screen is contiguous), several a copy.
        pick = (lambda t: t[rows[0] : rows[0] + 1]) if len(rows) == 1 else (lambda t: t[rows].contiguous())
        scores = self.scores if every else pick(self.scores)
        coefficients = self.coefficients if every else pick(self.coefficients)
        summary = self.summary if every or self.summary is None else pick(self.summary)
        indices, offsets, counts, cuts = native_ops().int8_screen_candidates(
            scores, summary, head.residual, head.row_norm, head.magnitude, coefficients, margins.contiguous(),
            head.maxima, BF16_UNIT, head.tiny, head.cap)
        return [None if count < 0 or not bool(self.finite[row]) else
                Candidates(indices[offsets[position] : offsets[position + 1]], cut, margin)
                for position, (row, count, cut, margin) in enumerate(zip(rows, counts.tolist(), cuts.tolist(),
                                                                         margins.tolist()))]

    def _summary_of(self, row: int) -> torch.Tensor | None:
        return None if self.summary is None else self.summary[row]

    def tail_counts(self, row: int, cut: float, step: float, bins: int) -> torch.Tensor:
        """How many output rows outside the candidates below `cut` fall in each bin: bin
        b holds the rows whose upper bound lies in (cut - (b + 1) step, cut - b step], the
        last bin every row further down."""
        head = self.head
        return native_ops().int8_screen_tail(self.scores[row], self._summary_of(row), head.residual, head.row_norm,
                                             head.magnitude, self.coefficients[row], head.maxima, BF16_UNIT, head.tiny,
                                             cut, step, bins, 0, -1)

    def tail_row(self, row: int, cut: float, step: float, bins: int, bin: int, pick: int) -> int:
        """The `pick`-th (ascending) output row of bin `bin` (see `tail_counts`)."""
        head = self.head
        return int(native_ops().int8_screen_tail(self.scores[row], self._summary_of(row), head.residual,
                                                 head.row_norm, head.magnitude, self.coefficients[row], head.maxima,
                                                 BF16_UNIT, head.tiny, cut, step, bins, bin, pick)[0])


def _round_up_float32(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the value."""
    rounded = values.float()
    below = rounded.double() < values
    return torch.where(below, torch.nextafter(rounded, torch.tensor(math.inf)), rounded)


ARRAYS = ("codes", "scales", "residual", "row_norm", "magnitude")  # what `quantize_head` derives from the weight


def quantize_head(head_weight: torch.Tensor, group: int = GROUP) -> dict[str, torch.Tensor]:
    """The screen's int8 copy of a [V, H] head and each output row's bound constants (see
    the module's docstring), in the layout `kernels/int8_screen.cpp` reads. Seconds for a
    large vocabulary: built once per machine and kept in the model cache (`head_cache.py`)."""
    V, H = head_weight.shape
    groups = -(-H // group)
    width = groups * group  # K padded to whole groups (zero weights, zero activations)
    blocks = -(-V // LANES)
    codes = torch.zeros(blocks * LANES, width, dtype=torch.int8)
    scales = torch.zeros(blocks * LANES, groups, dtype=torch.float32)
    residual = torch.zeros(V, dtype=torch.float32)
    row_norm = torch.zeros(V, dtype=torch.float32)
    magnitude = torch.zeros(V, dtype=torch.float32)
    for begin in range(0, V, 8192):  # float64 copies of the whole head would take gigabytes
        rows = slice(begin, min(begin + 8192, V))
        w = torch.nn.functional.pad(head_weight[rows].double(), (0, width - H)).view(-1, groups, group)
        scale = _round_up_float32(w.abs().amax(-1) / 127)  # float32 scales with |w / scale| <= 127
        safe = torch.where(scale > 0, scale.double(), torch.ones_like(scale, dtype=torch.float64))
        q = torch.round(w / safe.unsqueeze(-1)).clamp_(-127, 127)
        dequantized = q * scale.double().unsqueeze(-1)
        codes[rows] = q.view(-1, width).to(torch.int8)
        scales[rows] = scale
        # Inflated by 2^-40 for the float64 rounding of these sums, then rounded up.
        inflate = 1 + 2.0**-40
        residual[rows] = _round_up_float32((w - dequantized).view(-1, width).norm(dim=1) * inflate)
        row_norm[rows] = _round_up_float32(w.view(-1, width).norm(dim=1) * inflate)
        magnitude[rows] = _round_up_float32(
            (dequantized.abs().amax(dim=(1, 2)) + w.abs().amax(dim=(1, 2))) * inflate)
    # [blocks, K / 2, 16, 2]: per pair of columns, lane i holds row 16 j + i's two codes.
    return {"codes": codes.view(blocks, LANES, width // 2, 2).permute(0, 2, 1, 3).contiguous(),
            "scales": scales.view(blocks, LANES, groups).transpose(1, 2).contiguous(),
            "residual": residual, "row_norm": row_norm, "magnitude": magnitude}


class CertifiedHead:
    """Exact argmax of `head_weight @ h` (the plain head's bf16 logits) from an int8 screen.
    arrays: `quantize_head(head_weight, group)` made earlier (the model cache's copy);
    None derives them now."""

    draws = True  # its screen also serves sampled draws (`speculation/certified_sampling.py`)

    def __init__(self, head_weight: torch.Tensor, *, group: int = GROUP, cap: int = CANDIDATE_CAP,
                 arrays: dict[str, torch.Tensor] | None = None) -> None:
        V, H = head_weight.shape
        self.weight = head_weight
        self.vocab, self.hidden, self.group, self.cap = V, H, group, cap
        groups = -(-H // group)
        self.width = groups * group
        arrays = quantize_head(head_weight, group) if arrays is None else arrays
        self.codes, self.scales, self.residual, self.row_norm, self.magnitude = (arrays[name] for name in ARRAYS)
        blocks = -(-V // LANES)
        if tuple(self.codes.shape) != (blocks, self.width // 2, LANES, 2) or self.residual.shape != (V,):
            raise ValueError(f"the certified head's arrays do not fit a {V} x {H} head in groups of {group}")
        self.maxima = torch.stack([t.max().double() for t in (self.residual, self.row_norm, self.magnitude)])
        self.groups = groups
        roundings = self.width + 3 * groups + 4
        self.gamma = roundings * 2.0**-24 / (1 - roundings * 2.0**-24)
        self.tiny = 2.0**-100  # denormal products flushed to zero, H of them at most
        self.stats = HeadStats()

    @classmethod
    def for_model(cls, model) -> CertifiedHead | FileCertifiedHead | None:
        """The certified head of a prepared `Decoder`, or None where it does not apply:
        no native packed head (other dtypes, devices, no kernels), soft-capped logits,
        a non-finite head weight, or LONGSPEC_CERTIFIED_HEAD=0. A quantized GGUF target's
        head (the file's rows) gets its own screen (`runtime/file_screen.py`)."""
        packed = model._packed_head
        if os.environ.get(DISABLE_VARIABLE, "1") == "0" or packed is None:
            return None
        if model.config.final_logit_softcapping or native_ops() is None:
            return None
        if model.file_head is not None:
            # The file head's Q5_0 screen is opt-in: on Gemma 3 270M its bound spans several logits
            # and certifies no row, and the full product reads a Q8_0 head's own bytes, no more
            # than a screen of those codes would (docs/lab-notes/quantized-targets.md).
            if os.environ.get(FILE_SCREEN_VARIABLE, "0") != "1":
                return None
            from longspec.runtime.file_screen import FileCertifiedHead
            from longspec.runtime.head_cache import cached_file_screen

            with one_time("certified_head"):
                return FileCertifiedHead(model.file_head, cached_file_screen(model.file_head))
        if packed.tiles is None:
            return None
        from longspec.runtime.head_cache import cached_head_arrays

        weight = model.head_weight.detach()
        with one_time("certified_head"):
            arrays = cached_head_arrays(weight, GROUP)  # None: a non-finite weight
            return None if arrays is None else cls(weight, arrays=arrays)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.codes, self.scales, self.residual, self.row_norm, self.magnitude))

    def describe(self) -> str:
        """What its decisions read (for `longspec doctor`)."""
        return (f"an int8 copy of the {self.vocab:,} x {self.hidden} head ({self.nbytes / 2**20:.0f} MiB), "
                "recomputing the few rows that can matter")

    def quantize(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activation rows [N, H] (bf16) -> int16 codes [N, K], float32 scales [N, G], the
        bound's coefficients [N, 3] (float64: for ||r_i||, ||w_i||, and M_i + W_i) and
        which rows are finite (`kernels/int8_screen.cpp`, `quantize`)."""
        return native_ops().int8_screen_quantize(hidden.to(torch.bfloat16).contiguous(), self.group, self.groups,
                                                 self.gamma)

    def screen(self, hidden: torch.Tensor) -> Screen:
        """The screen of every row of `hidden` [N, H] (one pass over the int8 copy)."""
        codes, alpha, coefficients, finite = self.quantize(hidden)
        scores, summary = native_ops().int8_screen(codes, alpha, self.codes, self.scales, self.vocab, self.group)
        return Screen(self, scores, coefficients, finite, summary)

    def select(self, hidden: torch.Tensor, margins: torch.Tensor | None = None) -> list[Candidates | None]:
        """Per row of `hidden` [N, H]: the output rows whose plain logit could lie within
        `margins[row]` (float64 [N]; default 0: could be the largest) of the largest, in
        ascending order, with the bound every other row's logit is below; None where no
        certificate holds (a non-finite row or screen, or more than `cap` candidates:
        the caller takes the full head)."""
        return self.screen(hidden).select(margins)

    def exact_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The plain head's logits of output `rows` for every row of `hidden` [N, H]: the
        same bits as the full head's (its own kernel over a packed copy of those rows)."""
        ops = bf16_linear_ops()
        packed = ops.bf16_pack_rows(self.weight, rows.contiguous())
        return ops.bf16_packed_linear(hidden.contiguous(), packed, rows.numel(), None)

    def argmax(self, hidden: torch.Tensor, full_logits, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The plain head's argmax for every row of `hidden` [N, H] (bf16): int64 [N].
        `full_logits(rows)` gives the plain head's logits of some rows (the fallback).
        allowed [N, V] bool: the argmax among each row's allowed tokens (a grammar's mask,
        every row allowing some): the forbidden rows' screen is -inf, so the bound
        certifies the largest allowed logit."""
        screen = self.screen(hidden)
        if allowed is not None:
            screen = Screen(self, screen.scores.masked_fill(~allowed, float("-inf")), screen.coefficients,
                            screen.finite)  # no summary: the mask lowered some spans' largest score
        found = screen.select()
        return decide_rows(hidden, [None if c is None else c.rows for c in found], self.exact_logits, full_logits,
                           allowed)


def decide_rows(hidden: torch.Tensor, found: list[torch.Tensor | None], exact_logits, full_logits,
                allowed: torch.Tensor | None) -> torch.Tensor:
    """The argmax of each row of `hidden` from its certified candidates (`found[r]`, output
    rows ascending; None: no certificate), recomputed by `exact_logits(hidden, rows)`, or
    from `full_logits(hidden)` where none holds; `allowed` [N, V] masks a grammar's tokens."""
    tokens = torch.empty(hidden.shape[0], dtype=torch.long)
    certified = [r for r, c in enumerate(found) if c is not None]
    refused = [r for r, c in enumerate(found) if c is None]
    if certified:
        # Every row's candidates at once: a row's extra candidates (another row's) lie
        # strictly below its largest (allowed) logit, so they change nothing.
        union = torch.unique(torch.cat([found[r] for r in certified]))  # ascending
        exact = exact_logits(hidden[certified], union)
        if allowed is not None:
            exact = exact.masked_fill(~allowed[certified][:, union], float("-inf"))
        tokens[certified] = union[row_argmax(exact)]
    if refused:
        logits = full_logits(hidden[refused])
        if allowed is not None:
            logits = logits.masked_fill(~allowed[refused].to(logits.device), float("-inf"))
        tokens[refused] = row_argmax(logits).to(tokens.device)
    return tokens
