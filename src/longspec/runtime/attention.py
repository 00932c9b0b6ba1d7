"""Attention backends behind one signature.

Every target forward splits attention into two parts (Hybrid Tree Attention):

* the committed prefix, read in place from the cache: no mask at all for full
  layers, or a [T, P] window/validity mask for sliding layers' rings;
* the new tokens of this forward (a prompt chunk, a decode token, or a speculative
  tree) attending each other under a [T, T] mask (causal, or the tree's ancestor
  mask, intersected with the window).

The two partial softmaxes are merged by their log-sum-exp. `reference_attention`
computes the same thing the obvious way (concatenate, one masked softmax) and is
the oracle in tests.

`fused_attention` is the fast path of whatever device the tensors are on: on the
CPU, the native few-query kernel (`kernels/few_query_attention.cpp`) for up to
`NATIVE_ATTENTION_MAX_QUERIES` bf16 queries per row (decode steps, trees) and PyTorch's
flash kernel otherwise (`flash_attention`, also the whole CPU path when native kernels
are off); on a GPU, the Triton tree kernel for a tree over an
unmasked prefix (one pass, no merge) and `sdpa_attention` otherwise (PyTorch's
scaled-dot-product kernels, which pick flash / memory-efficient / math per device;
cuDNN's is left out, see `scaled_dot_product`).

Shapes: q [B, Hq, T, D]; k_prefix/v_prefix [B, Hkv, P, D] (P may be 0);
prefix_mask [T, P] or None (all visible); k_new/v_new [B, Hkv, N, D] or None
(no new part: the caller already wrote them into the prefix); new_mask [T, N]. N = T
for a forward's own tokens (new_mask is then a causal or tree mask); a LongSpec
draft's cross-attention passes the target's newest keys as the new part (N != T).
Masks are bool tensors (True = visible) or `Mask` objects wrapping one; a mask
may also be [B, T, S], one per batch row (rows of different lengths and trees).
Hq must be a multiple of Hkv (grouped-query attention); K/V are never repeated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from longspec.runtime.native import attention_ops

logger = logging.getLogger(__name__)


class Mask:
    """A [T, S] (or per batch row [B, T, S]) visibility mask (True = visible) that
    remembers the forms the fused kernel needs, so a forward converts it once for
    all its layers, not per layer."""

    def __init__(self, visible: torch.Tensor) -> None:
        self.visible = visible
        self.empty_rows = ~visible.any(dim=-1)  # [T] or [B, T]
        self.has_empty_rows = bool(self.empty_rows.any())
        self._bias: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    @property
    def per_row(self) -> bool:
        return self.visible.dim() == 3

    def bias(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """Additive mask (0 / -inf) repeated for `group` stacked query heads:
        [group*T, S], or [B, 1, group*T, S] for a per-row mask."""
        key = (dtype, group)
        if key not in self._bias:
            bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device).masked_fill_(~self.visible, float("-inf"))
            if group > 1:
                bias = bias.repeat(1, group, 1) if self.per_row else bias.repeat(group, 1)
            self._bias[key] = bias.unsqueeze(1) if self.per_row else bias
        return self._bias[key]

    def head_broadcast(self, rows: torch.Tensor) -> torch.Tensor:
        """A [T] or [B, T] per-query tensor shaped to broadcast over [B, H, T]."""
        return rows.unsqueeze(1) if self.per_row else rows


def as_mask(mask: "Mask | torch.Tensor | None") -> "Mask | None":
    return mask if mask is None or isinstance(mask, Mask) else Mask(mask)


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        prefix_mask: torch.Tensor | None,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        new_mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor: ...


def reference_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    B, Hq, T, D = q.shape
    group = Hq // k_prefix.shape[1]
    P = k_prefix.shape[2]
    keys, values = k_prefix, v_prefix
    mask = as_mask(prefix_mask).visible if prefix_mask is not None else torch.ones((T, P), dtype=torch.bool, device=q.device)
    if k_new is not None:
        keys = torch.cat([k_prefix, k_new], dim=2)
        values = torch.cat([v_prefix, v_new], dim=2)
        new_visible = as_mask(new_mask).visible
        if new_visible.dim() > mask.dim():  # per-row tree masks over a prefix shared by all
            mask = mask.expand(B, *mask.shape)
        mask = torch.cat([mask, new_visible], dim=-1)
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)  # one mask per batch row, shared by its heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = keys.repeat_interleave(group, dim=1).to(compute)
    values = values.repeat_interleave(group, dim=1).to(compute)
    scores = (q.to(compute) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ values).to(q.dtype)


def fused_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    """The device's fast path (see the module's doc)."""
    if q.device.type != "cpu":
        if tree_kernel_serves(q, prefix_mask, k_new):
            return tree_kernel_attention(q, k_prefix, v_prefix, new_mask, k_new, v_new, scale)
        return sdpa_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale)
    if native_attention_fits(q, k_prefix if k_new is None else k_new):
        return native_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale)
    return flash_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale)


# Up to this many new tokens per row the native kernel beats PyTorch's flash kernel
# (per call, Gemma 3 270M's heads, 1-8 rows over 512-16k keys; at 129 flash wins over 512
# keys: docs/lab-notes/attention.md#few-query-attention-at-long-context-issue-runtime-speed).
# 65 = a 64-node verification tree and its root; prompt chunks go to flash.
NATIVE_ATTENTION_MAX_QUERIES = 65


def native_attention_fits(q, k) -> bool:
    """A few bf16 queries per row, a head dimension of whole 32-value registers, and
    the native kernels built on a CPU with AVX-512 BF16 or AVX2 (inference only: no backward)."""
    return (
        q.shape[2] <= NATIVE_ATTENTION_MAX_QUERIES
        and q.dtype == torch.bfloat16
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        and q.shape[-1] % 32 == 0
        and attention_ops() is not None
    )


def native_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    """Both parts through the native few-query kernel, merged by log-sum-exp."""
    q = q.contiguous()
    parts = [
        native_part(q, k, v, mask, scale)
        for k, v, mask in ((k_prefix, v_prefix, prefix_mask), (k_new, v_new, new_mask))
        if k is not None and k.shape[2] > 0
    ]
    if not parts:
        raise ValueError("attention over zero keys")
    if len(parts) == 1:
        return parts[0][0]
    (out_a, lse_a), (out_b, lse_b) = parts
    return merge_partial_attention(out_a, lse_a, out_b, lse_b)


def native_part(q, k, v, mask, scale):
    """(out, lse) of q over one part of the keys under `mask` (None: all visible)."""
    visible = None
    if mask is not None:
        visible = as_mask(mask).visible
        visible = (visible if visible.dim() == 3 else visible.unsqueeze(0)).contiguous()
    return attention_ops().few_query_attention(q, k, v, visible, scale)


def flash_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    """The CPU path through PyTorch's flash kernel for both parts (it returns the
    log-sum-exp that the merge needs). Grouped queries are stacked along the sequence
    axis so one K/V head serves its whole group without being copied."""
    out_prefix, lse_prefix = None, None
    if k_prefix.shape[2] > 0:
        out_prefix, lse_prefix = _grouped_flash(q, k_prefix, v_prefix, prefix_mask, scale)
    if k_new is None:
        if out_prefix is None:
            raise ValueError("attention over zero keys")
        return out_prefix
    out_new, lse_new = _grouped_flash(q, k_new, v_new, new_mask, scale)
    if out_prefix is None:
        return out_new
    return merge_partial_attention(out_prefix, lse_prefix, out_new, lse_new)


def sdpa_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    """Any device. One part (no new keys): PyTorch's `scaled_dot_product_attention`
    with grouped query heads stacked (K/V never repeated). Two parts: each with its
    log-sum-exp in float32 (float64 stays float64), merged."""
    if k_new is None:
        if k_prefix.shape[2] == 0:
            raise ValueError("attention over zero keys")
        return _grouped_sdpa(q, k_prefix, v_prefix, as_mask(prefix_mask), scale)
    out_new, lse_new = _grouped_attention_with_lse(q, k_new, v_new, as_mask(new_mask), scale)
    if k_prefix.shape[2] == 0:
        return out_new.to(q.dtype)
    out_prefix, lse_prefix = _grouped_attention_with_lse(q, k_prefix, v_prefix, as_mask(prefix_mask), scale)
    return merge_partial_attention(out_prefix, lse_prefix, out_new, lse_new).to(q.dtype)


def tree_kernel_serves(q, prefix_mask, k_new) -> bool:
    """Whether a call is the Triton kernel's case: the forward's own T tokens as the
    new part (a draft's cross-attention passes a tail of the target's keys instead,
    whose count differs) over an unmasked prefix, and the kernel available."""
    return (k_new is not None and k_new.shape[2] == q.shape[2] and prefix_mask is None
            and tree_kernel_fits(q, None))


def tree_kernel_fits(q, new_mask) -> bool:
    """Whether the Triton tree kernel serves this call (a GPU tensor of a dtype it
    computes in, Triton installed); the first refusal is logged with its reason."""
    reason = _tree_kernel_unavailable()
    if reason is None and q.dtype not in _tree_kernel_dtypes():
        reason = f"it does not compute in {q.dtype}"
    if reason is not None:
        _log_fallback_once(q.device.type, reason)
        return False
    return True


def tree_kernel_attention(q, k_prefix, v_prefix, new_mask, k_new, v_new, scale):
    """The Triton tree kernel behind the backend signature: every row reads its whole
    prefix (no prefix mask), the new tokens under `new_mask` ([T, T] or [B, T, T])."""
    from longspec.runtime.triton_tree_attention import tree_attention

    B, P = q.shape[0], k_prefix.shape[2]
    lengths = torch.full((B,), P, dtype=torch.int32, device=q.device)
    out, _ = tree_attention(q, k_prefix, v_prefix, lengths, k_new, v_new, as_mask(new_mask).visible, scale)
    return out


@functools.cache
def _log_fallback_once(device_type: str, reason: str) -> None:
    logger.warning("tree attention on %s uses PyTorch's SDPA kernels: the Triton kernel is unavailable (%s)",
                   device_type, reason)


def _tree_kernel_unavailable() -> str | None:
    return "triton is not installed" if importlib.util.find_spec("triton") is None else None


def _tree_kernel_dtypes() -> tuple[torch.dtype, ...]:
    from longspec.runtime.triton_tree_attention import SUPPORTED_DTYPES

    return SUPPORTED_DTYPES


def _grouped_sdpa(q, k, v, mask, scale):
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    stacked = q.reshape(B, Hkv, group * T, D)
    additive = None if mask is None else mask.bias(q.dtype, group)
    out = scaled_dot_product(stacked, k, v, additive, scale).reshape(B, Hq, T, D)
    if mask is not None and mask.has_empty_rows:  # rows that see no key: 0, not NaN
        out = out.masked_fill(mask.head_broadcast(mask.empty_rows).unsqueeze(-1), 0.0)
    return out


def _grouped_attention_with_lse(q, k, v, mask, scale):
    """Output (in the compute dtype) and log-sum-exp [B, Hq, T] (-inf for a query
    that sees no key), scores materialised once per call: this serves the few tree
    queries of a round, not a long prefill."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    stacked = q.reshape(B, Hkv, group * T, D).to(compute)
    scores = (stacked @ k.to(compute).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.bias(compute, group)
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = (probs @ v.to(compute)).reshape(B, Hq, T, D)
    return out, lse.reshape(B, Hq, T)


def biased_attention(q, k, v, bias, scale):
    """Attention of q [B, Hq, T, D] over k/v [B, Hkv, S, D] with an additive bias
    [Hq, T, S] per query head (-inf hides a key; a row that sees no key gives 0),
    through the same flash kernel (SDPA off the CPU), grouped query heads stacked so
    K/V are never repeated."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    empty = torch.isneginf(bias).all(dim=-1)  # [Hq, T]
    if bool(empty.any()):
        bias = bias.masked_fill(empty.unsqueeze(-1), 0.0)
    stacked = q.reshape(B, Hkv, group * T, D)
    additive = bias.to(q.dtype).reshape(1, Hkv, group * T, bias.shape[-1])
    if q.device.type == "cpu":
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            stacked, k, v, 0.0, False, attn_mask=additive, scale=scale
        )
    else:
        out = scaled_dot_product(stacked, k, v, additive, scale)
    return out.reshape(B, Hq, T, D).masked_fill(empty.view(1, Hq, T, 1), 0.0)


# cuDNN's attention builds an execution graph for every new shape, and a decode step
# has one more key than the last: on an H100 the graph builds took most of the host
# time of Gemma-shaped decode steps (profiled in
# docs/lab-notes/gpu.md#first-run-on-a-gpu-issue-devices-what-it-found-and-fixed). The
# other backends need no per-shape plan. Compiled static steps keep fixed shapes and all
# backends.
SHAPE_VARYING_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def scaled_dot_product(q, k, v, attn_mask, scale):
    """PyTorch's `scaled_dot_product_attention`, on a GPU without cuDNN's backend."""
    backends = sdpa_kernel(list(SHAPE_VARYING_BACKENDS)) if q.is_cuda else contextlib.nullcontext()
    with backends:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Combine two softmax-attention results over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    merged = out_a.to(weight_a.dtype) * weight_a + out_b.to(weight_b.dtype) * weight_b
    return merged.to(out_a.dtype)


def _grouped_flash(q, k, v, mask, scale):
    mask = as_mask(mask)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    stacked = q.reshape(B, Hkv, group * T, D)
    additive = None if mask is None else mask.bias(q.dtype, group)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        stacked, k, v, 0.0, False, attn_mask=additive, scale=scale
    )
    out = out.reshape(B, Hq, T, D)
    lse = lse.reshape(B, Hq, T)
    if mask is not None and mask.has_empty_rows:
        # Rows with no visible key: the kernel's output there is undefined (0 or
        # NaN depending on its blocking); the merge needs out 0 and lse -inf.
        empty = mask.head_broadcast(mask.empty_rows)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse
