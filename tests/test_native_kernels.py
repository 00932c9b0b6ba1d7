"""The native CPU kernels (runtime/kernels/): the tiled bf16 product over a packed weight
is correctly rounded and gives a row the same bits however many rows share the call; few-query
attention is within one bf16 ulp of the exact result on ragged shapes and masks; the
one-pass RMSNorm computes what the PyTorch path computes; bf16 decoders are as
accurate with them as without; a logged fallback where they cannot be had."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from longspec.runtime import native
from longspec.runtime.attention import (
    NATIVE_ATTENTION_MAX_QUERIES,
    flash_attention,
    fused_attention,
    native_attention,
    native_attention_fits,
    native_part,
    reference_attention,
)
from longspec.runtime.argmax import row_argmax
from longspec.runtime.linear import packed_linear, prepack
from longspec.runtime.model import RMSNorm

OPS = native.attention_ops()
needs_kernel = pytest.mark.skipif(OPS is None, reason="native bf16 kernels unavailable here (reason logged)")
AVX512_BF16 = native.native_ops() is not None and native.native_ops().avx512_bf16_supported()
needs_library = pytest.mark.skipif(native.native_ops() is None, reason="native kernels unavailable here (reason logged)")
LINEAR_OPS = native.bf16_linear_ops()
needs_linear = pytest.mark.skipif(LINEAR_OPS is None, reason="no native bf16 product on this CPU (reason logged)")
AVX2 = native.native_ops() is not None and native.native_ops().bf16_linear_avx2_supported()
AMX_BF16 = native.native_ops() is not None and native.native_ops().bf16_linear_path() == "amx"


def products():
    """The product this CPU runs, and the vector paths where they are not that one (a CPU
    with AMX takes AVX-512 BF16 only here, one with AVX-512 BF16 takes AVX2 only here): each
    must pass every product test."""
    ops = [pytest.param("bf16_packed_linear", marks=needs_linear, id="native")]
    if AMX_BF16:
        ops.append(pytest.param("bf16_packed_linear_avx512", id="avx512"))
    if AVX2 and AVX512_BF16:
        ops.append(pytest.param("bf16_packed_linear_avx2", id="avx2"))
    return ops


class VectorAttention:
    """The native ops with the attention kernels on a named vector path (`avx512`, `avx2`)."""

    def __init__(self, ops, path: str):
        self.ops, self.path = ops, path

    def few_query_attention(self, *args):
        return getattr(self.ops, f"few_query_attention_{self.path}")(*args)

    def ordered_attention(self, *args):
        return getattr(self.ops, f"ordered_attention_{self.path}")(*args)


ATTENTION_PATH = OPS.attention_path() if OPS is not None else None


@pytest.fixture(params=["native", "avx512", "avx2"])
def attention_kernel(request, monkeypatch):
    """The attention kernels this CPU runs, and the vector paths where they are not that one
    (a CPU with AMX takes AVX-512 BF16 only here, one with AVX-512 BF16 takes AVX2 only
    here): each must pass every attention test."""
    if OPS is None:
        pytest.skip("native bf16 kernels unavailable here (reason logged)")
    if request.param == "native":
        return OPS
    if request.param == "avx512" and ATTENTION_PATH != "amx":
        pytest.skip("the AVX-512 BF16 path is the native one on this CPU, or it has none")
    if request.param == "avx2" and not (AVX2 and AVX512_BF16):
        pytest.skip("the AVX2 path is the native one on this CPU, or it has no AVX2")
    ops = VectorAttention(OPS, request.param)
    monkeypatch.setattr("longspec.runtime.attention.attention_ops", lambda: ops)
    return ops


def test_the_kernels_build_wherever_they_can():
    """A build error must fail the suite, not skip every kernel test: on x86-64 with a
    compiler and ninja (what this suite installs), the library must load unless it was
    turned off."""
    import os
    import platform
    import shutil

    if os.environ.get(native.DISABLE_VARIABLE, "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("native kernels off, or not x86-64")
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler or ninja here")
    assert native.native_ops() is not None, "the native kernels did not build: see the logged reason"


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 numbers (8 significant bits)."""
    exponent = torch.floor(torch.log2(values.double().abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def float32_sum_error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The rigorous bound on a float32 accumulation of x @ weight.T (+ bias), in any
    order: gamma_n * sum |terms| with gamma_n = n u / (1 - n u), u = 2^-24 (Higham,
    Theorem 3.1; bf16 products are exact in float32). It matters where the terms
    cancel: a result near zero has a tiny bf16 ulp but inherits the sum's error."""
    terms = x.shape[-1] + (bias is not None)
    unit = 2.0**-24
    gamma = terms * unit / (1 - terms * unit)
    magnitude = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    return gamma * magnitude


@pytest.mark.parametrize("product", products())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 40])
@pytest.mark.parametrize("inner", [40, 63, 640, 2048])  # 63: an odd inner size, padded by the packing
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_products_are_within_one_ulp_and_the_float32_sum_bound_of_the_exact_result(product, rows, inner, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + inner + with_bias)
    x = torch.randn(rows, inner, generator=generator).bfloat16()
    weight = torch.randn(301, inner, generator=generator).bfloat16()  # 301: not a whole number of 16-column blocks
    bias = torch.randn(301, generator=generator).bfloat16() if with_bias else None
    packed = prepack(weight)
    assert packed.tiles is not None and packed.onednn is None  # the tiled copy replaces oneDNN's
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    ours = getattr(native.native_ops(), product)(x, packed.tiles, weight.shape[0], bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, 301)
    assert ((ours.double() - exact).abs() <= bf16_ulp(exact) + float32_sum_error(x, weight, bias)).all()


