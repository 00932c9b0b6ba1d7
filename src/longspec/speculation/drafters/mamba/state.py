"""The Mamba drafter's per-sequence state and its decoding step, computed from a
`transformers` Mamba's own parameters.

`transformers`' decoding step for an 8-layer, d_model 256 drafter costs about as much
per drafted depth as a target forward on a 2-core CPU, so no drafter could pay
(docs/lab-notes/mamba-and-draft-models.md#drafting-states-and-a-step-of-our-own-from-transformers-parameters).
Most of a step is reading weights: the 32k-token output layer alone is 33 MB in
float32. Here the products run in the model's dtype through the runtime's
prepared linear layers (bf16 on a bf16 target: the native few-row kernel / oneDNN),
while the recurrence (convolution window, SSM state, scan) stays in float32 as
`mamba-ssm` keeps it, with the state updated in one native call per layer on the CPU.
The state is plain tensors (rows = tree branches), copied by `index_select` into
buffers that the drafter reuses.

Many tokens at once (a prompt, or the tokens a drafter skipped) go through the native
scan on the CPU, from the empty state or a given one; elsewhere, or without the native
library, a prompt goes through the model's own forward, whose cache is read into a
`MambaState`, and later tokens step one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longspec.runtime.linear import packed_linear, prepack
from longspec.runtime.native import native_ops


@dataclass
class MambaState:
    """Per layer: `conv` [rows, D, K-1], the last K-1 inputs of the causal convolution
    (oldest first); `ssm` [rows, D, N], the SSM state."""

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.ssm[0].shape[0]

    def select(self, rows: torch.Tensor, out: MambaState | None = None) -> MambaState:
        """This state's rows at `rows` (copies), written into `out` when it has that many rows."""
        if out is None or out.rows != rows.numel():
            return MambaState([c.index_select(0, rows) for c in self.conv], [s.index_select(0, rows) for s in self.ssm])
        for source, target in zip(self.conv + self.ssm, out.conv + out.ssm):
            torch.index_select(source, 0, rows, out=target)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)


