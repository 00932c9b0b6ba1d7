// bf16 matrix products through a weight packed for AVX-512 BF16 dot products:
// y[m, n] = x[m, :] . w[n, :] (+ bias[n]), accumulated in float32 and rounded to bf16 once,
// as a bf16 linear layer does. The runtime sends it every bf16 product on the CPU: a decode
// step (one row), a batch of decode steps, a verified tree, prefill.
//
// Why: a decode step streams every weight once, and at 4-16 rows (a batch, a chain) the
// weight still streams once per product but every weight value feeds several rows. The
// packed layout puts 16 output columns in the lanes of one register, so a register tile of
// rows x column blocks is built from broadcast pairs of x and never reduced across lanes.
// One row runs at the rate of the row-streaming matvec it replaced, a few rows faster than
// oneDNN's blocked product, hundreds level with it (docs/lab-notes/native-kernels.md#a-tiled-bf16-product-over-packed-weights-replaces-onednn-issue-batching-runtime-speed).
//
// CPUs with AVX2 and FMA but no AVX-512 BF16 run the same packed weight through float32
// FMAs: a bf16 weight pair becomes two float32 vectors by a shift and a mask, x is widened
// to float32 once per call. There PyTorch's bf16 product has no native instructions (and
// oneDNN declines to prepack the weights): each row costs about a one-row product, which
// makes every verified tree expensive (docs/lab-notes/native-kernels.md#avx2-cpus-the-native-bf16-product-through-float32-fmas-issues-adaptive-speculation-every-drafter).
// CPUs with AMX run the same packed weight through bf16 tile products: as fast as the vector
// path at one row (both stream the weight) and several times faster from 4-8 rows on, where
// the vector path's multiply-adds bind (docs/lab-notes/native-kernels.md#amx-bf16-tiles-for-every-product).
// Only the kernels are compiled for their instruction sets; the rest of the library is
// baseline x86-64, so the `*_supported()` queries can be asked on any CPU.
// On every path each output is one float32 sum over k in the same order whatever the
// tile, so a row gets the same bits alone or in a batch. The paths round differently from
// each other, so a process takes one path for every product.
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
#include <string>

#include "cpu_features.h"

namespace {

constexpr int64_t kColumns = 16;   // output columns per block (float32 lanes of a register)
constexpr int64_t kRowTile = 8;    // rows of x per register tile
constexpr int kRegisters = 32;     // zmm registers of AVX-512
constexpr int64_t kGroupsPerThread = 4;  // column groups per thread, at least, for load balance

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

// Where a column block's outputs go: its first column, the lanes inside N, and its bias
// (zero without one), as float32.
struct BlockEnd {
  int64_t n0;
  __mmask16 mask;
  __m512 bias;
};

LONGSPEC_AVX512_BF16 inline BlockEnd block_end(const uint16_t* bias, int64_t N, int64_t block) {
  const int64_t n0 = block * kColumns;
  const int64_t left = N - n0 < kColumns ? N - n0 : kColumns;
  const __mmask16 mask = left == kColumns ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  __m512 add = _mm512_setzero_ps();
  if (bias) add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
  return {n0, mask, add};
}

// One row's float32 sums of the block, with the bias, rounded once to bf16 and stored.
LONGSPEC_AVX512_BF16 inline void store_row(const BlockEnd& end, __m512 sums, uint16_t* y_row) {
  _mm256_mask_storeu_epi16(y_row + end.n0, end.mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, end.bias)));
}

// Rows [0, R) of x (K padded to even) times column blocks [block, block + B).
template <int R, int B>
LONGSPEC_AVX512_BF16 void tile(const void* x_any, int64_t x_stride, const uint16_t* packed, int64_t pairs,
                               const uint16_t* bias, uint16_t* y, int64_t N, int64_t block) {
  const uint16_t* x = static_cast<const uint16_t*>(x_any);
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
    const BlockEnd end = block_end(bias, N, block + b);
    for (int r = 0; r < R; ++r) store_row(end, acc[r][b], y + r * N);
  }
}

using Tile = void (*)(const void*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);

struct Tiles {
  Tile wide;    // `blocks` column blocks at once
  Tile single;  // one block: the last blocks of a row of groups
  int blocks;
};

template <int R>
Tiles tiles_of() {
  return {tile<R, blocks_for(R)>, tile<R, 1>, blocks_for(R)};
}

Tiles tiles_for(int64_t rows) {
  switch (rows) {
    case 1: return tiles_of<1>();
    case 2: return tiles_of<2>();
    case 3: return tiles_of<3>();
    case 4: return tiles_of<4>();
    case 5: return tiles_of<5>();
    case 6: return tiles_of<6>();
    case 7: return tiles_of<7>();
    default: return tiles_of<8>();
  }
}

// ---------------------------------------------------------------- AVX2 + FMA
constexpr int64_t kAvx2RowTile = 6;  // 16 ymm registers: 2 per row and block + 4 temporaries
constexpr int64_t kSumPairs = 32;    // weight pairs per partial sum

// Blocks per tile (each 16 columns, two 8-lane halves): enough accumulators to hide the
// FMA latency at one row, as many as fit at more.
constexpr int avx2_blocks_for(int rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }

#define LONGSPEC_AVX2_FMA __attribute__((target("avx2,fma")))

// float32 -> bf16, round to nearest even (NaN stays a quiet NaN), 8 lanes.
LONGSPEC_AVX2_FMA inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

// Rows [0, R) of x (float32, K padded to even) times column blocks [block, block + B).
template <int R, int B>
LONGSPEC_AVX2_FMA void tile_avx2(const void* x_any, int64_t x_stride, const uint16_t* packed, int64_t pairs,
                                 const uint16_t* bias, uint16_t* y, int64_t N, int64_t block) {
  const float* x = static_cast<const float*>(x_any);
  // Two-level sum: `acc` holds the products of up to kSumPairs pairs, then joins `total`.
  // A single float32 chain over K = 640-2048 products loses up to ~2e-6 of a large partial
  // sum, more than one bf16 ulp of a small result; blocks of 64 products keep the error
  // near a blocked BLAS's. The order depends on k alone, not on the tile.
  __m256 acc[R][2 * B], total[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * B; ++h) acc[r][h] = total[r][h] = _mm256_setzero_ps();
  const uint16_t* w = packed + block * pairs * 2 * kColumns;
  const int64_t block_stride = pairs * 2 * kColumns;
  const __m256i odd_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    if (p % kSumPairs == 0 && p) {
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2 * B; ++h) {
          total[r][h] = _mm256_add_ps(total[r][h], acc[r][h]);
          acc[r][h] = _mm256_setzero_ps();
        }
    }
    for (int h = 0; h < 2 * B; ++h) {
      // Lanes 8 (h % 2) .. 8 (h % 2) + 7 of block h / 2: per lane the pair (w[n, 2p], w[n, 2p + 1]).
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + (h / 2) * block_stride + p * 2 * kColumns + (h % 2) * (kColumns / 2) * 2));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, odd_half));
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + r * x_stride + 2 * p), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + r * x_stride + 2 * p + 1), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * B; ++h) acc[r][h] = _mm256_add_ps(total[r][h], acc[r][h]);
  for (int b = 0; b < B; ++b) {
    const int64_t n0 = (block + b) * kColumns;
    const int64_t left = N - n0 < kColumns ? N - n0 : kColumns;
    uint16_t bias_bits[kColumns] = {};
    if (bias) std::memcpy(bias_bits, bias + n0, left * sizeof(uint16_t));
    const __m256 add_lo = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bias_bits))), 16));
    const __m256 add_hi = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bias_bits + 8))), 16));
    for (int r = 0; r < R; ++r) {
      alignas(32) uint16_t out[kColumns];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), to_bf16(_mm256_add_ps(acc[r][2 * b], add_lo)));
      _mm_store_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16(_mm256_add_ps(acc[r][2 * b + 1], add_hi)));
      std::memcpy(y + r * N + n0, out, left * sizeof(uint16_t));
    }
  }
}

