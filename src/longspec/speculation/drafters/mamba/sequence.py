"""A `transformers` Mamba run over whole sequences with the selective scan in a native
CPU kernel (`runtime/kernels/selective_scan.cpp`), forward and backward.

`transformers`' Mamba has no CPU kernel: its reference path steps through time in
Python, one small batched product per token and layer: for the 8-layer, d_model 256
drafter `longspec train mamba` builds, training ran several times slower than a
transformer drafter of the same size
(docs/lab-notes/mamba-and-draft-models.md#training-the-selective-scan-in-a-native-kernel).
The module here computes the same function from the same parameters (the model stays
`transformers`' own, saved and loaded as such); only the recurrence moves into C++.
Off the CPU, or where the native library is unavailable, it runs the model's own
forward (`mamba-ssm`'s kernels on a GPU where installed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutput

from longspec.runtime.native import native_ops


class SelectiveScan(torch.autograd.Function):
    """y = scan(u, delta, A, B, C) + D * u (layouts in the kernel's header)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D):
        ops = native_ops()
        u, delta, A, B, C, D = (t.contiguous() for t in (u, delta, A, B, C, D))
        y, _ = ops.selective_scan_forward(u, delta, A, B, C, D)
        ctx.save_for_backward(u, delta, A, B, C, D)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        u, delta, A, B, C, D = ctx.saved_tensors
        du, ddelta, dA, dB, dC, dD = native_ops().selective_scan_backward(u, delta, A, B, C, D, grad_y.contiguous())
        return du, ddelta, dA.sum(0), dB, dC, dD.sum(0)


def native_scan_applies(model: torch.nn.Module) -> bool:
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype in (torch.float32, torch.float64) and native_ops() is not None


def mixer_forward(mixer, hidden: torch.Tensor) -> torch.Tensor:
    """What `MambaMixer.forward` computes without a cache, the scan native."""
    length = hidden.shape[1]
    x, gate = mixer.in_proj(hidden).chunk(2, dim=-1)  # [B, L, D] each
    x = mixer.act(mixer.conv1d(x.transpose(1, 2))[..., :length]).transpose(1, 2)  # causal depthwise convolution
    step, B, C = torch.split(mixer.x_proj(x), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    delta = F.softplus(mixer.dt_proj(step))
    A = -torch.exp(mixer.A_log.to(x.dtype))
    y = SelectiveScan.apply(x, delta, A, B, C, mixer.D.to(x.dtype))
    return mixer.out_proj(y * mixer.act(gate))


class MambaSequenceLM(torch.nn.Module):
    """Logits of a `transformers` Mamba causal LM over whole sequences from the empty
    state (training rows); `model` holds every parameter."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        if not native_scan_applies(self.model):
            return CausalLMOutput(logits=self.model(input_ids=input_ids).logits)
        backbone = self.model.backbone
        hidden = backbone.embeddings(input_ids)
        for block in backbone.layers:
            residual = hidden.float() if block.residual_in_fp32 else hidden
            hidden = residual + mixer_forward(block.mixer, block.norm(hidden.to(block.norm.weight.dtype)))
        hidden = backbone.norm_f(hidden)
        return CausalLMOutput(logits=self.model.lm_head(hidden.to(self.model.lm_head.weight.dtype)).float())
