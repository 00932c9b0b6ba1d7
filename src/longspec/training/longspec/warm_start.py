"""Warm start of a LongSpec draft from the target layer it cross-attends.

The draft's cross-attention reads that layer's K/V in place, so the layer's own query
and output projections (and its q norm) already speak the keys' language; its MLP
and norms fit the same residual stream. Copying them instead of drawing random
weights raised held-out agreement early in training
(docs/lab-notes/longspec-draft.md#training-ablations-held-out-agreement). The draft's
self-attention, input fusion and head stay as drawn.
"""

from __future__ import annotations

import torch

from longspec.runtime.model import Decoder, RMSNorm
from longspec.speculation.drafters.longspec.model import DraftModel


def norm_scale(norm: RMSNorm) -> torch.Tensor:
    """What the norm multiplies by: (1 + w) for Gemma-style norms, w otherwise."""
    weight = norm.weight.detach().float()
    return 1.0 + weight if norm.gemma else weight


@torch.no_grad()
def warm_start_from_target(draft: DraftModel, target: Decoder) -> DraftModel:
    """Copy, for each draft layer m, the attended target layer's q/o projections, q
    norm, input and MLP norms and MLP into the draft's cross-attention and MLP."""
    config = draft.config
    target_config = target.config
    if config.intermediate_size != target_config.intermediate_size:
        raise ValueError(f"warm start copies the target's MLP: the draft's intermediate_size ({config.intermediate_size}) "
                         f"must equal the target's ({target_config.intermediate_size})")
    q_dim = target_config.num_heads * target_config.head_dim
    for layer, index in zip(draft.layers, config.target_layers):
        source = target.layers[index]
        if source.qkv_bias is not None:
            raise ValueError("warm start does not carry the target's q/k/v bias; train this draft from scratch")
        dtype = layer.cross_q.weight.dtype
        layer.cross_q.weight.copy_(source.qkv_weight[:q_dim].to(dtype))
        layer.cross_out.weight.copy_(source.o_weight.to(dtype))
        layer.cross_norm.weight.copy_(norm_scale(source.input_norm))
        if source.qk_norm is not None:
            layer.cross_q_norm.weight.copy_(norm_scale(source.qk_norm)[0])  # the q heads share one norm
        layer.mlp_norm.weight.copy_(norm_scale(source.pre_mlp_norm))
        layer.gate_up.weight.copy_(source.gate_up_weight.to(dtype))
        layer.down.weight.copy_(source.down_weight.to(dtype))
    return draft