template <int R>
Tiles avx2_tiles_of() {
  return {tile_avx2<R, avx2_blocks_for(R)>, tile_avx2<R, 1>, avx2_blocks_for(R)};
}

Tiles avx2_tiles_for(int64_t rows) {
  switch (rows) {
    case 1: return avx2_tiles_of<1>();
    case 2: return avx2_tiles_of<2>();
    case 3: return avx2_tiles_of<3>();
    case 4: return avx2_tiles_of<4>();
    case 5: return avx2_tiles_of<5>();
    default: return avx2_tiles_of<6>();
  }
}

// ---------------------------------------------------------------- AMX (tile instructions, bf16)
// The packed layout is already the B operand of a bf16 tile product: 16 pairs of a block
// (32 values of k) are 16 rows of 64 bytes, lane n of pair row p holding
// (w[n, 2p], w[n, 2p + 1]). x's rows are the A tile, the sums stay in float32 tiles over
// all of K, then take the bias and one rounding to bf16 as the vector paths do. A row's sums
// depend on its own x and the k order alone, so a row gets the same bits alone or in a
// batch; they are not the AVX-512 path's bits (the tile unit adds in its own order), so a
// process uses one path for every product.
#if LONGSPEC_HAS_AMX
#define LONGSPEC_AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kAmxRows = 16;   // rows of x per tile
constexpr int64_t kAmxPairs = 16;  // weight pairs per tile product (32 values of k)
constexpr int kAmxBlocks = 4;      // column blocks at once: sum tiles 0-3

// Tiles 0-3: the sums of four column blocks (rows x 16 float32); 4: x's rows for one step
// of K; 5: a block's weights for that step; 6 and 7: the same two for a shorter last step.
LONGSPEC_AMX_BF16 void amx_configure(int64_t rows, int64_t tail_pairs) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows);
    config.bytes_per_row[t] = 64;
  }
  config.rows[4] = static_cast<uint8_t>(rows);
  config.bytes_per_row[4] = 64;
  config.rows[5] = kAmxPairs;
  config.bytes_per_row[5] = 64;
  if (tail_pairs) {
    config.rows[6] = static_cast<uint8_t>(rows);
    config.bytes_per_row[6] = static_cast<uint16_t>(4 * tail_pairs);
    config.rows[7] = static_cast<uint8_t>(tail_pairs);
    config.bytes_per_row[7] = 64;
  }
  load_tile_config(config);
}

// One step of K (x's rows in tile X) for the group's blocks: block b's weights into tile W,
// their product added to sum tile b.
#define LONGSPEC_AMX_STEP(X, W, OFFSET)                                  \
  do {                                                                             \
    _tile_loadd(W, w + (OFFSET), 64);                                              \
    _tile_dpbf16ps(0, X, W);                                                       \
    if (B > 1) {                                                                   \
      _tile_loadd(W, w + block_stride + (OFFSET), 64);                             \
      _tile_dpbf16ps(1, X, W);                                                     \
    }                                                                              \
    if (B > 2) {                                                                   \
      _tile_loadd(W, w + 2 * block_stride + (OFFSET), 64);                         \
      _tile_dpbf16ps(2, X, W);                                                     \
    }                                                                              \
    if (B > 3) {                                                                   \
      _tile_loadd(W, w + 3 * block_stride + (OFFSET), 64);                         \
      _tile_dpbf16ps(3, X, W);                                                     \
    }                                                                              \
  } while (0)