@pytest.mark.parametrize("product", products())
def test_a_row_gets_the_same_bits_from_the_tiled_kernel_alone_or_with_others(product):
    """Each output is one float32 sum in the same order whatever the tile: a batch row's
    products are bit-identical to that row's alone."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(19, 640, generator=generator).bfloat16()
    weight = torch.randn(1000, 640, generator=generator).bfloat16()
    tiles = prepack(weight).tiles
    run = getattr(native.native_ops(), product)
    together = run(x, tiles, 1000, None)
    for rows in (slice(0, 1), slice(4, 6), slice(3, 7), slice(5, 13), slice(2, 19), slice(0, 12), slice(6, 18)):
        assert torch.equal(run(x[rows].contiguous(), tiles, 1000, None), together[rows])


@needs_linear
@pytest.mark.parametrize("inner", [63, 640])  # 63: each row's last pair holds one weight and a zero
@pytest.mark.parametrize("count", [0, 1, 16, 17, 300])
def test_a_pack_of_gathered_rows_is_the_pack_of_their_copy(inner, count):
    """The certified head packs its candidates' rows in place (`bf16_pack_rows`): the same
    words as packing a copy of those rows, repeated and unsorted rows included."""
    generator = torch.Generator().manual_seed(inner + count)
    weight = torch.randn(1000, inner, generator=generator).bfloat16()
    rows = torch.randint(0, 1000, (count,), generator=generator)
    blocks, pairs = -(-count // 16), -(-inner // 2)
    # The layout written out here: block j, pair p, lane i holds rows[16 j + i]'s weights 2p and 2p + 1, zero past
    # the rows and the columns.
    expected = torch.zeros(blocks * 16, pairs * 2, dtype=torch.bfloat16)
    expected[:count, :inner] = weight[rows]
    expected = expected.view(blocks, 16, pairs, 2).transpose(1, 2)
    torch.full((blocks * pairs * 32 + 64,), -1, dtype=torch.int16)  # freed memory the pack may be given: not zeros
    ours = LINEAR_OPS.bf16_pack_rows(weight, rows)
    assert torch.equal(ours.view(torch.int16), expected.contiguous().view(torch.int16))
    assert torch.equal(ours.view(torch.int16), LINEAR_OPS.bf16_pack_weight(weight[rows].contiguous()).view(torch.int16))
    with pytest.raises(RuntimeError, match="row 1000 outside"):
        LINEAR_OPS.bf16_pack_rows(weight, torch.tensor([3, 1000]))


@pytest.mark.skipif(not AVX2, reason="no AVX2 with FMA on this CPU")
def test_the_avx2_product_rounds_nan_and_infinity_like_a_bf16_linear_layer():
    weight = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, -1.0]]).bfloat16()
    x = torch.tensor([[float("inf"), 1.0], [float("nan"), 2.0], [3.0, 2.0**-9 * 3]]).bfloat16()
    ours = native.native_ops().bf16_packed_linear_avx2(x, prepack(weight, native_kernels=True).tiles, 4, None)
    reference = F.linear(x.float(), weight.float()).bfloat16()
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours[~ours.isnan()], reference[~reference.isnan()])


@needs_linear
def test_packed_linear_sends_every_row_count_to_the_tiled_kernel(monkeypatch):
    weight = torch.randn(64, 32).bfloat16()
    packed = prepack(weight)
    fallback = prepack(weight, native_kernels=False)  # oneDNN's copy, or None where oneDNN declines
    assert packed.tiles is not None and (fallback is None or fallback.tiles is None)
    for rows in (0, 1, 3, 4, 300):
        x = torch.randn(1, rows, 32).bfloat16()
        out = packed_linear(x, weight, packed)
        assert out.shape == (1, rows, 64)
        exact = F.linear(x.double(), weight.double())
        assert ((out.double() - exact).abs() <= bf16_ulp(exact) + float32_sum_error(x, weight, None)).all()
        assert torch.equal(out[0], LINEAR_OPS.bf16_packed_linear(x[0], packed.tiles, 64, None))


@needs_linear
def test_prefill_products_take_the_bulk_copy_only_where_asked():
    """A weight keeps oneDNN's copy for prefill only when asked (the decoder's layers ask
    where `bulk_products_pay`); a bulk product is the exact product to bf16 rounding, and
    a product that is not bulk stays on the tiled kernel."""
    import torch.nn.functional as F

    from longspec.runtime.linear import _onednn_prepack

    weight = torch.randn(64, 32).bfloat16()
    assert prepack(weight).bulk is None  # the default: heads and drafts keep none
    packed = prepack(weight, bulk=True)
    if _onednn_prepack(weight) is None:
        pytest.skip("oneDNN declines bf16 here")
    x = torch.randn(1, 300, 32).bfloat16()
    bulk = packed_linear(x, weight, packed, bulk=True)
    exact = F.linear(x.double(), weight.double())
    assert ((bulk.double() - exact).abs() <= bf16_ulp(exact) + float32_sum_error(x, weight, None)).all()
    assert torch.equal(packed_linear(x, weight, packed), LINEAR_OPS.bf16_packed_linear(x[0], packed.tiles, 64, None)[None])


def test_bulk_products_need_amx_and_rows_that_do_not_depend_on_their_neighbours(monkeypatch):
    from longspec.runtime import linear

    monkeypatch.setattr(linear, "_cpu_flags", lambda: {"avx2", "fma"})
    linear.bulk_products_pay.cache_clear()
    try:
        assert not linear.bulk_products_pay()
        if LINEAR_OPS is not None and linear._onednn_prepack(torch.randn(8, 8).bfloat16()) is not None:
            monkeypatch.setattr(linear, "_cpu_flags", lambda: {"amx_bf16", "amx_tile"})
            monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                                lambda x, *rest: torch.full((x.shape[0], 96), float(x.shape[0])).bfloat16())
            linear.bulk_products_pay.cache_clear()
            assert not linear.bulk_products_pay()  # a row's bits changed with the rows beside it
    finally:
        linear.bulk_products_pay.cache_clear()


def test_without_a_native_product_products_go_to_onednn(monkeypatch):
    monkeypatch.setattr("longspec.runtime.linear.bf16_linear_ops", lambda: None)
    weight = torch.randn(64, 32).bfloat16()
    packed = prepack(weight)
    assert packed is None or packed.tiles is None
    x = torch.randn(5, 32).bfloat16()
    exact = F.linear(x.double(), weight.double())
    assert ((packed_linear(x, weight, packed).double() - exact).abs()
            <= bf16_ulp(exact) + float32_sum_error(x, weight, None)).all()


@needs_kernel
@pytest.mark.parametrize("rows, kv_heads, group, keys", [(1, 1, 4, 1), (1, 1, 4, 700), (2, 2, 2, 129), (3, 1, 16, 128), (2, 4, 1, 300)])
@pytest.mark.parametrize("head_dim", [32, 256])
@pytest.mark.parametrize("mask", ["none", "shared", "per_row"])
@pytest.mark.parametrize("queries", [1, 3, 9, 17])
def test_few_query_attention_is_within_one_ulp_of_the_exact_result(
    attention_kernel, rows, kv_heads, group, keys, head_dim, mask, queries
):
    generator = torch.Generator().manual_seed(rows * 7 + keys + head_dim + queries)
    q = torch.randn(rows, kv_heads * group, queries, head_dim, generator=generator).bfloat16()
    # K/V as the cache hands them over: a view of the first `keys` slots of a larger buffer.
    k = torch.randn(rows, kv_heads, keys + 9, head_dim, generator=generator).bfloat16()[:, :, :keys]
    v = torch.randn(rows, kv_heads, keys + 9, head_dim, generator=generator).bfloat16()[:, :, :keys]
    visible = None
    if mask != "none":
        visible = torch.rand(rows if mask == "per_row" else 1, queries, keys, generator=generator) < 0.7
        visible[..., 0] = True  # every query sees a key here; the empty case has its own test
        visible = visible if mask == "per_row" else visible[0]
    scale = head_dim**-0.5
    if queries <= NATIVE_ATTENTION_MAX_QUERIES:
        assert native_attention_fits(q, k)  # the backend itself takes the native path
        ours = fused_attention(q, k, v, visible, None, None, None, scale)
    else:
        ours = native_part(q, k, v, visible, scale)[0]
    exact, exact_lse = attention_with_lse(q.double(), k.double(), v.double(), visible, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    assert ((ours.double() - exact).abs() <= bf16_ulp(exact) + 1e-5).all()
    lse = native_part(q, k, v, visible, scale)[1]
    assert torch.allclose(lse.double(), exact_lse, rtol=0, atol=1e-4)
    # And no less accurate than PyTorch's flash kernel on the same inputs.
    flash = flash_attention(q, k, v, visible, None, None, None, scale)
    assert (ours.double() - exact).abs().max() <= (flash.double() - exact).abs().max() + 1e-6


@needs_kernel
def test_few_query_attention_merges_a_prefix_and_a_tree_part(attention_kernel):
    """The two parts of Hybrid Tree Attention, each through the kernel, merged by their
    log-sum-exps, equal one attention over both under the combined mask."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 5, 64, generator=generator).bfloat16()
    k_prefix, v_prefix = (torch.randn(1, 1, 200, 64, generator=generator).bfloat16() for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, 5, 64, generator=generator).bfloat16() for _ in range(2))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    ours = native_attention(q, k_prefix, v_prefix, None, k_new, v_new, tree, 0.125)
    exact = reference_attention(q.double(), k_prefix.double(), v_prefix.double(), None, k_new.double(), v_new.double(), tree, 0.125)
    # Each part is rounded to bf16 at its own magnitude before the merge, then the merge once more.
    prefix_part = attention_with_lse(q.double(), k_prefix.double(), v_prefix.double(), None, 0.125)[0]
    tree_part = attention_with_lse(q.double(), k_new.double(), v_new.double(), tree, 0.125)[0]
    bound = bf16_ulp(torch.maximum(prefix_part.abs(), tree_part.abs())) + bf16_ulp(exact) / 2 + 1e-5
    assert ((ours.double() - exact).abs() <= bound).all()


