"""The native CPU kernels (runtime/kernels/): the bf16 few-row product is correctly
rounded and gives a row the same bits however many rows share the call; decode
attention is within one bf16 ulp of the exact result on ragged shapes and masks; the
one-pass RMSNorm computes what the PyTorch path computes; bf16 decoders are as
accurate with them as without; a logged fallback where they cannot be had."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from longspec.runtime import bf16_matvec as matvec
from longspec.runtime import native
from longspec.runtime.attention import flash_attention, fused_attention, reference_attention
from longspec.runtime.linear import packed_linear, prepack
from longspec.runtime.model import RMSNorm
from test_runtime_equivalence import run_chunks
from tiny_models import FAMILIES, random_ids, tiny_pair

KERNEL = matvec.bf16_matvec()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native bf16 kernel unavailable here (reason logged)")
needs_library = pytest.mark.skipif(native.native_ops() is None, reason="native kernels unavailable here (reason logged)")


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 numbers (8 significant bits)."""
    exponent = torch.floor(torch.log2(values.double().abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("inner", [40, 64, 96, 640, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_within_one_ulp_of_the_exact_result(rows, inner, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + inner)
    x = torch.randn(rows, inner, generator=generator).bfloat16()
    weight = torch.randn(301, inner, generator=generator).bfloat16()  # 301: rows not a multiple of any block
    bias = torch.randn(301, generator=generator).bfloat16() if with_bias else None
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    ours = KERNEL(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, 301)
    # float32 accumulation then one rounding: at most one bf16 ulp from the exact product.
    assert ((ours.double() - exact).abs() <= bf16_ulp(exact)).all()


@needs_kernel
def test_a_row_gets_the_same_bits_alone_or_with_others():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4, 640, generator=generator).bfloat16()
    weight = torch.randn(1000, 640, generator=generator).bfloat16()
    together = KERNEL(x, weight, None)
    for row in range(4):
        assert torch.equal(KERNEL(x[row : row + 1], weight, None), together[row : row + 1])


@needs_kernel
def test_packed_linear_sends_few_rows_to_the_kernel_and_many_to_onednn(monkeypatch):
    weight = torch.randn(64, 32).bfloat16()
    packed = prepack(weight)
    assert packed.matvec is KERNEL and prepack(weight, native_kernels=False).matvec is None
    calls = []
    monkeypatch.setattr(matvec.Bf16Matvec, "__call__", lambda self, x, w, b: calls.append(x.shape) or F.linear(x, w, b))
    for rows in (1, KERNEL.max_rows, KERNEL.max_rows + 1):
        packed_linear(torch.randn(1, rows, 32).bfloat16(), weight, packed)
    assert calls == [(1, 1, 32), (1, KERNEL.max_rows, 32)]


@needs_kernel
@pytest.mark.parametrize("rows, kv_heads, group, keys", [(1, 1, 4, 1), (1, 1, 4, 700), (2, 2, 2, 129), (3, 1, 16, 128), (2, 4, 1, 300)])
@pytest.mark.parametrize("head_dim", [32, 256])
@pytest.mark.parametrize("mask", ["none", "shared", "per_row"])
def test_decode_attention_is_within_one_ulp_of_the_exact_result(rows, kv_heads, group, keys, head_dim, mask):
    generator = torch.Generator().manual_seed(rows * 7 + keys + head_dim)
    q = torch.randn(rows, kv_heads * group, 1, head_dim, generator=generator).bfloat16()
    # K/V as the cache hands them over: a view of the first `keys` slots of a larger buffer.
    k = torch.randn(rows, kv_heads, keys + 9, head_dim, generator=generator).bfloat16()[:, :, :keys]
    v = torch.randn(rows, kv_heads, keys + 9, head_dim, generator=generator).bfloat16()[:, :, :keys]
    visible = None
    if mask != "none":
        visible = torch.rand(rows if mask == "per_row" else 1, 1, keys, generator=generator) < 0.7
        visible[..., 0] = True  # a decode query always sees at least itself
        visible = visible if mask == "per_row" else visible[0]
    scale = head_dim**-0.5
    ours = fused_attention(q, k, v, visible, None, None, None, scale)
    exact = reference_attention(q.double(), k.double(), v.double(), visible, None, None, None, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    assert ((ours.double() - exact).abs() <= bf16_ulp(exact) + 1e-5).all()
    # And no less accurate than PyTorch's flash kernel on the same inputs.
    flash = flash_attention(q, k, v, visible, None, None, None, scale)
    assert (ours.double() - exact).abs().max() <= (flash.double() - exact).abs().max() + 1e-6


@needs_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_decoder_with_the_kernel_is_as_accurate_as_without(family):
    """Token-by-token decode in bf16 (every linear, norm and attention through the
    native kernels) against the same weights in float64: no worse than the PyTorch /
    oneDNN path or `transformers`' own bf16."""
    # head_dim 32: the native decode attention takes whole 32-value registers.
    hf_model, decoder = tiny_pair(family, dtype=torch.bfloat16, seed=FAMILIES.index(family), head_dim=32)
    ids = random_ids(40, seed=3)
    with torch.no_grad():
        hf_bf16 = hf_model(ids).logits
        exact = hf_model.to(torch.float64)(ids).logits
    assert all(layer.packed["qkv_weight"].matvec is KERNEL and layer.input_norm.native for layer in decoder.layers)
    assert decoder.attention is fused_attention
    with_kernel = run_chunks(decoder, ids, [1] * ids.shape[1])
    decoder.prepare(native_kernels=False)
    assert decoder.attention is flash_attention
    without = run_chunks(decoder, ids, [1] * ids.shape[1])

    def error(logits):  # root mean square: the largest single error moves ±25% with rounding luck
        return (logits.double() - exact).pow(2).mean().sqrt().item()

    assert error(with_kernel) <= 1.1 * max(error(without), error(hf_bf16))


@needs_kernel
def test_training_keeps_the_differentiable_path():
    """The kernels have no backward: a product or an attention that needs gradients
    goes through PyTorch, so a draft trained in bf16 still learns."""
    weight = torch.randn(64, 32).bfloat16().requires_grad_()
    x = torch.randn(1, 32).bfloat16().requires_grad_()
    packed_linear(x, weight, prepack(weight.detach())).float().sum().backward()
    assert x.grad is not None and weight.grad is not None
    q = torch.randn(1, 4, 1, 32).bfloat16().requires_grad_()
    k = torch.randn(1, 1, 10, 32).bfloat16()
    fused_attention(q, k, k, None, None, None, None, 0.2).float().sum().backward()
    assert q.grad is not None


@needs_library
@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("shape, normalised", [((3, 5, 64), (64,)), ((2, 3, 6, 16), (6, 16))])
def test_native_rms_norm_computes_what_the_pytorch_path_computes(gemma, shape, normalised):
    generator = torch.Generator().manual_seed(len(shape) + gemma)
    norm = RMSNorm(normalised, eps=1e-6, gemma=gemma)
    norm.weight.data = (torch.randn(normalised, generator=generator) * 0.3 + (0.0 if gemma else 1.0)).bfloat16()
    wide = torch.randn(*shape[:-1], shape[-1] + 7, generator=generator).bfloat16() * 3
    x = wide[..., : shape[-1]]  # a slice, as the q/k norm gets it
    norm.prepare(native_kernels=False)
    assert norm.native is None
    reference = norm(x)
    norm.prepare(native_kernels=True)
    assert norm.native is not None
    ours = norm(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    # The sum of squares runs in another order: at most one bf16 ulp apart, and rarely.
    assert ((ours.double() - reference.double()).abs() <= bf16_ulp(reference)).all()
    assert (ours == reference).float().mean() >= 0.99


def test_switched_off_by_the_environment_with_a_log(monkeypatch, caplog):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.native_ops.__wrapped__() is None
    assert native.DISABLE_VARIABLE in caplog.text


def test_a_failed_build_falls_back_to_onednn_with_the_reason_logged(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def fail(**_):
        raise RuntimeError("Error building extension 'longspec_native': c++: not found")

    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.native_ops.__wrapped__() is None
    assert "could not be built" in caplog.text and "c++: not found" in caplog.text
    monkeypatch.setattr(native, "native_ops", native.native_ops.__wrapped__)
    monkeypatch.setattr(matvec, "avx512_bf16_ops", native.avx512_bf16_ops.__wrapped__)
    monkeypatch.setattr("longspec.runtime.linear.bf16_matvec", matvec.bf16_matvec.__wrapped__)
    weight = torch.randn(16, 8).bfloat16()
    packed = prepack(weight)
    assert packed is None or packed.matvec is None
    x = torch.randn(1, 8).bfloat16()
    assert torch.equal(packed_linear(x, weight, packed), F.linear(x, weight))