// Rows [0, rows) of x (K padded to even) times column blocks [block, block + B), with the
// tiles configured for these rows.
template <int B>
LONGSPEC_AMX_BF16 void amx_tile(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* packed, int64_t pairs,
                                const uint16_t* bias, uint16_t* y, int64_t N, int64_t block) {
  const int64_t block_stride = pairs * 2 * kColumns;
  const uint16_t* w = packed + block * block_stride;
  _tile_zero(0);
  if (B > 1) _tile_zero(1);
  if (B > 2) _tile_zero(2);
  if (B > 3) _tile_zero(3);
  const int64_t steps = pairs / kAmxPairs, tail = pairs % kAmxPairs;
  const int64_t x_bytes = x_stride * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t kStep = kAmxPairs * 2 * kColumns;  // a block's weights for one step, in bf16 values
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, x + s * 2 * kAmxPairs, x_bytes);
    LONGSPEC_AMX_STEP(4, 5, s * kStep);
  }
  if (tail) {
    _tile_loadd(6, x + steps * 2 * kAmxPairs, x_bytes);
    LONGSPEC_AMX_STEP(6, 7, steps * kStep);
  }
  alignas(64) float sums[kAmxBlocks][kAmxRows * kColumns];
  _tile_stored(0, sums[0], 64);
  if (B > 1) _tile_stored(1, sums[1], 64);
  if (B > 2) _tile_stored(2, sums[2], 64);
  if (B > 3) _tile_stored(3, sums[3], 64);
  for (int b = 0; b < B; ++b) {
    const BlockEnd end = block_end(bias, N, block + b);
    for (int64_t r = 0; r < rows; ++r) store_row(end, _mm512_load_ps(sums[b] + r * kColumns), y + r * N);
  }
}
#undef LONGSPEC_AMX_STEP

LONGSPEC_AMX_BF16 void amx_release() { _tile_release(); }

// Each task takes groups of four column blocks and walks every row tile for them, so a
// group's weights are read from memory once and from cache for the later row tiles.
void amx_product(const uint16_t* x, int64_t stride, int64_t M, const uint16_t* packed, int64_t blocks, int64_t pairs,
                 const uint16_t* bias, uint16_t* y, int64_t N) {
  const int64_t groups = (blocks + kAmxBlocks - 1) / kAmxBlocks, tail = pairs % kAmxPairs;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = 0;  // the rows the tiles are configured for (the configuration is a thread's state)
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kAmxBlocks, count = blocks - first < kAmxBlocks ? blocks - first : kAmxBlocks;
      for (int64_t row = 0; row < M; row += kAmxRows) {
        const int64_t rows = M - row < kAmxRows ? M - row : kAmxRows;
        if (rows != configured) {
          amx_configure(rows, tail);
          configured = rows;
        }
        const uint16_t* xt = x + row * stride;
        uint16_t* yt = y + row * N;
        switch (count) {
          case 4: amx_tile<4>(xt, stride, rows, packed, pairs, bias, yt, N, first); break;
          case 3: amx_tile<3>(xt, stride, rows, packed, pairs, bias, yt, N, first); break;
          case 2: amx_tile<2>(xt, stride, rows, packed, pairs, bias, yt, N, first); break;
          default: amx_tile<1>(xt, stride, rows, packed, pairs, bias, yt, N, first); break;
        }
      }
    }
    if (configured) amx_release();
  });
}
#else
void amx_product(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*, int64_t) {
  TORCH_CHECK(false, "this build has no AMX path");
}
#endif

// The instruction set a product runs on: its row tile and its tiles.
struct Isa {
  int64_t row_tile;
  Tiles (*tiles_for)(int64_t rows);
  bool float_x;  // x widened to float32 before the tiles (the AVX2 path)
  bool amx;      // the tile instructions instead (`amx_product`)
};

constexpr Isa kAvx512Bf16{kRowTile, tiles_for, false, false};
constexpr Isa kAvx2Fma{kAvx2RowTile, avx2_tiles_for, true, false};
constexpr Isa kAmxBf16{16, nullptr, false, true};

bool linear_supported() { return avx512_bf16_supported() || avx2_fma_supported(); }

