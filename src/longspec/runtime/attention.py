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

Shapes: q [B, Hq, T, D]; k_prefix/v_prefix [B, Hkv, P, D] (P may be 0);
prefix_mask bool [T, P] or None (all visible); k_new/v_new [B, Hkv, T, D] or None
(no new part: the caller already wrote them into the prefix); new_mask bool [T, T].
Hq must be a multiple of Hkv (grouped-query attention); K/V are never repeated.
"""

from __future__ import annotations

from typing import Protocol

import torch


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
    mask = prefix_mask if prefix_mask is not None else torch.ones((T, P), dtype=torch.bool, device=q.device)
    if k_new is not None:
        keys = torch.cat([k_prefix, k_new], dim=2)
        values = torch.cat([v_prefix, v_new], dim=2)
        mask = torch.cat([mask, new_mask], dim=1)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = keys.repeat_interleave(group, dim=1).to(compute)
    values = values.repeat_interleave(group, dim=1).to(compute)
    scores = (q.to(compute) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ values).to(q.dtype)


def fused_attention(q, k_prefix, v_prefix, prefix_mask, k_new, v_new, new_mask, scale):
    """PyTorch's CPU flash kernel for both parts (it returns the log-sum-exp that
    the merge needs). Grouped queries are stacked along the sequence axis so one
    K/V head serves its whole group without being copied."""
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


def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Combine two softmax-attention results over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    merged = out_a.to(weight_a.dtype) * weight_a + out_b.to(weight_b.dtype) * weight_b
    return merged.to(out_a.dtype)


def _grouped_flash(q, k, v, mask, scale):
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    stacked = q.reshape(B, Hkv, group * T, D)
    additive = None
    empty_rows = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        if group > 1:
            additive = additive.repeat(group, 1)
        empty_rows = ~mask.any(dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        stacked, k, v, 0.0, False, attn_mask=additive, scale=scale
    )
    out = out.reshape(B, Hq, T, D)
    lse = lse.reshape(B, Hq, T)
    if empty_rows is not None and bool(empty_rows.any()):
        # The kernel reports 0 for rows with no visible key; the merge needs -inf.
        lse = lse.masked_fill(empty_rows, float("-inf"))
    return out, lse