class _Linear:
    """A model's linear layer with its weight prepared for inference."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = prepack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x.to(self.weight.dtype), self.weight, self.packed, self.bias)


class _Layer:
    """One Mamba block's parameters in the forms the step uses (recurrence in `dtype`)."""

    def __init__(self, block, dtype: torch.dtype) -> None:
        mixer = block.mixer
        self.norm = block.norm
        self.residual_in_fp32 = block.residual_in_fp32
        self.act = mixer.act
        self.split = [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size]
        self.in_proj, self.x_proj, self.dt_proj, self.out_proj = (
            _Linear(m) for m in (mixer.in_proj, mixer.x_proj, mixer.dt_proj, mixer.out_proj))
        self.conv_weight = mixer.conv1d.weight[:, 0].to(dtype)  # [D, K]
        self.conv_bias = mixer.conv1d.bias.to(dtype) if mixer.conv1d.bias is not None else None
        self.A = (-torch.exp(mixer.A_log.to(dtype))).contiguous()
        self.D = mixer.D.to(dtype).contiguous()

    def mix_in(self, hidden: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(residual, x before the convolution, gate), the last two in `dtype`."""
        residual = hidden.float() if self.residual_in_fp32 else hidden
        x, gate = self.in_proj(self.norm(hidden.to(self.norm.weight.dtype))).to(dtype).chunk(2, dim=-1)
        return residual, x, gate

    def selective_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(delta, B, C) for the convolved x, in x's dtype."""
        step, B, C = torch.split(self.x_proj(x).to(x.dtype), self.split, dim=-1)
        return F.softplus(self.dt_proj(step).to(x.dtype)), B.contiguous(), C.contiguous()

    def mix_out(self, residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = self.out_proj(y * self.act(gate))
        return residual + out.to(residual.dtype)


class MambaStepper:
    """Runs a `transformers` Mamba causal LM (`MambaForCausalLM`) by states. It holds
    prepared copies of the weights as they are when it is built (`prepared_for` says
    whether the model has moved since)."""

    def __init__(self, model) -> None:
        self.model = model
        weights = next(model.parameters())
        self._placement = (weights.device, weights.dtype)
        self.dtype = torch.promote_types(weights.dtype, torch.float32)  # the recurrence's
        cpu = weights.device.type == "cpu"
        self.native = native_ops() if cpu else None
        self.layers = [_Layer(block, self.dtype) for block in model.backbone.layers]
        self.head = _Linear(model.lm_head)

    def prepared_for(self, model) -> bool:
        weights = next(model.parameters())
        return model is self.model and (weights.device, weights.dtype) == self._placement

    def run(self, ids: torch.Tensor, state: MambaState | None = None) -> tuple[torch.Tensor, MambaState]:
        """Feed `ids` ([L]) after `state` (one row; None: the empty state) in one pass:
        (logits after the last id [V], the state after them); `state` is kept as it was."""
        if self.native is None:
            if state is None:
                return self._reference_prompt(ids)
            state = state.select(torch.zeros(1, dtype=torch.long, device=ids.device))
            for i in range(ids.numel()):
                logits = self.step(state, ids[i : i + 1])[0]
            return logits, state
        hidden = self.model.backbone.embeddings(ids.unsqueeze(0))
        conv, ssm = [], []
        for index, layer in enumerate(self.layers):
            residual, x, gate = layer.mix_in(hidden, self.dtype)
            keep = layer.conv_weight.shape[1] - 1
            before = x.new_zeros(1, x.shape[-1], keep) if state is None else state.conv[index]
            window = torch.cat([before, x.transpose(1, 2)], dim=-1)  # [1, D, keep + L]
            conv.append(window[..., window.shape[-1] - keep :].contiguous())
            x = layer.act(F.conv1d(window, layer.conv_weight.unsqueeze(1), layer.conv_bias, groups=x.shape[-1]))
            x = x.transpose(1, 2).contiguous()
            delta, B, C = layer.selective_inputs(x)
            initial = None if state is None else state.ssm[index]
            y, last = self.native.selective_scan_forward(x, delta.contiguous(), layer.A, B, C, layer.D, initial)
            ssm.append(last)
            hidden = layer.mix_out(residual, y, gate)
        return self._logits(hidden[0, -1:])[0], MambaState(conv, ssm)

    def _reference_prompt(self, ids: torch.Tensor) -> tuple[torch.Tensor, MambaState]:
        """The model's own forward (e.g. `mamba-ssm`'s kernels on a GPU), its cache read out."""
        out = self.model(ids.unsqueeze(0), use_cache=True)
        # `transformers` names the output's cache `cache` from 5.2x on, `cache_params` before;
        # its per-layer states are read the same way in both.
        cache = out.cache if "cache" in out else out.cache_params
        conv, ssm = [], []
        for layer in cache.layers[: len(self.layers)]:
            window = layer.conv_states[0]  # [1, D, K]: the last K inputs
            conv.append(window[..., 1:].to(self.dtype).contiguous())
            ssm.append(layer.recurrent_states[0].to(self.dtype).contiguous())
        return out.logits[0, -1].float(), MambaState(conv, ssm)

    def step(self, state: MambaState, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([rows]); `state` advances in place. Returns [rows, V] float logits."""
        hidden = self.model.backbone.embeddings(tokens)  # [rows, H]
        for layer, conv, ssm in zip(self.layers, state.conv, state.ssm):
            residual, x, gate = layer.mix_in(hidden, self.dtype)
            window = torch.cat([conv, x.unsqueeze(-1)], dim=-1)  # [rows, D, K]
            conv.copy_(window[..., 1:])
            x = (window * layer.conv_weight).sum(-1)
            x = layer.act(x if layer.conv_bias is None else x + layer.conv_bias).contiguous()
            delta, B, C = layer.selective_inputs(x)
            if self.native is not None:
                y = self.native.selective_state_step(ssm, x, delta.contiguous(), layer.A, B, C, layer.D)
            else:
                ssm.mul_(torch.exp(delta.unsqueeze(-1) * layer.A)).add_(delta.unsqueeze(-1) * B.unsqueeze(1) * x.unsqueeze(-1))
                y = (ssm @ C.unsqueeze(-1)).squeeze(-1) + layer.D * x
            hidden = layer.mix_out(residual, y, gate)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.model.backbone.norm_f(hidden)).float()
