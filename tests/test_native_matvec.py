"""The native bf16 few-row kernel (runtime/kernels/bf16_matvec.cpp): correctly rounded
products, rows independent of how many share a call, bf16 decoders as accurate with it
as without, and a logged fallback where it cannot be had."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from longspec.runtime import bf16_matvec as native
from longspec.runtime.linear import packed_linear, prepack
from test_runtime_equivalence import run_chunks
from tiny_models import FAMILIES, random_ids, tiny_pair

KERNEL = native.bf16_matvec()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native bf16 kernel unavailable here (reason logged)")


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
    monkeypatch.setattr(native.Bf16Matvec, "__call__", lambda self, x, w, b: calls.append(x.shape) or F.linear(x, w, b))
    for rows in (1, KERNEL.max_rows, KERNEL.max_rows + 1):
        packed_linear(torch.randn(1, rows, 32).bfloat16(), weight, packed)
    assert calls == [(1, 1, 32), (1, KERNEL.max_rows, 32)]


@needs_kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_decoder_with_the_kernel_is_as_accurate_as_without(family):
    """Token-by-token decode in bf16 (every linear through the kernel) against the same
    weights in float64: no worse than the oneDNN path or `transformers`' own bf16."""
    hf_model, decoder = tiny_pair(family, dtype=torch.bfloat16, seed=FAMILIES.index(family))
    ids = random_ids(40, seed=3)
    with torch.no_grad():
        hf_bf16 = hf_model(ids).logits
        exact = hf_model.to(torch.float64)(ids).logits
    assert all(layer.packed["qkv_weight"].matvec is KERNEL for layer in decoder.layers)
    with_kernel = run_chunks(decoder, ids, [1] * ids.shape[1])
    decoder.prepare(native_kernels=False)
    without = run_chunks(decoder, ids, [1] * ids.shape[1])

    def error(logits):
        return (logits.double() - exact).abs().max().item()

    assert error(with_kernel) <= 1.1 * max(error(without), error(hf_bf16))


def test_switched_off_by_the_environment_with_a_log(monkeypatch, caplog):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.bf16_matvec.__wrapped__() is None
    assert native.DISABLE_VARIABLE in caplog.text


def test_a_failed_build_falls_back_to_onednn_with_the_reason_logged(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def fail(**_):
        raise RuntimeError("Error building extension 'longspec_bf16_matvec': c++: not found")

    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.bf16_matvec.__wrapped__() is None
    assert "could not be built" in caplog.text and "c++: not found" in caplog.text
    unbuilt = native.bf16_matvec.__wrapped__
    monkeypatch.setattr("longspec.runtime.linear.bf16_matvec", unbuilt)
    weight = torch.randn(16, 8).bfloat16()
    packed = prepack(weight)
    assert packed is None or packed.matvec is None
    x = torch.randn(1, 8).bfloat16()
    assert torch.equal(packed_linear(x, weight, packed), F.linear(x, weight))
