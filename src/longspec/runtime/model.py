"""One config-driven decoder for the Llama, Mistral, Qwen2/2.5, Qwen3 and Gemma 3
text families, in plain PyTorch, over an engine-owned `KVCache`.

Weights keep the `transformers` parameter names on load; q/k/v and gate/up
projections are fused into one matrix each at load time (fewer, larger matmuls).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from longspec.runtime.argmax import row_argmax
from longspec.runtime.attention import AttentionBackend, Mask, flash_attention, fused_attention
from longspec.runtime.cache import KVCache
from longspec.runtime.certified_head import CertifiedHead
from longspec.runtime.config import DecoderConfig
from longspec.runtime.device import HOST
from longspec.runtime.file_rows import FileRows
from longspec.runtime.huge_pages import HUGE_PAGE_BYTES, huge_page_buffers
from longspec.runtime.linear import PackedWeight, pack_tiles, packed_linear, prepack, takes_tiles, tiles_nbytes
from longspec.runtime.native import native_ops
from longspec.runtime.quantized import QuantizedWeight
from longspec.runtime.ordered_keys import (
    FULL_CHUNK_POSITIONS,
    RING_CHUNK_POSITIONS,
    OrderedKeys,
    ordered_attention,
    ordered_attention_fits,
    prefix_then_pending,
    sorted_by_position,
)
from longspec.runtime.setup_time import one_time
from longspec.runtime.static_step import CompileOptions, StaticSteps

# Logits `greedy_tokens` holds at once through the packed head: 128 rows of a 262k
# vocabulary in bf16 (64 MiB), enough rows that reading the head is a small share.
GREEDY_LOGITS_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [B, len(logits_rows), V]; None when not asked for
    hidden: torch.Tensor  # final normed hidden states of those rows [B, rows, H]


class RMSNorm(nn.Module):
    """RMSNorm in float32 (float64 stays float64). Gemma scales by (1 + w) in float32;
    Llama-style families cast back to the activation dtype before scaling by w (as
    `transformers` does). `shape` may be [heads, head_dim] for per-head q/k norms.
    bf16 rows on the CPU take the native one-pass kernel when prepared with it."""

    def __init__(self, shape, eps: float, gemma: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape) if gemma else torch.ones(shape), requires_grad=False)
        self.eps = eps
        self.gemma = gemma
        self.scale: torch.Tensor | None = None  # (1 + w) in float32, set by prepare()
        self.native = None  # the native kernels, set by prepare() where they apply

    def prepare(self, native_kernels: bool = True) -> None:
        self.scale = (1.0 + self.weight.float()) if self.gemma else None
        applies = native_kernels and self.weight.device.type == "cpu" and self.weight.dtype == torch.bfloat16
        self.native = native_ops() if applies else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.requires_grad:
            return self.native.rms_norm(x.contiguous(), self.scale if self.gemma else self.weight, self.eps, self.gemma)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in PyTorch operations only (what a compiler can trace)."""
        wide = x if x.dtype == torch.float64 else x.float()
        normed = F.rms_norm(wide, (x.shape[-1],), eps=self.eps)
        if self.gemma:
            scale = self.scale if self.scale is not None and wide.dtype == torch.float32 else 1.0 + self.weight.to(wide.dtype)
            return (normed * scale).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, index: int) -> None:
        super().__init__()
        c = config
        self.index = index
        self.config = config
        self.sliding = c.layer_is_sliding[index]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(q_dim + 2 * kv_dim, c.hidden_size), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(q_dim + 2 * kv_dim), requires_grad=False) if c.attention_bias else None
        )
        self.o_weight = nn.Parameter(torch.empty(c.hidden_size, q_dim), requires_grad=False)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * c.intermediate_size, c.hidden_size), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(c.hidden_size, c.intermediate_size), requires_grad=False)
        g = c.gemma_norms
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.pre_mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, g)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, g) if g else None
        self.post_mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, g) if g else None
        # q and k norms as one per-head norm over the q heads then the k heads.
        heads = c.num_heads + c.num_kv_heads
        self.qk_norm = RMSNorm((heads, c.head_dim), c.rms_norm_eps, g) if c.qk_norm else None
        self.qk_dim = q_dim + kv_dim
        self.packed: dict[str, PackedWeight | None] = {}
        # Products kept in a GGUF file's quantization (`runtime.gguf_layers`); the bf16 parameter
        # beside each holds its dequantized copy (training's features, another device).
        self.quantized: dict[str, QuantizedWeight] = {}
        self.native_steps = None  # `project` and `finish` as native calls, where prepare() finds they apply
        self.native_prefill = False  # whether those calls also run a prefill's products (`bulk`)
        self.step_weights: dict[str, tuple[list, list, list]] = {}  # each product's weight for those calls

    PRODUCTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def prepare(self, native_kernels: bool = True, bulk: bool | None = None,
                tiles: dict[str, torch.Tensor] | None = None) -> None:
        """Load-time derived weights: prepacked matrices and norm scales. bulk: keep
        prefill's copies (`runtime.linear`; None: where they pay). tiles: packed copies
        already made (`Decoder._prepare`), by product name."""
        for name in self.PRODUCTS:
            if self.keeps_quantized(name):
                self.packed[name] = PackedWeight(onednn=None, quantized=self.quantized[name])
                continue
            self.packed[name] = prepack(getattr(self, name), native_kernels=native_kernels, bulk=bulk,
                                        tiles=(tiles or {}).get(name))
        for norm in (self.input_norm, self.pre_mlp_norm, self.post_attn_norm, self.post_mlp_norm, self.qk_norm):
            if norm is not None:
                norm.prepare(native_kernels)
        self.native_steps = self._native_steps()

    def keeps_quantized(self, name: str) -> bool:
        return name in self.quantized and self.qkv_weight.device.type == "cpu"

    def _native_steps(self):
        """The native ops that run `project`'s and `finish`'s steps in one call each
        (`kernels/layer_steps.cpp`, the same bits), where every product of the layer runs a
        native kernel (bf16 packed tiles or a GGUF quantized weight) and every norm the native
        norm; else None. Sets each product's weight as those calls take it."""
        self.step_weights = {}
        for name, packed in self.packed.items():
            if packed is None or (packed.tiles is None and packed.quantized is None):
                return None
            self.step_weights[name] = step_weight(packed, getattr(self, name).shape[0])
        norms = (self.input_norm, self.pre_mlp_norm, self.post_attn_norm, self.post_mlp_norm, self.qk_norm)
        if any(norm is not None and norm.native is None for norm in norms):
            return None
        # A prefill's products differ from a step's only where a weight keeps oneDNN's copy for them.
        self.native_prefill = all(packed.bulk is None for packed in self.packed.values())
        return native_ops()

    def _steps_natively(self, x, plain: bool, bulk: bool) -> bool:
        return (self.native_steps is not None and not plain and (self.native_prefill or not bulk)
                and x.dtype == torch.bfloat16 and not x.requires_grad)

    @staticmethod
    def _norm_scale(norm: "RMSNorm | None"):
        """What the native norm takes: Gemma's float32 (1 + w), else the bf16 weight."""
        return None if norm is None else norm.scale if norm.gemma else norm.weight

    def _linear(self, x, name: str, bias=None, plain: bool = False, bulk: bool = False):
        weight = getattr(self, name)
        packed = self.packed.get(name)
        if plain and (packed is None or packed.quantized is None):  # a quantized weight has no other product
            return F.linear(x, weight, bias)
        return packed_linear(x, weight, packed, bias, bulk)

    @staticmethod
    def _norm(norm: RMSNorm, x, plain: bool):
        return norm.plain(x) if plain else norm(x)

    def project(self, x, rope, plain: bool = False, packing: "Packing | None" = None, bulk: bool = False):
        """q [B, Hq, T, D] with RoPE, and this forward's k (with RoPE) and v [B, Hkv, T, D].
        plain: PyTorch operations only (what a compiler traces), not the native kernels.
        packing: x holds only the real tokens of a padded batch ([N, H]); the padding
        gets zero q, k and v. bulk: a prefill's products (`runtime.linear`)."""
        c = self.config
        if packing is None and self._steps_natively(x, plain, bulk):
            return self._native_project(x, rope)
        qkv = self._linear(self._norm(self.input_norm, x, plain), "qkv_weight", self.qkv_bias, plain, bulk)
        if packing is not None:
            qkv = packing.unpack(qkv)
        B, T, _ = qkv.shape
        qk = qkv[..., : self.qk_dim].view(B, T, c.num_heads + c.num_kv_heads, c.head_dim)
        if self.qk_norm is not None:
            qk = self._norm(self.qk_norm, qk, plain)
        qk = apply_rope(qk.transpose(1, 2), *rope)
        q, k = qk.split((c.num_heads, c.num_kv_heads), dim=1)
        v = qkv[..., self.qk_dim :].view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def finish(self, x, attn, plain: bool = False, packing: "Packing | None" = None, bulk: bool = False):
        """The residual stream after this layer, from its attention output [B, Hq, T, D]
        (with `packing`, x and the result hold the real tokens only)."""
        c = self.config
        B, T = attn.shape[0], attn.shape[2]
        out = attn.transpose(1, 2).reshape(B, T, -1)
        if packing is not None:
            out = packing.pack(out)
        if self._steps_natively(x, plain, bulk):
            return self._native_finish(x, out)
        out = self._linear(out, "o_weight", plain=plain, bulk=bulk)
        if self.post_attn_norm is not None:
            out = self._norm(self.post_attn_norm, out, plain)
        x = x + out
        gate, up = self._linear(self._norm(self.pre_mlp_norm, x, plain), "gate_up_weight", plain=plain,
                                bulk=bulk).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if c.activation == "gelu_tanh" else F.silu(gate)
        out = self._linear(act * up, "down_weight", plain=plain, bulk=bulk)
        if self.post_mlp_norm is not None:
            out = self._norm(self.post_mlp_norm, out, plain)
        return x + out

    def _native_project(self, x, rope):
        c = self.config
        B = x.shape[0]
        q, k, v = self.native_steps.layer_head(
            x.reshape(-1, c.hidden_size).contiguous(), B, self._norm_scale(self.input_norm),
            *self.step_weights["qkv_weight"], self.qkv_bias, self._norm_scale(self.qk_norm), c.num_heads,
            c.num_kv_heads, c.head_dim, *rope, self.input_norm.eps, c.gemma_norms)
        return q, k, v

    def _native_finish(self, x, attn_rows):
        c = self.config
        w = self.step_weights
        out = self.native_steps.layer_tail(
            x.reshape(-1, c.hidden_size).contiguous(), attn_rows.reshape(-1, attn_rows.shape[-1]).contiguous(),
            *w["o_weight"], self._norm_scale(self.post_attn_norm), self._norm_scale(self.pre_mlp_norm),
            *w["gate_up_weight"], *w["down_weight"], self._norm_scale(self.post_mlp_norm),
            self.pre_mlp_norm.eps, c.gemma_norms, c.activation == "gelu_tanh")
        return out.view(x.shape)

    def forward(self, x, rope, plan: "ForwardPlan", cache: KVCache, attention: AttentionBackend):
        c = self.config
        q, k, v = self.project(x, rope, packing=plan.packing, bulk=plan.bulk)
        cache.store(self.index, k, v)
        if plan.ordered is not None:
            # Every key this forward reads, committed and pending, in position order.
            k_all, v_all = cache.prefix(self.index, include_pending=True)
            attn = ordered_attention(q, k_all, v_all, plan.ordered[self.sliding], c.attention_scale)
        elif self.sliding:
            # The ring holds this forward's tokens too; one masked call covers the
            # window of committed keys and the tree visibility among new tokens.
            k_ring, v_ring = cache.prefix(self.index)
            attn = attention(q, k_ring, v_ring, plan.ring_mask, None, None, None, c.attention_scale)
        elif plan.full_mask is not None:
            # Rows of a batch end at different slots: one masked call over every
            # row's prefix and its own pending tokens.
            k_all, v_all = cache.prefix(self.index, include_pending=True)
            attn = attention(q, k_all, v_all, plan.full_mask, None, None, None, c.attention_scale)
        elif plan.single_token:
            # One new token sees everything: attend the cache including itself, no mask.
            k_all, v_all = cache.prefix(self.index, include_pending=True)
            attn = attention(q, k_all, v_all, None, None, None, None, c.attention_scale)
        else:
            k_pre, v_pre = cache.prefix(self.index)
            attn = attention(q, k_pre, v_pre, None, k, v, plan.new_mask, c.attention_scale)
        return self.finish(x, attn, packing=plan.packing, bulk=plan.bulk)


