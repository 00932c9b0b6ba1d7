"""The LongSpec/GLIDE draft network.

Per draft layer m (N_d layers, default 1):

    x = x + SelfAttn(RMSNorm(x))     sliding window over the draft's own recent tokens
    x = x + CrossAttn(RMSNorm(x))    queries onto the target's K/V of target layer
                                     `config.target_layers[m]`, read in place
    x = x + MLP(RMSNorm(x))

then a final RMSNorm and the target's own LM head. The input embedding and the
head are the target's tensors, passed in at call time (never copied into the
draft). Cross-attention queries are rotated with the target's RoPE of the
attended layer, so they meet the cached keys at agreeing positions.

How attention is computed is the caller's business: `forward` receives two
callables, one for self-attention (a fixed ring at inference, a masked full
sequence in training) and one for cross-attention (the committed prefix of the
target cache at inference, a visibility mask in training). The network itself
holds no cache and no mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from longspec.runtime.linear import packed_linear, prepack
from longspec.runtime.native import native_ops
from longspec.speculation.drafters.longspec.config import DraftConfig

# attend_self(layer, q, k, v) and attend_cross(layer, q) -> [B, heads, T, D]
SelfAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CrossAttention = Callable[[int, torch.Tensor], torch.Tensor]
Projection = Callable[[nn.Linear, torch.Tensor], torch.Tensor]


class PackedProjection:
    """Applies a frozen model's linear layers through the prepared forms of their
    bf16 weights (native kernels, or a oneDNN-prepacked copy; see
    runtime/linear.py). Built from the weights as they are now: rebuild it after
    the weights or their dtype change."""

    def __init__(self, model: nn.Module, *, native_kernels: bool = True) -> None:
        self._packed = {id(m): prepack(m.weight, native_kernels=native_kernels) for m in model.modules() if isinstance(m, nn.Linear)}

    def __call__(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, linear.weight, self._packed.get(id(linear)), linear.bias)


class DraftRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w in float32 (float64 stays float64), rounded once to
    the input's dtype. bf16 rows at inference take the runtime's one-pass native kernel
    (the same arithmetic) once `DraftModel.use_native_kernels` set it: a draft step normalises six rows of
    one token, where ten tensor operations each cost more than their arithmetic."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = None  # the native kernels, set by `DraftModel.use_native_kernels`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return self.native.rms_norm(x.contiguous(), self.weight.float(), self.eps, True)
        wide = x if x.dtype == torch.float64 else x.float()
        return (F.rms_norm(wide, (x.shape[-1],), eps=self.eps) * self.weight.to(wide.dtype)).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        c = config
        H = c.hidden_size
        self_dim = c.self_num_heads * c.self_head_dim
        cross_dim = c.cross_num_heads * c.cross_head_dim
        self.self_norm = DraftRMSNorm(H, c.rms_norm_eps)
        self.self_qkv = nn.Linear(H, 3 * self_dim, bias=False)
        self.self_out = nn.Linear(self_dim, H, bias=False)
        self.cross_norm = DraftRMSNorm(H, c.rms_norm_eps)
        self.cross_q = nn.Linear(H, cross_dim, bias=False)
        # Per-head query norm: the target's keys are normalised (Gemma, Qwen3) or not;
        # a learned norm lets the query scale adapt either way.
        self.cross_q_norm = DraftRMSNorm(c.cross_head_dim, c.rms_norm_eps)
        self.cross_out = nn.Linear(cross_dim, H, bias=False)
        self.mlp_norm = DraftRMSNorm(H, c.rms_norm_eps)
        self.gate_up = nn.Linear(H, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, H, bias=False)


class DraftModel(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.final_norm = DraftRMSNorm(config.hidden_size, config.rms_norm_eps)
        c = config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.self_head_dim, 2, dtype=torch.float32) / c.self_head_dim))
        self.register_buffer("self_inv_freq", inv_freq, persistent=False)
        # Rows of the shared head the draft scores (None: all). Saved with the weights.
        vocab = torch.arange(c.draft_vocab_size if c.draft_vocab_size else 0, dtype=torch.long)
        self.register_buffer("vocab_ids", vocab)
        if c.hidden_input:
            self.hidden_norm = DraftRMSNorm(c.hidden_size, c.rms_norm_eps)
            self.hidden_fuse = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)

    def use_native_kernels(self, enabled: bool) -> "DraftModel":
        """Let the norms take the runtime's native kernel for bf16 rows on the CPU
        (inference; a product that needs gradients stays in PyTorch)."""
        ops = native_ops() if enabled else None
        for module in self.modules():
            if isinstance(module, DraftRMSNorm):
                module.native = ops
        return self

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> "DraftModel":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64, device=generator.device) * std)
            if self.config.hidden_input:
                # Start as plain LongSpec (the embedding passes through); the hidden half learns.
                H = self.config.hidden_size
                self.hidden_fuse.weight[:, :H].copy_(torch.eye(H))
        return self

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        target_rope: tuple[torch.Tensor, torch.Tensor],
        attend_self: SelfAttention,
        attend_cross: CrossAttention,
        project: Projection | None = None,
        target_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: embedded input tokens [B, T, H] (the target's embedding); positions [T];
        target_hidden [B, T, H]: with `hidden_input`, the target's final hidden state at
        the newest target position each query may see (zeros where it sees none);
        target_rope: (cos, signed_sin) [T, D] of the target's attended layers;
        project(linear, x): how a linear layer is applied (default: the module
        itself; inference passes prepacked weights, see `PackedProjection`).
        Returns the final-normed hidden states [B, T, H]."""
        c = self.config
        apply = project or (lambda linear, inputs: linear(inputs))
        B, T, _ = x.shape
        if c.hidden_input:
            if target_hidden is None:
                raise ValueError("this draft fuses the target's hidden state into its input: pass target_hidden")
            x = apply(self.hidden_fuse, torch.cat([x, self.hidden_norm(target_hidden.to(x.dtype))], dim=-1))
        self_rope = self._self_rope(positions, x.dtype)
        cross_rope = tuple(t.to(x.dtype) for t in target_rope)
        for m, layer in enumerate(self.layers):
            qkv = apply(layer.self_qkv, layer.self_norm(x)).view(B, T, 3, c.self_num_heads, c.self_head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, Hs, T, Ds]
            q, k = apply_rope(q, *self_rope), apply_rope(k, *self_rope)
            attn = attend_self(m, q, k, v)
            x = x + apply(layer.self_out, attn.transpose(1, 2).reshape(B, T, -1))
            q = apply(layer.cross_q, layer.cross_norm(x)).view(B, T, c.cross_num_heads, c.cross_head_dim)
            q = apply_rope(layer.cross_q_norm(q).transpose(1, 2), *cross_rope)
            attn = attend_cross(m, q)
            x = x + apply(layer.cross_out, attn.transpose(1, 2).reshape(B, T, -1))
            gate, up = apply(layer.gate_up, layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + apply(layer.down, F.gelu(gate, approximate="tanh") * up)
        return self.final_norm(x)

    def _self_rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.self_inv_freq
        return rope_tables_from_freqs(freqs, 1.0, dtype)

    # ------------------------------------------------------------------ scores
    def head_rows(self, head: torch.Tensor) -> torch.Tensor:
        """The rows of the shared head this draft scores (a gather when reduced)."""
        return head.index_select(0, self.vocab_ids) if self.reduced_vocab else head

    def check_vocab_ids(self) -> None:
        """A reduced vocabulary must name distinct tokens of the target's vocabulary:
        a repeated id would give one token two rows, biasing the draft distribution q."""
        if not self.reduced_vocab:
            return
        ids = self.vocab_ids
        size = self.config.vocab_size
        outside = ids[(ids < 0) | (ids >= size)]
        if outside.numel():
            raise ValueError(f"draft vocabulary ids must lie in [0, {size}); found {outside[:5].tolist()}")
        unique, counts = torch.unique(ids, return_counts=True)
        repeated = unique[counts > 1]
        if repeated.numel():
            raise ValueError(
                f"draft vocabulary ids repeat {repeated.numel()} token(s), e.g. {repeated[:5].tolist()}: each target "
                "token may appear once (a repeat would count its probability twice); rebuild the checkpoint's vocab_ids"
            )

    def to_full_vocab(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[draft_ids] if self.reduced_vocab else draft_ids


def recency_slopes(num_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8h/H), h = 1..H: the steepest head looks at the
    last few keys, the flattest hundreds of keys back."""
    return torch.pow(2.0, -8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64, device=device) / num_heads)


def cross_attention_bias(config: DraftConfig, query_positions: torch.Tensor, key_positions: torch.Tensor,
                         visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive cross-attention bias [H, T, S]: -inf where a key is not visible (nor in
    the draft's cross window, nor a sink), else the recency bias (zero when the draft
    has none). Training and inference both build it from RoPE positions, so both see
    the same logits."""
    H = config.cross_num_heads
    lag = query_positions.unsqueeze(1) - key_positions.unsqueeze(0)
    if config.cross_window is not None:
        in_window = (lag <= config.cross_window) | (key_positions < config.cross_sinks).unsqueeze(0)
        visible = visible & in_window
    if config.recency_bias:
        bias = -recency_slopes(H, lag.device).view(H, 1, 1) * (lag.to(torch.float64) - 1).clamp(min=0)
    else:
        bias = torch.zeros((H, *visible.shape), dtype=torch.float64, device=visible.device)
    return bias.masked_fill(~visible, float("-inf")).to(dtype)


def cross_window_keys(config: DraftConfig, first_query_position: int, committed: int,
                      device: torch.device | None = None) -> torch.Tensor:
    """Positions of the committed target keys that queries at positions >= the first
    one may read: the sinks, then the window before the first query onwards (every
    committed key when the draft has no cross window)."""
    if config.cross_window is None:
        return torch.arange(committed, device=device)
    low = max(first_query_position - config.cross_window, 0)
    sinks = torch.arange(min(config.cross_sinks, low, committed), device=device)
    return torch.cat([sinks, torch.arange(min(low, committed), committed, device=device)])


def rope_tables_from_freqs(freqs: torch.Tensor, scaling: float, dtype: torch.dtype):
    """(cos, sign-folded sin) [T, D] from angle table [T, D/2], as the runtime does."""
    angles = torch.cat([freqs, freqs], dim=-1)
    cos = (angles.cos() * scaling).to(dtype)
    sin = (angles.sin() * scaling).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def target_rope(target, positions: torch.Tensor, dtype: torch.dtype):
    """The target's RoPE for its full-attention layers at `positions` (the draft
    only attends full-attention layers; see DraftConfig.for_target)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * target.inv_freq_full
    return rope_tables_from_freqs(freqs, target.rope_scaling[False], dtype)


class RopeRows:
    """RoPE tables (cos, signed sin) for the positions of a forward, gathered from
    tables computed once for a block of positions: drafting runs a few small forwards
    per round at neighbouring positions, where building the tables (a dozen small
    operations) costs as much as a draft layer's attention. The rows are the same
    numbers a direct computation gives (elementwise, position by position)."""

    BLOCK = 256  # positions per computed block (about a hundred rounds of drafting)

    def __init__(self, tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tables = tables  # positions [T] -> (cos, signed_sin) [T, D]
        self._first: int | None = None
        self._block: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = int(positions.min()), int(positions.max())
        if self._block is None or low < self._first or high >= self._first + self._block[0].shape[0]:
            self._first = low
            span = torch.arange(low, low + max(self.BLOCK, high - low + 1), device=positions.device)
            self._block = self.tables(span)
        rows = positions - self._first
        return self._block[0].index_select(0, rows), self._block[1].index_select(0, rows)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap if cap else logits


def chunked_cross_entropy(
    hidden: torch.Tensor, head_rows: torch.Tensor, labels: torch.Tensor, *, chunk: int = 256, cap: float | None = None
) -> torch.Tensor:
    """Sum of cross-entropy over rows of `hidden` [N, H] against `labels` [N]
    (-100 ignored), scoring `head_rows` [V, H] chunk by chunk. Each chunk's logits
    are recomputed in backward (activation checkpointing), so at most one chunk of
    vocabulary-sized logits is alive at any time."""

    def piece(h, y):
        # The head keeps its own dtype (bf16 for fast CPU matmuls); only h is cast.
        logits = softcap(h.to(head_rows.dtype) @ head_rows.t(), cap).float()
        return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for begin in range(0, hidden.shape[0], chunk):
        h, y = hidden[begin : begin + chunk], labels[begin : begin + chunk]
        if bool((y != -100).any()):
            total = total + (checkpoint(piece, h, y, use_reentrant=False) if h.requires_grad else piece(h, y))
    return total
