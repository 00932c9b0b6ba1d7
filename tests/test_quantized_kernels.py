"""The native product with GGUF's quantized weights (`kernels/gguf_linear.cpp`): each format
against the exact float64 product within the bound of its float32 sums, the same bits for
a row alone or among others and on every instruction-set path, and malformed weights refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longspec.runtime import native
from longspec.runtime.quantized import QuantizedWeight, segment, stacked
from quantized_blocks import KINDS, Q4_K, Q5_0, Q6_K, Q8_0, exact_values, magnitudes, random_rows, terms_per_output

OPS = native.native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="native kernels unavailable here (reason logged)")
PATHS = list(OPS.gguf_linear_paths()) if OPS is not None else []
UNIT = 2.0**-24


def weight_of(kind: int, rows: int, cols: int, seed: int = 0):
    raw = random_rows(kind, rows, cols, seed)
    return raw, QuantizedWeight((segment("blk.0.test.weight", kind, raw, rows, cols),), cols)


def product(weight: QuantizedWeight, x: torch.Tensor, path: str = "native", bias=None) -> torch.Tensor:
    segments = weight.segments
    return OPS.gguf_linear_on(x.contiguous(), [s.packed for s in segments], [s.kind for s in segments],
                              [s.rows for s in segments], bias, path)


def quantized_rows_reference(x: torch.Tensor):
    """The row quantization as its definition: d = amax / 127 per 32 values, codes =
    round-half-even(x * (1 / d)), in float32 operations."""
    blocks = x.float().view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127)
    return codes.to(torch.int8).view(x.shape), d


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_quantized_exactly_as_defined(dtype, path):
    """On every path (the vector quantizers are the scalar one's operations)."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 640, generator=generator) * torch.rand(9, 1, generator=generator) * 30).to(dtype)
    x[3, :32] = 0  # an all-zero block: scale 0, codes 0
    x[4, 40] = 1e-30  # a tiny value among ordinary ones
    x[5, 64:96] = torch.arange(32) - 15.5  # halves: round-half-even decides codes
    x[5, 64] = 127  # scale 1: the halves above stay exact halves
    x[6, 96:128] = -x[6, 96:128].abs()  # an all-negative block (its amax from the most negative)
    codes, scales = OPS.gguf_quantize_rows(x, path)
    expected_codes, expected_scales = quantized_rows_reference(x)
    assert torch.equal(scales, expected_scales) and torch.equal(codes, expected_codes)


@pytest.mark.parametrize("name", list(KINDS))
def test_the_exact_values_are_the_formats_own(name):
    """The float64 decoding the tests use agrees with the `gguf` package's dequantization
    (which rounds to float32) for every format."""
    import gguf

    kind, cols = KINDS[name], 512
    raw = random_rows(kind, 5, cols, seed=3)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind)).astype(np.float64)
    ours = exact_values(kind, raw, cols)
    assert np.all(np.abs(theirs - ours) <= np.abs(ours) * 2**-23 + 1e-30)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("rows,cols,batch", [(37, 256, 1), (16, 512, 5), (50, 768, 3), (3, 1024, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_format_is_within_the_float32_sum_bound_of_the_exact_product(path, name, rows, cols, batch, dtype):
    """Against the float64 product of the exact weights and the quantized activations:
    the integer block sums are exact, so the error is the float32 terms' rounding, at most
    gamma_(T+1) sum |terms| (T terms a sum, each after one rounded product), plus the
    final rounding to bf16."""
    kind = KINDS[name]
    raw, weight = weight_of(kind, rows, cols, seed=rows + cols)
    generator = torch.Generator().manual_seed(batch)
    x = (torch.randn(batch, cols, generator=generator) * 3).to(dtype)
    codes, scales = OPS.gguf_quantize_rows(x)
    activations = (codes.double().view(batch, -1, 32) * scales.double().unsqueeze(-1)).view(batch, cols).numpy()
    exact = activations @ exact_values(kind, raw, cols).T
    size = np.abs(activations) @ magnitudes(kind, raw, cols).T
    terms = terms_per_output(kind, cols) + 1
    bound = terms * UNIT / (1 - terms * UNIT) * size
    ours = product(weight, x, path)
    assert ours.dtype == dtype and ours.shape == (batch, rows)
    error = np.abs(ours.double().numpy() - exact)
    if dtype == torch.bfloat16:
        bound = bound + (np.abs(exact) + bound) * 2.0**-8
    assert np.all(error <= bound), float((error - bound).max())


@pytest.mark.parametrize("name", list(KINDS))
def test_a_row_gets_the_same_bits_alone_or_among_1_to_64_rows_and_on_every_path(name):
    """45 rows: a pair of groups and a lone group (the passes over two groups and one);
    100 rows of x: past the 64 rows a pass holds, 1-4 rows (accumulators in registers), 5-16
    (one group a pass, its rows 4 at a time) and 17-64 (two groups a pass, a block's codes
    unpacked once for all of them)."""
    kind = KINDS[name]
    _, weight = weight_of(kind, 45, 512, seed=7)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(100, 512, generator=generator).bfloat16()
    whole = product(weight, x)
    for path in PATHS:
        assert torch.equal(product(weight, x, path), whole), path
        for begin, end in ((0, 1), (5, 6), (63, 64), (2, 5), (7, 20), (1, 64), (30, 33), (0, 4), (60, 65), (36, 100),
                           (2, 10), (10, 26), (3, 18), (40, 57), (80, 96), (50, 61)):
            assert torch.equal(product(weight, x[begin:end], path), whole[begin:end]), (path, begin, end)


def test_a_streamed_weight_on_huge_pages_gives_the_bits_of_a_copy_in_ordinary_memory():
    """A repacked weight of 2 MiB or more gets a mapping of its own (advised for huge pages);
    from 16 MiB (an output layer) up to 16 rows run one group a pass, 4 rows at a time: its
    products are a copy's in ordinary memory, a row's alone or among 1-17 rows (17: two groups
    a pass), on one thread or two, and the portable loop's."""
    rows, cols = 64000, 256
    _, weight = weight_of(Q8_0, rows, cols, seed=5)
    packed = weight.segments[0].packed
    assert packed.numel() >= 16 << 20
    copy = QuantizedWeight((weight.segments[0].__class__("copy", Q8_0, rows, packed.clone()),), cols)
    x = torch.randn(17, cols, generator=torch.Generator().manual_seed(3)).bfloat16()
    whole = product(weight, x)
    assert torch.equal(product(copy, x), whole)
    assert torch.equal(product(weight, x[:3], "portable"), whole[:3])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for begin, end in ((0, 1), (4, 6), (1, 5), (0, 16), (9, 17), (3, 10), (0, 17)):
                assert torch.equal(product(weight, x[begin:end]), whole[begin:end]), (count, begin, end)
    finally:
        torch.set_num_threads(threads)


def test_the_thread_count_does_not_change_the_bits():
    _, weight = weight_of(Q4_K, 130, 512, seed=2)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product(weight, x)
        torch.set_num_threads(2)
        assert torch.equal(product(weight, x), one)
        for begin, end in ((0, 1), (0, 6), (2, 14), (3, 20)):  # one group a unit, and two
            assert torch.equal(product(weight, x[begin:end]), one[begin:end]), (begin, end)
    finally:
        torch.set_num_threads(threads)


def test_mixed_segments_and_the_bias_equal_the_parts_side_by_side():
    """A fused q/k/v of three formats: each segment's outputs are its own product's."""
    cols = 512
    parts = [(Q5_0, 40, 1), (Q8_0, 16, 2), (Q6_K, 16, 3), (Q4_K, 7, 4)]
    segments = [segment(f"blk.0.part{i}", k, random_rows(k, r, cols, s), r, cols) for i, (k, r, s) in enumerate(parts)]
    fused = stacked(segments, cols)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, cols, generator=generator)
    bias = torch.randn(fused.out_features, generator=generator)
    together = fused.linear(x, bias)
    alone = torch.cat([QuantizedWeight((s,), cols).linear(x) for s in segments], dim=1)
    assert torch.equal(together, alone + bias)  # float32 out: the bias is one float32 add either way


def test_the_model_layout_runs_on_three_dimensional_activations():
    _, weight = weight_of(Q8_0, 20, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    assert torch.equal(weight.linear(x), weight.linear(x.reshape(6, 64)).view(2, 3, 20))


def test_malformed_weights_are_refused_naming_the_tensor():
    raw = random_rows(Q4_K, 4, 256)
    with pytest.raises(ValueError, match="'blk.3.ffn_down.weight'.*truncated"):
        segment("blk.3.ffn_down.weight", Q4_K, raw[:, :-1], 4, 256)
    with pytest.raises(ValueError, match="'blk.3.ffn_down.weight'.*metadata"):
        segment("blk.3.ffn_down.weight", Q4_K, raw, 5, 256)
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' is Q3_K.*dtype='bfloat16'"):
        segment("blk.0.attn_q.weight", 11, raw, 4, 256)
    with pytest.raises(ValueError, match="multiples of 256 values"):
        segment("blk.0.attn_q.weight", Q6_K, random_rows(Q8_0, 4, 96), 4, 96)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        weight_of(Q8_0, 4, 64)[1].linear(torch.randn(1, 48))
