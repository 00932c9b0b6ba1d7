"""The native selective scan and the Mamba sequence forward built on it: the same
function and gradients as `transformers`' Mamba (which computes A and the scan's
products in float32 even for a float64 model, hence its tolerances), exact gradients by
finite differences in float64, and the float32 vector path against float64."""

from __future__ import annotations

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from longspec.runtime.native import native_ops
from longspec.speculation.drafters.mamba.sequence import MambaSequenceLM, SelectiveScan

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernel library is unavailable")


def scan_inputs(batch, length, channels, states, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    u, B, C, D = draw(batch, length, channels), draw(batch, length, states), draw(batch, length, states), draw(channels)
    delta = torch.rand(batch, length, channels, generator=generator, dtype=torch.float64) * 0.5 + 0.01
    A = -(torch.rand(channels, states, generator=generator, dtype=torch.float64) * 4 + 0.1)
    return [t.to(dtype).requires_grad_() for t in (u, delta, A, B, C, D)]


def reference_scan(u, delta, A, B, C, D):
    """The recurrence written out in PyTorch, one time step at a time."""
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=u.dtype)
    outputs = []
    for t in range(u.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        outputs.append((h * C[:, t, None, :]).sum(-1) + D * u[:, t])
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("states", [3, 16])
def test_scan_gradients_are_exact_in_float64(states):
    inputs = scan_inputs(2, 7, 5, states, torch.float64)
    assert torch.autograd.gradcheck(SelectiveScan.apply, inputs)
    assert torch.allclose(SelectiveScan.apply(*inputs), reference_scan(*inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("states", [16, 32])  # the float32 vector path (16 states per register)
def test_float32_scan_matches_float64(states):
    exact = scan_inputs(2, 37, 19, states, torch.float64, seed=1)
    single = [t.detach().float().requires_grad_() for t in exact]
    y64, y32 = SelectiveScan.apply(*exact), SelectiveScan.apply(*single)
    weights = torch.randn(y64.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads64 = torch.autograd.grad((y64 * weights).sum(), exact)
    grads32 = torch.autograd.grad((y32 * weights.float()).sum(), single)
    assert torch.allclose(y32.double(), y64, rtol=1e-5, atol=1e-5)
    for g32, g64 in zip(grads32, grads64):
        assert torch.allclose(g32.double(), g64, rtol=1e-4, atol=1e-4 * g64.abs().max().item())


def test_sequence_forward_equals_transformers_mamba():
    config = MambaConfig(vocab_size=61, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2,
                         residual_in_fp32=False, pad_vocab_size_multiple=1,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = MambaForCausalLM(config).double()
    ids = torch.randint(0, config.vocab_size, (3, 23))
    reference = model(input_ids=ids).logits
    reference.square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    logits = MambaSequenceLM(model)(ids).logits
    logits.square().sum().backward()
    assert torch.allclose(logits, reference, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], rtol=1e-5, atol=1e-5 * expected[name].abs().max().item()), name