@needs_kernel
def test_few_query_attention_of_a_row_that_sees_no_key_is_zero(attention_kernel):
    q = torch.randn(2, 4, 1, 64).bfloat16()
    k, v = torch.randn(2, 2, 300, 64).bfloat16(), torch.randn(2, 2, 300, 64).bfloat16()
    visible = torch.ones(2, 1, 300, dtype=torch.bool)
    visible[1] = False
    out, lse = native_part(q, k, v, visible, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
    exact = reference_attention(q[:1].double(), k[:1].double(), v[:1].double(), visible[:1], None, None, None, 0.125)
    assert ((out[:1].double() - exact).abs() <= bf16_ulp(exact) + 1e-5).all()


def attention_with_lse(q, k, v, visible, scale):
    """float64 attention and log-sum-exp, grouped-query heads by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if visible is not None:
        scores = scores.masked_fill(~(visible.unsqueeze(1) if visible.dim() == 3 else visible), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


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
        assert native._built_or_loaded.__wrapped__() is None
    assert native.DISABLE_VARIABLE in caplog.text


def test_a_failed_build_falls_back_to_onednn_with_the_reason_logged(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def fail(**_):
        raise RuntimeError("Error building extension 'longspec_native': c++: not found")

    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native._built_or_loaded.__wrapped__() is None
    assert "could not be built" in caplog.text and "c++: not found" in caplog.text
    monkeypatch.setattr(native, "native_ops", native._built_or_loaded.__wrapped__)
    monkeypatch.setattr("longspec.runtime.linear.bf16_linear_ops", native.bf16_linear_ops.__wrapped__)
    weight = torch.randn(16, 8).bfloat16()
    packed = prepack(weight)
    assert packed is None or packed.tiles is None
    x = torch.randn(1, 8).bfloat16()
    assert torch.equal(packed_linear(x, weight, packed), F.linear(x, weight))


def argmax_rows(seed: int):
    """bf16 rows with ties, -inf stretches, NaNs, and lengths around the 16- and 32-element steps."""
    generator = torch.Generator().manual_seed(seed)
    for trial in range(120):
        rows, width = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 70, (1,), generator=generator))
        x = torch.randint(-3, 3, (rows, width), generator=generator).float()  # few values: many ties
        if trial % 4 == 0:
            x[x < 0] = float("-inf")
        if trial % 9 == 0:
            x[-1, int(torch.randint(0, width, (1,), generator=generator))] = float("nan")
        yield x.to(torch.bfloat16)
    yield torch.full((2, 40), float("-inf"), dtype=torch.bfloat16)
    yield torch.randn(3, 262144, generator=generator).to(torch.bfloat16)


@needs_library
@pytest.mark.parametrize("op", ["row_argmax", "row_argmax_avx2"])
def test_row_argmax_is_torch_argmax(op):
    """The scan this CPU runs, and the AVX2 scan (its four chains of eight lanes) on every
    CPU that has AVX2."""
    if op == "row_argmax_avx2" and not AVX2:
        pytest.skip("no AVX2 on this CPU")
    scan = getattr(native.native_ops(), op)
    for x in argmax_rows(0):
        assert torch.equal(scan(x), x.float().argmax(dim=-1)), x


def test_greedy_argmax_fallback_without_the_library(monkeypatch):
    from longspec.runtime import argmax

    monkeypatch.setattr(argmax, "native_ops", lambda: None)
    for x in argmax_rows(1):
        assert torch.equal(row_argmax(x), x.float().argmax(dim=-1))


def ordered_call(ops, q, k, v, slots, positions, visible, chunk, shared=0):
    """The native `ordered_attention` of one row (slots/positions [N], visible [T, N - shared] or None)."""
    count = torch.tensor([slots.numel()])
    return ops.ordered_attention(q, k, v, slots.unsqueeze(0), positions.unsqueeze(0), count, torch.tensor([shared]),
                                 None if visible is None else visible.unsqueeze(0).contiguous(), chunk, 0.125)


@needs_kernel
@pytest.mark.parametrize("chunk", [64, 128, 512])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ordered_attention_gives_a_query_the_same_bits_whatever_else_the_call_holds(attention_kernel, chunk, threads):
    """A query at position p over keys 0..p: alone with the keys in slot order, against
    the same query inside a tree call (shuffled slots, siblings it does not see at the
    same positions, other queries, more threads)."""
    generator = torch.Generator().manual_seed(chunk + threads)
    P = 700  # committed positions 0..P-1, then a tree of 9 nodes at positions P..P+3
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 1])
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 0]
    tree = torch.zeros(9, 9, dtype=torch.bool)
    for node, parent in enumerate(parents):
        tree[node] = tree[parent] if parent >= 0 else tree[node]
        tree[node, node] = True
    keys = torch.randn(1, 1, P + 9, 64, generator=generator).bfloat16()
    values = torch.randn(1, 1, P + 9, 64, generator=generator).bfloat16()
    queries = torch.randn(1, 4, 9, 64, generator=generator).bfloat16()
    layout = torch.randperm(P + 9, generator=generator)  # entry i lives in slot layout[i]
    k, v = torch.empty_like(keys), torch.empty_like(values)
    k[:, :, layout], v[:, :, layout] = keys, values
    positions = torch.cat([torch.arange(P), P + depths])
    order = torch.argsort(positions, stable=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, together_lse = ordered_call(
            attention_kernel, queries, k, v, layout[order], positions[order], tree[:, order[P:] - P], chunk, shared=P
        )
    finally:
        torch.set_num_threads(previous)
    for node in range(9):
        path = [P + i for i in range(9) if tree[node, i]]  # the node's ancestors, one per depth
        seen = torch.tensor(list(range(P)) + sorted(path, key=lambda i: int(positions[i])))
        alone, alone_lse = ordered_call(attention_kernel, queries[:, :, node : node + 1].contiguous(),
                                        keys[:, :, seen].contiguous(),
                                        values[:, :, seen].contiguous(), torch.arange(seen.numel()),
                                        positions[seen], None, chunk, shared=seen.numel())
        assert torch.equal(together[:, :, node], alone[:, :, 0]), node
        assert torch.equal(together_lse[:, :, node], alone_lse[:, :, 0]), node
        exact = reference_attention(queries[:, :, node : node + 1].double(), keys[:, :, seen].double(),
                                    values[:, :, seen].double(), None, None, None, None, 0.125)
        assert ((alone.double() - exact).abs() <= bf16_ulp(exact) + 1e-5).all()


@needs_kernel
def test_ordered_attention_refuses_unsorted_positions_and_slots_out_of_range(attention_kernel):
    q, k = torch.randn(1, 2, 1, 32).bfloat16(), torch.randn(1, 1, 8, 32).bfloat16()
    with pytest.raises(RuntimeError, match="sorted"):
        ordered_call(attention_kernel, q, k, k, torch.arange(3), torch.tensor([0, 2, 1]), None, 64, shared=3)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ordered_call(attention_kernel, q, k, k, torch.tensor([0, 8]), torch.tensor([0, 1]), None, 64, shared=2)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ordered_call(attention_kernel, q, k, k, torch.arange(3), torch.arange(3), None, 100, shared=3)


@needs_library
def test_draft_norms_on_the_native_kernel_round_as_the_pytorch_path():
    """The LongSpec draft's RMSNorm (float32 inside, one rounding to bf16) through the
    native one-pass kernel: within one bf16 rounding of the PyTorch path, and only at
    inference (a product that needs gradients stays in PyTorch)."""
    from longspec.speculation.drafters.longspec.model import DraftRMSNorm

    generator = torch.Generator().manual_seed(3)
    norm = DraftRMSNorm(640, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(640, generator=generator) * 2)
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(7, 640, generator=generator) * 3).to(torch.bfloat16)
    plain = norm(x)
    norm.native = native.native_ops()
    with torch.no_grad():
        fast = norm(x)
    assert (fast.float() - plain.float()).abs().max() <= plain.float().abs().max() * 2 ** -7
    assert (fast != plain).float().mean() < 0.01  # the same bits but for rare ties in the last place
    x.requires_grad_(True)
    assert norm(x).grad_fn is not None  # the training path


@needs_linear
@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen2", "qwen3"])  # Gemma's norms, plain, q/k/v bias, q/k norm
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_native_layer_steps_are_the_python_paths_bits(family, rows):
    """`DecoderLayer.project` and `finish` as one native call each run the very operations
    of the Python path: the same bits, and a whole forward too."""
    from tiny_models import random_ids, tiny_decoder

    decoder = tiny_decoder(family, dtype=torch.bfloat16).prepare(native_kernels=True)
    c = decoder.config
    generator = torch.Generator().manual_seed(rows)
    positions = torch.arange(7, 7 + rows)

    def both(run):
        with torch.inference_mode():
            native = run()
            steps = [layer.native_steps for layer in decoder.layers]
            for layer in decoder.layers:
                layer.native_steps = None
            try:
                python = run()
            finally:
                for layer, ops in zip(decoder.layers, steps):
                    layer.native_steps = ops
        return native, python

    for layer in decoder.layers:
        assert layer.native_steps is not None
        x = torch.randn(2, rows, c.hidden_size, generator=generator).bfloat16()
        attn = torch.randn(2, c.num_heads, rows, c.head_dim, generator=generator).bfloat16()
        rope = decoder._rope(positions, layer.sliding)
        native, python = both(lambda: layer.project(x, rope))
        for ours, theirs in zip(native, python):
            assert ours.shape == theirs.shape and ours.stride() == theirs.stride() and torch.equal(ours, theirs)
        native, python = both(lambda: layer.finish(x, attn))
        assert native.shape == python.shape == (2, rows, c.hidden_size) and torch.equal(native, python)

    def forward():
        cache = decoder.new_cache(64)
        return decoder(random_ids(rows, seed=rows).view(1, -1), cache).logits

    native, python = both(forward)
    assert torch.equal(native, python)
