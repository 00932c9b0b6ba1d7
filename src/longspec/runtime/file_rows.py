"""A [rows, cols] tensor of a GGUF file kept as the file's own blocks, memory-mapped: the
quantized target's embedding and output layer (docs/design.md#quantized-targets).

The embedding reads only the rows it looks up, each dequantized exactly as the
dequantized (bf16) load converts it (the `gguf` package's float32 values, then bf16), so
no dense copy of the 262k-row vocabulary stays resident. The output layer's rows, in a
format the `gguf_linear` kernel runs, are repacked once for it (`quantized()`): the
target's logits are that kernel's products, the same definition for every method."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from longspec.runtime.quantized import FORMATS, QuantizedWeight, segment, stacked


@dataclass
class FileRows:
    name: str  # the GGUF tensor
    kind: int  # its GGML type
    raw: np.ndarray  # [rows, row bytes] uint8 (or [rows, cols] of a float type), a view of the file's map
    cols: int
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _packed: QuantizedWeight | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    @property
    def runs_quantized(self) -> bool:
        """Whether the `gguf_linear` kernel runs this format (else a dense bf16 copy serves)."""
        return self.kind in FORMATS

    def dequantize(self, index: np.ndarray | None = None) -> torch.Tensor:
        """bf16 [len(index), cols] of the rows `index` (None: every row); the `gguf`
        package's float32 values rounded once to bf16, as the dequantized load does."""
        import gguf

        raw = self.raw if index is None else self.raw[index]
        values = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType(self.kind))
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1, self.cols)).to(torch.bfloat16)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of token `ids` [...] as bf16 [..., cols] (each distinct row dequantized once)."""
        flat = ids.reshape(-1).cpu()
        unique, inverse = torch.unique(flat, return_inverse=True)
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= self.rows):
            raise IndexError(f"token ids must lie in [0, {self.rows}) for {self.name!r}")
        rows = self.dequantize(unique.numpy())
        return rows[inverse].view(*ids.shape, self.cols)

    def dense(self) -> torch.Tensor:
        """A bf16 copy of every row, made on first ask and kept (for a drafter that reads
        the target's embedding or head rows; plain decoding never asks)."""
        if self._dense is None:
            self._dense = self.dequantize()
        return self._dense

    def quantized(self) -> QuantizedWeight:
        """Every row repacked for `gguf_linear` (the file's bytes rearranged, checked), once."""
        if self._packed is None:
            self._packed = stacked([segment(self.name, self.kind, self.raw, self.rows, self.cols)], self.cols)
        return self._packed

    def select(self, rows: torch.Tensor) -> QuantizedWeight:
        """Just `rows` (ascending indices), repacked: the kernel's output for a row depends
        on that row and the activation alone, so these are the full product's bits."""
        picked = self.raw[rows.numpy()]
        return QuantizedWeight((segment(self.name, self.kind, picked, picked.shape[0], self.cols),), self.cols)