// Output rows `row_of(n)`, n < N, of a contiguous [*, K] bf16 weight into the packed layout.
// With K even a weight pair is one 32-bit word, copied whole: the pack is then a strided
// copy of words, which the certified head pays for every sampled draw's candidates.
template <typename RowOf>
at::Tensor pack_rows_of(const at::Tensor& weight, int64_t N, RowOf row_of) {
  const int64_t K = weight.size(1);
  const int64_t blocks = (N + kColumns - 1) / kColumns, pairs = (K + 1) / 2;
  // Every word is written below but the lanes past N (and, for an odd K, each row's last
  // pair): only then is the whole pack zeroed first.
  at::Tensor packed = K % 2 ? at::zeros({blocks, pairs, kColumns, 2}, weight.options())
                            : at::empty({blocks, pairs, kColumns, 2}, weight.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  if (K % 2 == 0 && N % kColumns)
    for (int64_t p = 0; p < pairs; ++p)
      std::memset(out + (((blocks - 1) * pairs + p) * kColumns + N % kColumns) * 2, 0,
                  (kColumns - N % kColumns) * 2 * sizeof(uint16_t));
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t i = 0; i < kColumns && j * kColumns + i < N; ++i) {
        const uint16_t* source = w + row_of(j * kColumns + i) * K;
        uint16_t* lane = out + (j * pairs * kColumns + i) * 2;
        if (j * kColumns + i + 1 < N) {  // gathered rows lie anywhere: ask for the next one's lines now
          const char* next = reinterpret_cast<const char*>(w + row_of(j * kColumns + i + 1) * K);
          for (int64_t byte = 0; byte < K * 2; byte += 64) _mm_prefetch(next + byte, _MM_HINT_T0);
        }
        if (K % 2 == 0) {
          for (int64_t p = 0; p < pairs; ++p) std::memcpy(lane + p * kColumns * 2, source + 2 * p, 4);
        } else {
          for (int64_t k = 0; k < K; ++k) lane[(k / 2) * kColumns * 2 + k % 2] = source[k];
        }
      }
  });
  return packed;
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "a contiguous [N, K] bf16 weight");
  return pack_rows_of(weight, weight.size(0), [](int64_t n) { return n; });
}

// The packed layout of weight[rows] without the gathered copy: the certified head recomputes
// its candidates' logits through the plain head's kernel over such a pack.
at::Tensor pack_rows(const at::Tensor& weight, const at::Tensor& rows) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "a contiguous [N, K] bf16 weight");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows: int64 [R]");
  const int64_t* index = rows.data_ptr<int64_t>();
  const int64_t R = rows.numel(), V = weight.size(0);
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(index[r] >= 0 && index[r] < V, "row ", index[r], " outside [0, ", V, ")");
  return pack_rows_of(weight, R, [index](int64_t n) { return index[n]; });
}

at::Tensor linear_on(const Isa& on, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     const std::optional<at::Tensor>& bias) {
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
  if (on.float_x) xe = xe.to(at::kFloat);
  const int64_t stride = xe.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xs = static_cast<const char*>(xe.data_ptr());
  const int64_t x_bytes = xe.element_size();
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (on.amx) {
    amx_product(static_cast<const uint16_t*>(xe.data_ptr()), stride, M, ws, blocks, pairs, bias_bits, ys, N);
    return y;
  }
  // Row tiles of up to 8 (AVX2: 6) rows; each task walks its column groups for every row
  // tile, so a group's weight (a few blocks x K values) is read from memory once and from
  // cache after. The last, shorter tile takes as many blocks at once as suit its rows
  // (with the taller tile's few blocks it had too few independent sums to hide the FMA
  // latency, and a 7-row product cost as much as a 12-row one on AVX2).
  const int64_t row_tile = on.row_tile;
  const bool many = M > row_tile;
  const int64_t full_tiles = M / row_tile, rest = M % row_tile;
  const Tiles full = on.tiles_for(many ? row_tile : M), tail = on.tiles_for(rest ? rest : 1);
  const bool has_tail = many && rest;
  const int64_t row_tiles = many ? full_tiles + (rest ? 1 : 0) : 1;
  // The group stays a whole number of the taller tile's blocks, so that tile never falls
  // back to single blocks, and stays narrow where too few groups would remain to share
  // among the threads.
  const int64_t tail_group = (tail.blocks + full.blocks - 1) / full.blocks * full.blocks;
  const bool wide_tail = has_tail && blocks / tail_group >= kGroupsPerThread * at::get_num_threads();
  const int64_t group = wide_tail ? tail_group : full.blocks;
  const int64_t groups = (blocks + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, count = blocks - first < group ? blocks - first : group;
      for (int64_t t = 0; t < row_tiles; ++t) {
        const Tiles& tiles = has_tail && t == full_tiles ? tail : full;
        const void* xt = xs + t * row_tile * stride * x_bytes;
        uint16_t* yt = ys + t * row_tile * N;
        int64_t b = 0;
        for (; b + tiles.blocks <= count; b += tiles.blocks) tiles.wide(xt, stride, ws, pairs, bias_bits, yt, N, first + b);
        for (; b < count; ++b) tiles.single(xt, stride, ws, pairs, bias_bits, yt, N, first + b);
      }
    }
  });
  return y;
}