@dataclass(frozen=True)
class Packing:
    """The real tokens of a padded [B, T] forward (rows of a batch whose trees differ
    in size): norms, products and activations run on these N tokens only, and
    attention, which needs each row's layout, sees them scattered back to [B, T] with
    zeros in the padding (masked out: no real token sees a padding key). A row's
    products are the same bits however many rows share them (`runtime.linear`), so
    the real tokens come out exactly as in the padded forward."""

    index: torch.Tensor  # [N] flat indices of the real tokens in B * T
    batch: int
    tokens: int

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]"""
        return x.reshape(self.batch * self.tokens, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros at the padding."""
        out = x.new_zeros((self.batch * self.tokens, *x.shape[1:]))
        out.index_copy_(0, self.index, x)
        return out.view(self.batch, self.tokens, *x.shape[1:])


@dataclass
class ForwardPlan:
    """Masks and positions shared by all layers of one forward."""

    positions: torch.Tensor  # [T], or [B, T] for the rows of a batch
    new_mask: Mask | None  # [T, T] visibility among the new tokens (None for a batch: see full_mask)
    ring_mask: Mask | None  # [(B,) T, R] visible ring slots: committed in window, and new tokens per new_mask
    single_token: bool
    # Rows of a batch only: [B, T, S] visible full-layer slots, each row's committed
    # prefix and its own pending tokens.
    full_mask: Mask | None = None
    packing: Packing | None = None  # padded rows of a batch: per-token work on the real tokens only
    # The native kernel's keys in position order, per kind of layer (sliding: True), where
    # it serves this forward: a token's attention is then the same bits in any forward.
    ordered: dict[bool, OrderedKeys] | None = None
    bulk: bool = False  # a prefill: products through the bulk path (`runtime.linear`)


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig, rope_inv_freq: dict[bool, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.config = config
        self.embed_weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        self.lm_head_weight = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )
        for sliding, (inv_freq, scaling) in rope_inv_freq.items():
            self.register_buffer(f"inv_freq_{'sliding' if sliding else 'full'}", inv_freq, persistent=False)
        self.rope_scaling = {s: scaling for s, (_, scaling) in rope_inv_freq.items()}
        self.attention: AttentionBackend = fused_attention
        self.native_kernels = True  # whether prepare() chose the native CPU kernels where they apply
        self._packed_head: PackedWeight | None = None
        self._certified_head: CertifiedHead | None | bool = False  # False: not built yet (`certified_head`)
        self.static_steps: StaticSteps | None = None  # compiled decode/verify steps (`compile_steps`); off by default
        self.on_huge_pages = False  # whether prepare() moved the large CPU weights onto huge pages
        # A quantized GGUF target's embedding and output layer as the file's rows (`runtime.file_rows`):
        # lookups dequantize the rows they read, the logits are the `gguf_linear` kernel's.
        self.file_embedding: FileRows | None = None
        self.file_head: FileRows | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def head_weight(self) -> torch.Tensor:
        """The head as a dense weight (a quantized target's: a bf16 copy made on first ask,
        for drafters that read the target's head rows; its logits never read it)."""
        return self._head_param if self.file_head is None else self.file_head.dense()

    @property
    def _head_param(self) -> torch.Tensor:
        return self.embed_weight if self.lm_head_weight is None else self.lm_head_weight

    def assign(self, params: dict[str, torch.Tensor], tables: dict, quantized: list[dict] | None = None) -> None:
        """Take a model built on the meta device to its loaded parameters: `params` in our
        fused names, the RoPE tables it was built with, and per layer the products kept in a
        GGUF file's quantization. Every parameter and buffer must be loaded."""
        self.load_state_dict(params, strict=False, assign=True)
        for sliding, (inv_freq, _) in tables.items():
            setattr(self, f"inv_freq_{'sliding' if sliding else 'full'}", inv_freq)
        missing = [n for n, t in list(self.named_parameters()) + list(self.named_buffers()) if t.is_meta]
        if missing:
            raise KeyError(f"parameters not loaded: {missing[:5]}")
        for layer, kept in zip(self.layers, quantized or []):
            layer.quantized = dict(kept)

    def new_cache(self, capacity: int, *, batch_size: int = 1, max_forward_tokens: int = 256) -> KVCache:
        return KVCache(
            self.config,
            capacity,
            batch_size=batch_size,
            max_forward_tokens=max_forward_tokens,
            dtype=self.dtype,
            device=self.device,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.file_embedding is not None:
            x = self.file_embedding.lookup(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_weight)
        if self.config.embedding_scale is not None:
            # transformers rounds the scale to the activation dtype first; so do we.
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype, device=x.device)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = packed_linear(hidden, self._head_param, self._packed_head)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        tree_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        with_logits: bool = True,
        real_tokens: torch.Tensor | None = None,
        prefill: bool = False,
    ) -> ForwardOutput:
        """Run T new tokens [B, T] after the cache's committed prefix.

        tree_mask: [T, T] bool ancestor mask (None: causal, i.e. a chain); [B, T, T]
            for the rows of a `RowsView` (a batch), one tree per row.
        positions: [T] RoPE positions (None: consecutive after the prefix); [B, T]
            for the rows of a batch, each after its own prefix.
        logits_rows: which of the T rows get logits (None: all).
        with_logits: False returns only those rows' hidden states (see `greedy_tokens`).
        real_tokens: [B, T] bool, False at a batch's padding: per-token work skips it
            (`Packing`) and its hidden states come back as zeros.
        prefill: a prompt piece (committed as it is, never verified): the products may
            take the bulk path of `runtime.linear`, whose rows are not the bits a decode
            step or a tree computes for the same token.
        The new tokens are left *pending* in the cache: call cache.commit(...).
        """
        B, T = input_ids.shape
        # Callers may pass host tensors (a tree's tokens, depths and mask): one copy here.
        device = self.device
        input_ids = input_ids.to(device)
        if tree_mask is not None:
            tree_mask = tree_mask.to(device)
        positions = cache.next_positions(T) if positions is None else positions.to(device)
        size = self._static_size(T, cache, positions, logits_rows, with_logits)
        if size is not None:
            out = self.static_steps.forward(input_ids, cache, tree_mask, positions, size)
            if out is not None:
                return ForwardOutput(logits=out[0], hidden=out[1])
        cache.begin_forward(positions)
        plan = self._plan(T, cache, tree_mask, positions)
        if real_tokens is not None and not bool(real_tokens.all()):
            index = torch.nonzero(real_tokens.reshape(-1)).flatten().to(device)
            plan = replace(plan, packing=Packing(index, B, T))
        if prefill:
            plan = replace(plan, bulk=True)
        rope = {s: self._rope(plan.positions, s) for s in set(self.config.layer_is_sliding)}
        x = self.embed(input_ids if plan.packing is None else plan.packing.pack(input_ids))
        for layer in self.layers:
            x = layer(x, rope[layer.sliding], plan, cache, self.attention)
        if plan.packing is not None:
            hidden = plan.packing.unpack(self.final_norm(x))
            hidden = hidden if logits_rows is None else hidden[:, logits_rows]
        else:
            hidden = self.final_norm(x if logits_rows is None else x[:, logits_rows])
        return ForwardOutput(logits=self.logits(hidden) if with_logits else None, hidden=hidden)

    @property
    def packed_head(self) -> PackedWeight | None:
        """The head's prepared form for `packed_linear` (None where the plain product runs)."""
        return self._packed_head

    @property
    def certified_head(self) -> CertifiedHead | None:
        """The int8-screened head that certifies the plain head's argmax
        (`runtime/certified_head.py`), built on first use; None where it does not apply."""
        if self._certified_head is False:
            self._certified_head = CertifiedHead.for_model(self)
        return self._certified_head

    @torch.inference_mode()
    def decide(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the plain head's logits for each row of `hidden` [N, H] (first
        index of the largest, as `row_argmax`), through the certified head where there
        is one: [N] int64 on the host."""
        head = self.certified_head
        if head is None:
            return row_argmax(self.logits(hidden)).to(HOST)
        return head.argmax(hidden, self.logits)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor, vocab_chunk: int = 16384) -> torch.Tensor:
        """argmax of the logits of `hidden` [..., H] without [rows, V] logits existing at
        once (for 512 rows of a 262k vocabulary that tensor alone is 268 MB in float32).
        The final soft-cap is monotonic and leaves the argmax unchanged, so it is skipped.

        Where the head is prepacked (bf16 on the CPU), a few rows at a time go through it:
        the product the served logits come from, and on CPUs without AVX-512 BF16 faster
        than slices of the plain bf16 head (docs/lab-notes/training.md#training-the-longspec-draft-on-avx2-cpus-11-faster-first-epochs-the-noisy-shift-weighted-toward-depth-1-issue-longspec-draft-that-pays).
        Elsewhere the head is scored a slice of the vocabulary (`vocab_chunk` rows) at a time."""
        if self._packed_head is not None and hidden.device.type == "cpu" and hidden.dtype == self._head_param.dtype:
            rows = hidden.reshape(-1, hidden.shape[-1])
            step = max(1, GREEDY_LOGITS_ELEMENTS // self._head_param.shape[0])
            best = [row_argmax(packed_linear(rows[i : i + step], self._head_param, self._packed_head))
                    for i in range(0, rows.shape[0], step)]
            return (torch.cat(best) if best else rows.new_empty(0, dtype=torch.long)).view(hidden.shape[:-1])
        best_value = best_index = None
        for begin in range(0, self.head_weight.shape[0], vocab_chunk):
            scores = F.linear(hidden, self.head_weight[begin : begin + vocab_chunk]).float()
            value, index = scores.max(dim=-1)
            index = index + begin
            if best_value is None:
                best_value, best_index = value, index
            else:
                better = value > best_value  # ties keep the earlier index, as argmax does
                best_value = torch.where(better, value, best_value)
                best_index = torch.where(better, index, best_index)
        return best_index

    def compile_steps(self, options=None) -> "Decoder":
        """Run decode steps and verification trees through compiled static-shape
        steps (`runtime.static_step`; CUDA graphs on a GPU). options: a
        `CompileOptions` (None: the device's default); False turns them off."""
        if options is False:
            self.static_steps = None
        else:
            self.static_steps = StaticSteps(self, options or CompileOptions.for_device(self.device))
        return self

    def _static_size(self, T, cache, positions, logits_rows, with_logits) -> int | None:
        """The static step's bucket for this forward, or None to run it eagerly. A model with
        quantized layers runs eagerly: the compiled step is PyTorch operations only, and a
        quantized product is a native kernel (`gguf_linear`) no compiler traces."""
        if self.static_steps is None or logits_rows is not None or not with_logits or positions.dim() != 1:
            return None
        if any(layer.quantized for layer in self.layers):
            return None
        return self.static_steps.bucket(T, cache)

    def place(self, device: torch.device) -> "Decoder":
        """Move the weights to `device` and derive its inference-time weights again
        (keeping the choice of native CPU kernels)."""
        if self.file_embedding is not None and torch.device(device).type != "cpu":
            raise ValueError("a quantized GGUF target runs on the CPU; load it with dtype='bfloat16' for another device")
        if torch.device(device) != self.device:
            self.on_huge_pages = False  # the copies made on the new device are ordinary memory
        self.to(device).prepare(self.native_kernels)
        if self.static_steps is not None:  # graphs compiled for the old device do not apply
            self.compile_steps(self.static_steps.options)
        return self

    def prepare(self, native_kernels: bool = True, before_copy: Callable[[], None] | None = None) -> "Decoder":
        """Derive inference-time weights (prepacked matrices on CPU, norm scales). Call
        after loading, moving or changing weights; the loaders do. native_kernels=False
        keeps every linear layer on oneDNN / `F.linear` (see `runtime.linear`).
        before_copy: called right before the packed copies are made (`linear.pack_tiles`)."""
        with one_time("packing"):
            return self._prepare(native_kernels, before_copy)

    def _prepare(self, native_kernels: bool, before_copy: Callable[[], None] | None = None) -> "Decoder":
        huge_pages = native_kernels and self.device.type == "cpu" and self.dtype == torch.bfloat16
        bulk = None if prefill_copies_fit(self) else False
        tiles, self.on_huge_pages = self._pack_tiles(native_kernels, huge_pages, before_copy)
        for i, layer in enumerate(self.layers):
            layer.prepare(native_kernels, bulk, {name: t for (j, name), t in tiles.items() if j == i})
        self.final_norm.prepare(native_kernels)
        self.native_kernels = native_kernels
        self._packed_head = (prepack(self.head_weight, native_kernels=native_kernels, tiles=tiles.get((None, "head")))
                             if self.file_head is None else PackedWeight(onednn=None, quantized=self.file_head.quantized()))
        self._certified_head = False  # built again from the prepared head on first use
        if self.attention in (fused_attention, flash_attention):
            cpu_without_native = self.device.type == "cpu" and not native_kernels
            self.attention = flash_attention if cpu_without_native else fused_attention
        return self

    def _pack_tiles(self, native_kernels: bool, huge_pages: bool,
                    before_copy: Callable[[], None] | None = None) -> tuple[dict, bool]:
        """The native kernel's packed copies of every product and the head, by (layer, name)
        ((None, "head") for the head), all made by one call (`linear.pack_tiles`), and whether
        they went onto huge pages. Only the packed copies, which every product streams, go there
        (packed straight into the mapping): the plain weights are read a row at a time (the
        embedding, a certified head's candidates) or not at all (docs/lab-notes/startup.md)."""
        weights = {(i, name): getattr(layer, name) for i, layer in enumerate(self.layers)
                   for name in DecoderLayer.PRODUCTS if not layer.keeps_quantized(name)}
        if self.file_head is None:
            weights[(None, "head")] = self.head_weight
        weights = {key: w for key, w in weights.items() if takes_tiles(w, native_kernels)}
        if not weights:
            if before_copy is not None:
                before_copy()
            return {}, huge_pages and huge_page_buffers([]) is not None
        large = [key for key, w in weights.items() if huge_pages and tiles_nbytes(w) >= HUGE_PAGE_BYTES]
        buffers = huge_page_buffers([tiles_nbytes(weights[key]) for key in large]) if huge_pages else None
        outs = dict(zip(large, buffers or []))
        packed = pack_tiles(list(weights.values()), [outs.get(key) for key in weights], before_copy)
        return dict(zip(weights, packed)), buffers is not None

    def _packed_weights(self) -> list[PackedWeight]:
        packed = [p for layer in self.layers for p in layer.packed.values()] + [self._packed_head]
        return [p for p in packed if p is not None]

    def _plan(self, T, cache, tree_mask, positions) -> ForwardPlan:
        if positions.dim() == 2:
            return self._rows_plan(T, cache, tree_mask, positions)
        if tree_mask is None:
            new_mask = torch.ones((T, T), dtype=torch.bool, device=positions.device).tril_()
        else:
            new_mask = tree_mask
        ring_mask = None
        if any(self.config.layer_is_sliding):
            window = self.config.sliding_window
            distance = positions.unsqueeze(1) - positions.unsqueeze(0)
            ring_mask = cache.ring_prefix_mask(positions)
            ring_mask[:, cache.pending_ring_slots] = new_mask & (distance < window)
            ring_mask = Mask(ring_mask)
        ordered = None
        if self._orders_keys(T):
            ordered = {}
            if not all(self.config.layer_is_sliding):
                ordered[False] = prefix_then_pending(cache.length, positions, new_mask, FULL_CHUNK_POSITIONS)
            if ring_mask is not None:
                ordered[True] = sorted_by_position(
                    cache.ring_positions.unsqueeze(0), ring_mask.visible.unsqueeze(0), RING_CHUNK_POSITIONS
                )
        return ForwardPlan(positions, Mask(new_mask), ring_mask, single_token=T == 1, ordered=ordered)

    def _rows_plan(self, T, cache, tree_mask, positions) -> ForwardPlan:
        """Masks of a forward over the rows of a batch: every row has its own
        committed length, positions and tree. One row is planned as a single sequence
        (the same attention calls, so the same bits, as a single run)."""
        B = positions.shape[0]
        if B == 1:
            mask = None if tree_mask is None else (tree_mask if tree_mask.dim() == 2 else tree_mask[0])
            return self._plan(T, cache.as_sequence(), mask, positions[0])
        if tree_mask is None:
            tree_mask = torch.ones((T, T), dtype=torch.bool, device=positions.device).tril_()
        tree_mask = tree_mask.expand(B, T, T)
        sliding = self.config.layer_is_sliding
        full_mask = Mask(cache.full_mask(tree_mask)) if not all(sliding) else None
        ring_mask = Mask(cache.ring_mask(positions, tree_mask)) if any(sliding) else None
        ordered = None
        if self._orders_keys(T):
            ordered = {}
            if full_mask is not None:
                S = full_mask.visible.shape[-1]
                slot_positions = torch.arange(S, device=positions.device).repeat(B, 1)
                slot_positions.scatter_(1, cache.pending_slots, positions)
                ordered[False] = sorted_by_position(slot_positions, full_mask.visible, FULL_CHUNK_POSITIONS)
            if ring_mask is not None:
                ordered[True] = sorted_by_position(cache.ring_positions, ring_mask.visible, RING_CHUNK_POSITIONS)
        return ForwardPlan(positions, None, ring_mask, single_token=False, full_mask=full_mask, ordered=ordered)

    def _orders_keys(self, T: int) -> bool:
        """Whether this forward's attention goes through the native kernel over keys in
        position order (`runtime.ordered_keys`); another backend set on the model, a
        prompt chunk or a device without the kernel keep the paths below."""
        return self.attention is fused_attention and ordered_attention_fits(
            self.dtype, self.device, T, self.config.head_dim
        )

    def _rope(self, positions: torch.Tensor, sliding: bool):
        """cos and a sign-folded sin [T, D] in the activation dtype, computed in
        float32 as `transformers` does ([B, 1, T, D] for per-row positions [B, T]).
        A float64 model computes them in float64: float32 cos/sin round differently
        by device (1e-7 apart between CPU and CUDA), which float64 runs must not inherit."""
        inv_freq = getattr(self, f"inv_freq_{'sliding' if sliding else 'full'}")
        compute = torch.promote_types(self.dtype, torch.float32)
        freqs = positions.to(compute).unsqueeze(-1) * inv_freq.to(compute)
        scaling = self.rope_scaling[sliding]
        cos = (torch.cat([freqs, freqs], dim=-1).cos() * scaling).to(self.dtype)
        sin = (torch.cat([freqs, freqs], dim=-1).sin() * scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        if positions.dim() == 2:
            return cos.unsqueeze(1), signed_sin.unsqueeze(1)  # broadcast over heads
        return cos, signed_sin


# The kind `layer_head`/`layer_tail` read as the bf16 kernel's packed tiles; other kinds are GGML's.
PACKED_BF16_KIND = -1


def step_weight(packed: PackedWeight, out_features: int) -> tuple[list, list, list]:
    """A product's weight as the native layer steps take it: (parts, kinds, rows), the
    quantized weight's segments or the bf16 tiles as one part of kind `PACKED_BF16_KIND`."""
    if packed.quantized is not None:
        segments = packed.quantized.segments
        return [s.packed for s in segments], [s.kind for s in segments], [s.rows for s in segments]
    return [packed.tiles], [PACKED_BF16_KIND], [out_features]


def prefill_copies_fit(model: "Decoder") -> bool:
    """Whether one more copy of the layers' weights (prefill's, `runtime.linear`) takes
    under a tenth of this machine's memory; a larger model keeps prefill on the native
    kernel rather than grow by a third."""
    layers = sum(p.numel() * p.element_size() for layer in model.layers for p in layer.parameters())
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return layers < memory / 10


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, D]; cos/signed_sin [T, D] or [B, 1, T, D]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
