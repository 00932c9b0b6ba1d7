// bf16 matrix products through a weight packed for AVX-512 BF16 dot products:
// y[m, n] = x[m, :] . w[n, :] (+ bias[n]), accumulated in float32 and rounded to bf16 once,
// as a bf16 linear layer does. The runtime sends it every bf16 product on the CPU: a decode
// step (one row), a batch of decode steps, a verified tree, prefill.
//
// Why: a decode step streams every weight once, and at 4-16 rows (a batch, a chain) the
// weight still streams once per product but every weight value feeds several rows. The
// packed layout puts 16 output columns in the lanes of one register, so a register tile of
// rows x column blocks is built from broadcast pairs of x and never reduced across lanes.
// Measured (BENCHMARKS.md): one row at the rate of a row-streaming matvec (which it
// replaced), 1.1-1.8x oneDNN's blocked product at 4-16 rows, level with it at hundreds. Only
// the kernels are compiled for AVX-512; the rest of the library is baseline x86-64, so
// `avx512_bf16_supported()` can be asked on any CPU. Every output is one float32 sum over k
// in the same order whatever the tile, so a row gets the same bits alone or in a batch.
//
// Packed layout: [ceil(N / 16), ceil(K / 2), 16, 2]. Block j, pair p holds, in lane i, the
// weight pair (w[16 j + i, 2 p], w[16 j + i, 2 p + 1]), zero past N or K: one 64-byte load
// per block and pair, as `_mm512_dpbf16_ps` consumes it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kColumns = 16;   // output columns per block (float32 lanes of a register)
constexpr int64_t kRowTile = 8;    // rows of x per register tile
constexpr int kRegisters = 32;     // zmm registers of AVX-512

// Column blocks per tile: accumulators (rows x blocks) + one weight register per block +
// one broadcast register must fit in the register file.
constexpr int blocks_for(int rows) {
  const int fit = (kRegisters - 2) / (rows + 1);
  return fit < 8 ? fit : 8;
}

#define LONGSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline int32_t pair_at(const uint16_t* x, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, x + k, sizeof bits);
  return bits;
}

// Rows [0, R) of x (K padded to even) times column blocks [block, block + B).
template <int R, int B>
LONGSPEC_AVX512_BF16 void tile(const uint16_t* x, int64_t x_stride, const uint16_t* packed, int64_t pairs,
                               const uint16_t* bias, uint16_t* y, int64_t N, int64_t block) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* w = packed + block * pairs * 2 * kColumns;
  const int64_t block_stride = pairs * 2 * kColumns;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wb[B];
    for (int b = 0; b < B; ++b) wb[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + p * 2 * kColumns);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair_at(x + r * x_stride, 2 * p));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wb[b], xr);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t n0 = (block + b) * kColumns;
    const int64_t left = N - n0 < kColumns ? N - n0 : kColumns;
    const __mmask16 mask = left == kColumns ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 add = _mm512_setzero_ps();
    if (bias) add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
    for (int r = 0; r < R; ++r) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], add));
      _mm256_mask_storeu_epi16(y + r * N + n0, mask, out);
    }
  }
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);

struct Tiles {
  Tile wide;    // `blocks` column blocks at once
  Tile single;  // one block: the last blocks of a row of groups
  int blocks;
};

// Rows above one tile run as two tiles over the same column groups, so both use the block
// count that fits the taller one.
constexpr int kTwoTileBlocks = blocks_for(kRowTile);

template <int R>
Tiles tiles_of(bool two_tiles) {
  if (two_tiles) return {tile<R, kTwoTileBlocks>, tile<R, 1>, kTwoTileBlocks};
  return {tile<R, blocks_for(R)>, tile<R, 1>, blocks_for(R)};
}

Tiles tiles_for(int64_t rows, bool two_tiles) {
  switch (rows) {
    case 1: return tiles_of<1>(two_tiles);
    case 2: return tiles_of<2>(two_tiles);
    case 3: return tiles_of<3>(two_tiles);
    case 4: return tiles_of<4>(two_tiles);
    case 5: return tiles_of<5>(two_tiles);
    case 6: return tiles_of<6>(two_tiles);
    case 7: return tiles_of<7>(two_tiles);
    default: return tiles_of<8>(two_tiles);
  }
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "a contiguous [N, K] bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t blocks = (N + kColumns - 1) / kColumns, pairs = (K + 1) / 2;
  at::Tensor packed = at::zeros({blocks, pairs, kColumns, 2}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t i = 0; i < kColumns && j * kColumns + i < N; ++i)
        for (int64_t k = 0; k < K; ++k) out[((j * pairs + k / 2) * kColumns + i) * 2 + k % 2] = w[(j * kColumns + i) * K + k];
  });
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 inputs only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous x [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 2 && packed.is_contiguous(),
              "a weight packed by bf16_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == pairs && (N + kColumns - 1) / kColumns == blocks, "x and the packed weight disagree in shape");
  const uint16_t* bias_bits = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bias [N] bf16");
    bias_bits = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  // An odd K reads one pair past each row: give x a zero column.
  at::Tensor xe = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
  const int64_t stride = xe.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xs = reinterpret_cast<const uint16_t*>(xe.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Row tiles of up to 8 rows; each task walks its column groups for every row tile, so a
  // group's weight (a few blocks x K values) is read from memory once and from cache after.
  const bool many = M > kRowTile;
  const int64_t full_tiles = M / kRowTile, rest = M % kRowTile;
  const Tiles full = tiles_for(many ? kRowTile : M, many), tail = tiles_for(rest ? rest : 1, many);
  const int64_t row_tiles = many ? full_tiles + (rest ? 1 : 0) : 1;
  const int64_t group = full.blocks, groups = (blocks + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, count = blocks - first < group ? blocks - first : group;
      for (int64_t t = 0; t < row_tiles; ++t) {
        const Tiles& tiles = many && t == full_tiles ? tail : full;
        const uint16_t* xt = xs + t * kRowTile * stride;
        uint16_t* yt = ys + t * kRowTile * N;
        if (count == group) {
          tiles.wide(xt, stride, ws, pairs, bias_bits, yt, N, first);
        } else {
          for (int64_t b = 0; b < count; ++b) tiles.single(xt, stride, ws, pairs, bias_bits, yt, N, first + b);
        }
      }
    }
  });
  return y;
}

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("avx512_bf16_supported() -> bool", &supported);
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.impl("bf16_pack_weight", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.def("bf16_packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("bf16_packed_linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