// The product on the best instruction set of this CPU: AMX's bf16 tiles, else AVX-512 BF16,
// else AVX2 with FMA. The choice is made once per process, so every product of a process
// rounds alike.
const Isa& best_isa() {
  static const Isa& best = amx_bf16_supported() && avx512_bf16_supported() ? kAmxBf16
                           : avx512_bf16_supported()                        ? kAvx512Bf16
                                                                            : kAvx2Fma;
  return best;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_supported(), "bf16_packed_linear needs AVX-512 BF16 or AVX2 with FMA");
  return linear_on(best_isa(), x, packed, N, bias);
}

// Named paths on any CPU that has them (tests and A/B measurements).
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx2_fma_supported(), "bf16_packed_linear_avx2 needs AVX2 with FMA");
  return linear_on(kAvx2Fma, x, packed, N, bias);
}

at::Tensor linear_avx512(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx512_bf16_supported(), "bf16_packed_linear_avx512 needs AVX-512 BF16");
  return linear_on(kAvx512Bf16, x, packed, N, bias);
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_bf16_supported() && avx512_bf16_supported(), "bf16_packed_linear_amx needs AMX with bf16 tiles");
  return linear_on(kAmxBf16, x, packed, N, bias);
}

// Which path `bf16_packed_linear` takes here: "amx", "avx512_bf16" or "avx2".
std::string linear_path() {
  const Isa& best = best_isa();
  return best.amx ? "amx" : best.float_x ? "avx2" : "avx512_bf16";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("avx512_bf16_supported() -> bool", &avx512_bf16_supported);
  m.def("bf16_linear_supported() -> bool", &linear_supported);
  m.def("bf16_linear_avx2_supported() -> bool", &avx2_fma_supported);
  m.def("bf16_pack_weight(Tensor weight) -> Tensor");
  m.impl("bf16_pack_weight", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.def("bf16_pack_rows(Tensor weight, Tensor rows) -> Tensor");
  m.impl("bf16_pack_rows", c10::DispatchKey::CPU, TORCH_FN(pack_rows));
  m.def("bf16_packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("bf16_packed_linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("bf16_packed_linear_avx2(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("bf16_packed_linear_avx2", c10::DispatchKey::CPU, TORCH_FN(linear_avx2));
  m.def("bf16_linear_amx_supported() -> bool", []() { return amx_bf16_supported() && avx512_bf16_supported(); });
  m.def("bf16_linear_path() -> str", &linear_path);
  m.def("bf16_packed_linear_avx512(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("bf16_packed_linear_avx512", c10::DispatchKey::CPU, TORCH_FN(linear_avx512));
  m.def("bf16_packed_linear_amx(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("bf16_packed_linear_amx", c10::DispatchKey::CPU, TORCH_FN(linear_amx));
}
