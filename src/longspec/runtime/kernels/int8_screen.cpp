// The certified head's screen: approximate logits from an int8 copy of the output layer,
// and the rows whose exact logit could still be the largest.
//
// A decision (greedy decoding, greedy verification) needs the argmax of the logits, not
// the logits. The screen reads the int8 copy (half the bf16 head's bytes) and computes,
// for every output row i, s_i = sum_g scale_ig * alpha_g * sum_{k in g} q_ik x_k with
// int8 weight codes q, int16 activation codes x (h_k ~ alpha_g x_k, one alpha per group
// of the row of h) and the integer sums exact in int32; a rigorous bound
// (runtime/certified_head.py derives it) says how far the exact bf16 logit can lie from
// s_i. Only the rows whose upper bound reaches the largest lower bound are candidates;
// the caller recomputes them exactly with the plain head's own kernel, so the argmax is
// the plain head's, bit for bit.
//
// Integer products: a pair of int16 activations against a pair of weights per lane
// (`vpmaddwd`, or `vpdpwssd` where AVX-512 VNNI has it) does 32 multiply-adds a zmm
// instruction where converting int8 weights to float32 for FMAs does 16 in three.
//
// Packed layout: [ceil(N / 16), K / 2, 16, 2] int8 (K a whole number of groups; zero past
// N or the weight's K): per pair of k one 32-byte load gives lane i the weights
// (q[16 j + i, 2 p], q[16 j + i, 2 p + 1]). Scales: [ceil(N / 16), G, 16] float32.
//
// The screen also summarises each row: the largest s over every span of kSpan output rows
// (NaN counted as +inf), written while the span is still in cache. The candidates and a
// sampler's tail then read the summary and visit only the spans that can hold a row near
// the top: one or a few of 256, where two passes over the whole row cost as much as a
// decode step's products of one more token.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_features.h"

namespace {

constexpr int64_t kLanes = 16;  // output rows per block
constexpr int64_t kBlocksPerTask = 64;  // a task streams these blocks' weights once for all its row tiles
constexpr int64_t kSpan = kBlocksPerTask * kLanes;  // output rows per summarised span: one task's blocks

#define LONGSPEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define LONGSPEC_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define LONGSPEC_AVX2_FMA __attribute__((target("avx2,fma")))

inline bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

inline bool avx512_vnni_supported() { return avx512_supported() && __builtin_cpu_supports("avx512vnni"); }

// What a tile needs: x [rows, K] int16 codes, alpha [rows, G] float32, the packed codes and scales.
struct Operands {
  const int16_t* x;
  const float* alpha;
  const int8_t* q;
  const float* scales;
  int64_t K, group, groups, N;
  float* s;
  float* span_max;  // [M, spans]: the largest s of each span of kSpan output rows, NaN as +inf
  int64_t spans;
  float (*span_maximum)(const float*, int64_t);  // the summary's kernel on the screen's instruction set
};

// The largest of n values, +inf where one is NaN (a summary that must never hide a row).
// max_ps(v, top) returns `top` where v is NaN; NaNs are caught by an unordered compare.
LONGSPEC_AVX512 float span_maximum_avx512(const float* values, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 not_a_number = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(values + i);
    not_a_number |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);
  }
  float best = _mm512_reduce_max_ps(top);
  for (; i < n; ++i) {
    not_a_number |= values[i] != values[i];
    best = values[i] > best ? values[i] : best;
  }
  return not_a_number ? INFINITY : best;
}

LONGSPEC_AVX2_FMA float span_maximum_avx2(const float* values, int64_t n) {
  __m256 top = _mm256_set1_ps(-INFINITY), not_a_number = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(values + i);
    not_a_number = _mm256_or_ps(not_a_number, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(v, top);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = -INFINITY;
  for (float lane : lanes) best = lane > best ? lane : best;
  bool nan = _mm256_movemask_ps(not_a_number) != 0;
  for (; i < n; ++i) {
    nan |= values[i] != values[i];
    best = values[i] > best ? values[i] : best;
  }
  return nan ? INFINITY : best;
}

float span_maximum_scalar(const float* values, int64_t n) {
  float best = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= values[i] != values[i];
    best = values[i] > best ? values[i] : best;
  }
  return nan ? INFINITY : best;
}

// Rows [0, M) of span `span` (blocks [span * kBlocksPerTask, ...)), once their screen is written.
void summarize_span(const Operands& o, int64_t M, int64_t span) {
  const int64_t first = span * kSpan, n = o.N - first < kSpan ? o.N - first : kSpan;
  for (int64_t r = 0; r < M; ++r) o.span_max[r * o.spans + span] = o.span_maximum(o.s + r * o.N + first, n);
}

using Tile = void (*)(const Operands& o, int64_t row, int64_t block);

inline int32_t pair_at(const int16_t* x, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, x + k, sizeof bits);
  return bits;
}

// Rows [row, row + R) of x times output blocks [block, block + B), AVX-512. Written once
// for two instruction sets (a function's target cannot depend on a template parameter):
// ACCUMULATE(acc, w, x) adds the pairwise products of w and x to acc.
#define LONGSPEC_SCREEN_TILE512(NAME, TARGET, ACCUMULATE)                                                         \
  template <int R, int B>                                                                                      \
  TARGET void NAME(const Operands& o, int64_t row, int64_t block) {                                            \
    const int64_t pairs = o.K / 2, group_pairs = o.group / 2;                                                  \
    __m512 total[R][B];                                                                                        \
    for (int r = 0; r < R; ++r)                                                                                \
      for (int b = 0; b < B; ++b) total[r][b] = _mm512_setzero_ps();                                           \
    for (int64_t g = 0; g < o.groups; ++g) {                                                                   \
      __m512i acc[R][B];                                                                                       \
      for (int r = 0; r < R; ++r)                                                                              \
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_si512();                                        \
      for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; ++p) {                                      \
        __m512i w[B];                                                                                          \
        for (int b = 0; b < B; ++b)                                                                            \
          w[b] = _mm512_cvtepi8_epi16(                                                                         \
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.q + ((block + b) * pairs + p) * 2 * kLanes))); \
        for (int r = 0; r < R; ++r) {                                                                          \
          const __m512i x = _mm512_set1_epi32(pair_at(o.x + (row + r) * o.K, 2 * p));                          \
          for (int b = 0; b < B; ++b) acc[r][b] = ACCUMULATE(acc[r][b], w[b], x);                              \
        }                                                                                                      \
      }                                                                                                        \
      for (int b = 0; b < B; ++b) {                                                                            \
        const __m512 scale = _mm512_loadu_ps(o.scales + ((block + b) * o.groups + g) * kLanes);                \
        for (int r = 0; r < R; ++r) {                                                                          \
          const __m512 factor = _mm512_mul_ps(scale, _mm512_set1_ps(o.alpha[(row + r) * o.groups + g]));       \
          total[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][b]), factor, total[r][b]);                  \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (int b = 0; b < B; ++b) {                                                                              \
      const int64_t n0 = (block + b) * kLanes;                                                                 \
      const int64_t left = o.N - n0 < kLanes ? o.N - n0 : kLanes;                                             \
      const __mmask16 mask = left == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);                 \
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(o.s + (row + r) * o.N + n0, mask, total[r][b]);       \
    }                                                                                                          \
  }

#define LONGSPEC_MADD_ACCUMULATE(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
LONGSPEC_SCREEN_TILE512(tile512, LONGSPEC_AVX512, LONGSPEC_MADD_ACCUMULATE)
LONGSPEC_SCREEN_TILE512(tile512_vnni, LONGSPEC_AVX512_VNNI, _mm512_dpwssd_epi32)

// The same on AVX2: a block's 16 lanes as two 8-lane halves.
template <int R, int B>
LONGSPEC_AVX2_FMA void tile256(const Operands& o, int64_t row, int64_t block) {
  const int64_t pairs = o.K / 2, group_pairs = o.group / 2;
  __m256 total[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * B; ++i) total[r][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < o.groups; ++g) {
    __m256i acc[R][2 * B];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * B; ++i) acc[r][i] = _mm256_setzero_si256();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; ++p) {
      __m256i w[2 * B];
      for (int b = 0; b < B; ++b) {
        const int8_t* at = o.q + ((block + b) * pairs + p) * 2 * kLanes;
        w[2 * b] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        w[2 * b + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + kLanes)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(pair_at(o.x + (row + r) * o.K, 2 * p));
        for (int i = 0; i < 2 * B; ++i) acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(w[i], x));
      }
    }
    for (int b = 0; b < B; ++b) {
      const float* sc = o.scales + ((block + b) * o.groups + g) * kLanes;
      const __m256 lo = _mm256_loadu_ps(sc), hi = _mm256_loadu_ps(sc + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(o.alpha[(row + r) * o.groups + g]);
        total[r][2 * b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][2 * b]), _mm256_mul_ps(lo, a), total[r][2 * b]);
        total[r][2 * b + 1] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][2 * b + 1]), _mm256_mul_ps(hi, a), total[r][2 * b + 1]);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t n0 = (block + b) * kLanes;
    const int64_t left = o.N - n0 < kLanes ? o.N - n0 : kLanes;
    for (int r = 0; r < R; ++r) {
      alignas(32) float out[kLanes];
      _mm256_store_ps(out, total[r][2 * b]);
      _mm256_store_ps(out + 8, total[r][2 * b + 1]);
      for (int64_t i = 0; i < left; ++i) o.s[(row + r) * o.N + n0 + i] = out[i];
    }
  }
}

// The portable path (CPUs with neither): the same sums, one lane at a time.
void tile_scalar(const Operands& o, int64_t row, int64_t rows, int64_t block) {
  const int64_t pairs = o.K / 2;
  for (int64_t r = row; r < row + rows; ++r)
    for (int64_t i = 0; i < kLanes && block * kLanes + i < o.N; ++i) {
      float total = 0.f;
      for (int64_t g = 0; g < o.groups; ++g) {
        int32_t acc = 0;
        for (int64_t k = g * o.group; k < (g + 1) * o.group; ++k)
          acc += int32_t(o.q[((block * pairs + k / 2) * kLanes + i) * 2 + k % 2]) * int32_t(o.x[r * o.K + k]);
        const float factor = o.scales[(block * o.groups + g) * kLanes + i] * o.alpha[r * o.groups + g];
        total = std::fma(static_cast<float>(acc), factor, total);
      }
      o.s[r * o.N + block * kLanes + i] = total;
    }
}

// AMX (tile instructions, int8): the same integer sums as the paths above, through
// int8 tile products. An int16 code x splits exactly into x = 256 xh + xl (xh signed,
// xl unsigned, 8 bits each), so sum_k q_k x_k = 256 sum_k q_k xh_k + sum_k q_k xl_k, both
// in int32 (64 products of a group stay far from its range). Activations are the A
// tiles (rows of x, 64 codes of a group), the weights the B tile: per group a block's
// 16 output rows x 64 codes in the tile's quad layout, interleaved from two pair rows
// of the packed head by one permute. The float steps after the sums are the paths'
// own, in the same order, so the screen is the same bits on every path.
constexpr int64_t kAmxRows = 16;   // rows of x per tile
constexpr int64_t kAmxGroup = 64;  // a group is one tile product (64 int8 codes a row)
constexpr int64_t kAmxMinRows = 5;  // fewer rows: the vector paths are faster (the lab note, below)

bool amx_supported() { return amx_int8_supported(); }

#if LONGSPEC_HAS_AMX
#define LONGSPEC_AMX __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))

// A block's B tile for group g: 16 quad rows of 64 bytes, output lane n of quad row r
// holding the codes (4r .. 4r + 3) of the group for output row n, interleaved from the
// packed pair rows (2r) and (2r + 1) by one permute.
LONGSPEC_AMX void amx_weights(const Operands& o, int64_t block, int64_t g, __m512i index, int8_t* out) {
  const int64_t pairs = o.K / 2, group_pairs = kAmxGroup / 2;
  const int8_t* pair_rows = o.q + (block * pairs + g * group_pairs) * 2 * kLanes;
  for (int quad = 0; quad < 16; ++quad) {
    const __m512i first = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_rows + 2 * quad * 2 * kLanes)));
    const __m512i second = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_rows + (2 * quad + 1) * 2 * kLanes)));
    _mm512_store_si512(out + quad * 64, _mm512_permutex2var_epi16(first, index, second));
  }
}

// Add one group's sums (high and low halves, [16 rows][16 lanes] int32) of a block to its
// totals, rows [row, row + R), as the vector paths do.
LONGSPEC_AMX inline void amx_fold(const Operands& o, const int32_t* high, const int32_t* low, int64_t block, int64_t g,
                                  int64_t row, int64_t R, __m512* total) {
  const __m512 scale = _mm512_loadu_ps(o.scales + (block * o.groups + g) * kLanes);
  for (int64_t r = 0; r < R; ++r) {
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + r * 16), 8),
                                         _mm512_load_si512(low + r * 16));
    const __m512 factor = _mm512_mul_ps(scale, _mm512_set1_ps(o.alpha[(row + r) * o.groups + g]));
    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), factor, total[r]);
  }
}

LONGSPEC_AMX void amx_store(const Operands& o, int64_t block, int64_t row, int64_t R, const __m512* total) {
  const int64_t n0 = block * kLanes;
  const int64_t left = o.N - n0 < kLanes ? o.N - n0 : kLanes;
  const __mmask16 mask = left == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(o.s + (row + r) * o.N + n0, mask, total[r]);
}

// Rows [row, row + R) (R <= 16; xh, xl padded to 16 rows past row) against blocks
// [first, last), two blocks at a time: the activation tiles of a group serve both, and
// building one block's weight tile overlaps the other's products. Tiles: 0, 1 the
// activations (high, low); 2, 3 the two blocks' weights; 4-7 their sums.
LONGSPEC_AMX void amx_rows(const Operands& o, const int8_t* xh, const uint8_t* xl, int64_t row, int64_t R,
                           int64_t first, int64_t last) {
  alignas(64) int8_t weights[2][16 * 64];
  alignas(64) int32_t sums[4][kAmxRows * 16];
  alignas(64) static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i index = _mm512_load_si512(interleave);
  for (int64_t block = first; block < last; block += 2) {
    const int64_t pair = block + 1 < last ? 2 : 1;  // blocks in this step
    __m512 total[2][kAmxRows];
    for (int64_t r = 0; r < R; ++r) total[0][r] = total[1][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < o.groups; ++g) {
      _tile_loadd(0, xh + row * o.K + g * kAmxGroup, o.K);
      _tile_loadd(1, xl + row * o.K + g * kAmxGroup, o.K);
      for (int64_t b = 0; b < pair; ++b) amx_weights(o, block + b, g, index, weights[b]);
      _tile_zero(4);
      _tile_zero(5);
      _tile_loadd(2, weights[0], 64);
      _tile_dpbssd(4, 0, 2);
      _tile_dpbusd(5, 1, 2);
      if (pair == 2) {
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(3, weights[1], 64);
        _tile_dpbssd(6, 0, 3);
        _tile_dpbusd(7, 1, 3);
      }
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
      amx_fold(o, sums[0], sums[1], block, g, row, R, total[0]);
      if (pair == 2) {
        _tile_stored(6, sums[2], 64);
        _tile_stored(7, sums[3], 64);
        amx_fold(o, sums[2], sums[3], block + 1, g, row, R, total[1]);
      }
    }
    for (int64_t b = 0; b < pair; ++b) amx_store(o, block + b, row, R, total[b]);
  }
}

LONGSPEC_AMX void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  load_tile_config(config);
}

LONGSPEC_AMX void amx_release() { _tile_release(); }

void screen_amx(const Operands& o, int64_t M) {
  // x split once, padded with zero rows to whole tiles: xh = x >> 8 (arithmetic), xl = x & 255.
  const int64_t padded = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::vector<int8_t> xh(padded * o.K, 0);
  std::vector<uint8_t> xl(padded * o.K, 0);
  for (int64_t i = 0; i < M * o.K; ++i) {
    xh[i] = static_cast<int8_t>(o.x[i] >> 8);
    xl[i] = static_cast<uint8_t>(o.x[i] & 0xFF);
  }
  const int64_t blocks = (o.N + kLanes - 1) / kLanes;
  at::parallel_for(0, (blocks + kBlocksPerTask - 1) / kBlocksPerTask, 1, [&](int64_t begin, int64_t end) {
    amx_configure();  // per thread: the tile configuration is a thread's state
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kBlocksPerTask;
      const int64_t last = first + kBlocksPerTask < blocks ? first + kBlocksPerTask : blocks;
      for (int64_t row = 0; row < M; row += kAmxRows)  // a task's weights stay in cache for every row tile
        amx_rows(o, xh.data(), xl.data(), row, M - row < kAmxRows ? M - row : kAmxRows, first, last);
      summarize_span(o, M, task);
    }
    amx_release();
  });
}
#else
void screen_amx(const Operands&, int64_t) { TORCH_CHECK(false, "this build has no AMX path"); }
#endif

struct Tiles {
  Tile wide, single;
  int blocks;
  int rows;
};

template <int R, int B>
Tiles avx512_tiles() { return {tile512<R, B>, tile512<R, 1>, B, R}; }
template <int R, int B>
Tiles vnni_tiles() { return {tile512_vnni<R, B>, tile512_vnni<R, 1>, B, R}; }
template <int R, int B>
Tiles avx2_tiles() { return {tile256<R, B>, tile256<R, 1>, B, R}; }

enum class Isa { kVnni, kAvx512, kAvx2, kScalar, kAmx };

Isa best_isa() {
  if (avx512_vnni_supported()) return Isa::kVnni;
  if (avx512_supported()) return Isa::kAvx512;
  if (avx2_fma_supported()) return Isa::kAvx2;
  return Isa::kScalar;
}

// Row tiles and blocks per tile: accumulators (2 per row and block), the weights and a
// broadcast fit the register file (32 zmm; 16 ymm).
Tiles tiles_for(Isa isa, int64_t rows) {
  if (isa == Isa::kVnni || isa == Isa::kAvx512) {
    const bool vnni = isa == Isa::kVnni;
    switch (rows) {
      case 1: return vnni ? vnni_tiles<1, 8>() : avx512_tiles<1, 8>();
      case 2: return vnni ? vnni_tiles<2, 6>() : avx512_tiles<2, 6>();
      case 3: return vnni ? vnni_tiles<3, 4>() : avx512_tiles<3, 4>();
      default: return vnni ? vnni_tiles<4, 3>() : avx512_tiles<4, 3>();
    }
  }
  switch (rows) {
    case 1: return avx2_tiles<1, 2>();
    default: return avx2_tiles<2, 1>();
  }
}

void screen_rows(const Operands& o, int64_t M, Isa isa) {
  if (isa == Isa::kAmx) {
    screen_amx(o, M);
    return;
  }
  const int64_t blocks = (o.N + kLanes - 1) / kLanes;
  if (isa == Isa::kScalar) {
    at::parallel_for(0, o.spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t span = begin; span < end; ++span) {
        const int64_t last = (span + 1) * kBlocksPerTask < blocks ? (span + 1) * kBlocksPerTask : blocks;
        for (int64_t j = span * kBlocksPerTask; j < last; ++j) tile_scalar(o, 0, M, j);
        summarize_span(o, M, span);
      }
    });
    return;
  }
  const int64_t row_tile = tiles_for(isa, 1 << 20).rows;
  at::parallel_for(0, (blocks + kBlocksPerTask - 1) / kBlocksPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t first = task * kBlocksPerTask;
      const int64_t last = first + kBlocksPerTask < blocks ? first + kBlocksPerTask : blocks;
      for (int64_t r0 = 0; r0 < M; r0 += row_tile) {
        const Tiles tiles = tiles_for(isa, M - r0 < row_tile ? M - r0 : row_tile);
        int64_t b = first;
        for (; b + tiles.blocks <= last; b += tiles.blocks) tiles.wide(o, r0, b);
        for (; b < last; ++b) tiles.single(o, r0, b);
      }
      summarize_span(o, M, task);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> screen_on(Isa isa, const at::Tensor& x, const at::Tensor& alpha,
                                             const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                                             int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kShort && x.dim() == 2 && x.is_contiguous(), "x: contiguous int16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kLanes &&
                  packed.size(3) == 2 && packed.is_contiguous(), "a head packed by certified_head.py");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(group % 2 == 0 && K % group == 0 && packed.size(1) * 2 == K && blocks == (n + kLanes - 1) / kLanes,
              "shapes disagree");
  const int64_t groups = K / group;
  TORCH_CHECK(alpha.scalar_type() == at::kFloat && alpha.is_contiguous() && alpha.numel() == M * groups,
              "alpha: float32 [M, groups]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks * groups * kLanes,
              "scales: float32 [blocks, groups, 16]");
  at::Tensor s = at::empty({M, n}, alpha.options());
  const int64_t spans = (n + kSpan - 1) / kSpan;
  at::Tensor span_max = at::empty({M, spans}, alpha.options());
  const Operands o{x.data_ptr<int16_t>(), alpha.data_ptr<float>(), packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                   K, group, groups, n, s.data_ptr<float>(), span_max.data_ptr<float>(), spans,
                   isa == Isa::kScalar ? span_maximum_scalar
                   : isa == Isa::kAvx2 ? span_maximum_avx2
                                       : span_maximum_avx512};
  if (M) screen_rows(o, M, isa);
  return {s, span_max};
}

// s = the screen of every row of x [M, K] (int16 codes, scales alpha [M, G]), and its
// summary (the largest s of each span of kSpan output rows), on the best instruction set
// of this CPU.
std::tuple<at::Tensor, at::Tensor> screen(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& packed,
                                          const at::Tensor& scales, int64_t n, int64_t group) {
  static const Isa isa = best_isa();
  // One row reads the codes at the memory's rate on any path; from a few rows on, the
  // integer products bound the vector paths, and AMX's tiles do them at a fraction of
  // their cost (docs/lab-notes/certified-head.md#amx-for-the-screens-rows).
  const bool tiles = x.size(0) >= kAmxMinRows && group == kAmxGroup && amx_supported();
  return screen_on(tiles ? Isa::kAmx : isa, x, alpha, packed, scales, n, group);
}

// The same on a named instruction set (tests: every path this CPU can run).
std::tuple<at::Tensor, at::Tensor> screen_with(const at::Tensor& x, const at::Tensor& alpha,
                                               const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                                               int64_t group, int64_t isa) {
  const Isa named = static_cast<Isa>(isa);
  TORCH_CHECK(isa >= 0 && isa <= 4, "isa: 0 VNNI, 1 AVX-512, 2 AVX2, 3 scalar, 4 AMX");
  TORCH_CHECK(named != Isa::kAmx || amx_supported(), "this CPU has no AMX int8 tiles");
  TORCH_CHECK(named != Isa::kAmx || group == kAmxGroup, "the AMX path takes groups of 64 codes");
  TORCH_CHECK(named != Isa::kVnni || avx512_vnni_supported(), "this CPU has no AVX-512 VNNI");
  TORCH_CHECK(named != Isa::kAvx512 || avx512_supported(), "this CPU has no AVX-512");
  TORCH_CHECK(named != Isa::kAvx2 || avx2_fma_supported(), "this CPU has no AVX2 with FMA");
  return screen_on(named, x, alpha, packed, scales, n, group);
}

std::vector<int64_t> screen_isas() {
  std::vector<int64_t> isas;
  if (avx512_vnni_supported()) isas.push_back(0);
  if (avx512_supported()) isas.push_back(1);
  if (avx2_fma_supported()) isas.push_back(2);
  isas.push_back(3);
  if (amx_supported()) isas.push_back(4);
  return isas;
}

// The candidates of each row of the screen s [M, N]: the rows i whose upper bound
//   hi_i = s_i + B_i + u (|s_i| + B_i),  B_i = a e_i + d w_i + b c_i (+ tiny)
// reaches the largest lower bound lo_j = s_j - B_j - u (|s_j| + B_j) less the row's
// margin (0: the rows that could hold the argmax; a sampler asks for the rows within a
// margin of it), with (a, d, b) per row of h (coefficients [M, 3]: its norms times the
// error constants) and e, w, c per output row. Computed in double. A row with more than
// `cap` candidates, or a non-finite screen, gets none and count -1 (the caller then takes
// the full head for it). `summary`: the screen's span maxima (then only the spans that
// reach the threshold are read; the same rows are found). Returns (indices [total],
// offsets [M + 1] into them, counts [M]).
// Append to `out`, ascending, every i in [begin, end) with !(row[i] < threshold): the rows
// at or above it, and NaN. Sixteen at a time where AVX-512 has them (almost every block
// holds none), else one at a time: the same rows in the same order either way.
LONGSPEC_AVX512 void scan_at_or_above_avx512(const float* row, int64_t begin, int64_t end, float threshold,
                                             std::vector<int64_t>& out) {
  const __m512 limit = _mm512_set1_ps(threshold);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __mmask16 hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), limit, _CMP_NLT_UQ);
    while (hits) {
      out.push_back(i + __builtin_ctz(hits));
      hits &= hits - 1;
    }
  }
  for (; i < end; ++i)
    if (!(row[i] < threshold)) out.push_back(i);
}

void scan_at_or_above(const float* row, int64_t begin, int64_t end, float threshold, std::vector<int64_t>& out) {
  static const bool wide = avx512_supported();
  if (wide) {
    scan_at_or_above_avx512(row, begin, end, threshold, out);
    return;
  }
  for (int64_t i = begin; i < end; ++i)
    if (!(row[i] < threshold)) out.push_back(i);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> candidates(
    const at::Tensor& s, const std::optional<at::Tensor>& summary, const at::Tensor& e, const at::Tensor& w,
    const at::Tensor& c, const at::Tensor& coefficients, const at::Tensor& margins, const at::Tensor& maxima, double u,
    double tiny, int64_t cap) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 2 && s.is_contiguous(), "s: float32 [M, N]");
  const int64_t M = s.size(0), N = s.size(1), spans = (N + kSpan - 1) / kSpan;
  TORCH_CHECK(!summary.has_value() || (summary->scalar_type() == at::kFloat && summary->is_contiguous() &&
                                       summary->dim() == 2 && summary->size(0) == M && summary->size(1) == spans),
              "summary: float32 [M, spans], the screen's own");
  const float* span_max = summary.has_value() ? summary->data_ptr<float>() : nullptr;
  for (const at::Tensor* t : {&e, &w, &c})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == N && t->is_contiguous(), "e, w, c: float32 [N]");
  TORCH_CHECK(coefficients.scalar_type() == at::kDouble && coefficients.is_contiguous() && coefficients.numel() == 3 * M,
              "coefficients: float64 [M, 3]");
  TORCH_CHECK(margins.scalar_type() == at::kDouble && margins.is_contiguous() && margins.numel() == M,
              "margins: float64 [M]");
  const double* mp = margins.data_ptr<double>();
  std::vector<double> cuts(M, 0.0);
  const float* sp = s.data_ptr<float>();
  const float* ep = e.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const double* kp = coefficients.data_ptr<double>();
  TORCH_CHECK(maxima.scalar_type() == at::kDouble && maxima.numel() == 3, "maxima: float64 [3] (of e, w, c)");
  const double e_max = maxima.data_ptr<double>()[0], w_max = maxima.data_ptr<double>()[1],
               c_max = maxima.data_ptr<double>()[2];
  std::vector<std::vector<int64_t>> found(M);
  std::vector<int64_t> counts(M, 0);
  // One row alone (a decode step) spreads its scans over the threads; several rows take a thread each.
  const int64_t span_grain = M == 1 ? 16384 : N;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = sp + r * N;
      const double a = kp[3 * r], d = kp[3 * r + 1], b = kp[3 * r + 2];
      const auto band = [&](int64_t i) { return a * ep[i] + d * wp[i] + b * cp[i] + tiny; };
      // A threshold no candidate's screen is below: the lower bound of the largest score
      // with the largest band (<= every largest lower bound), then the least score whose
      // upper bound with the largest band reaches it, as a float rounded down.
      const float* summary = span_max != nullptr ? span_max + r * spans : nullptr;
      const float top = summary != nullptr ? span_maximum_scalar(summary, spans)
                                           : at::parallel_reduce(0, N, span_grain, -INFINITY,
                                                                 [&](int64_t lo, int64_t hi, float best) {
#pragma omp simd reduction(max : best)
        for (int64_t i = lo; i < hi; ++i) best = row[i] > best ? row[i] : best;
        return best;
      }, [](float x, float y) { return x > y ? x : y; });
      const double band_max = a * e_max + d * w_max + b * c_max + tiny;
      const double floor_lo = top - band_max - u * (std::fabs(double(top)) + band_max);
      if (!std::isfinite(floor_lo)) {  // a non-finite screen: no certificate
        counts[r] = -1;
        continue;
      }
      const double target = floor_lo - mp[r];  // no candidate's upper bound is below this
      const double reach = target - band_max * (1 + u);
      const double least = reach >= 0 ? reach / (1 + u) : reach / (1 - u);
      const float threshold = std::nextafter(std::nextafter(static_cast<float>(least), -INFINITY), -INFINITY);
      // Rows at or above the threshold, and NaN (no certificate), in ascending order: in the
      // spans whose summary reaches the threshold (a NaN's span is +inf), else everywhere.
      std::vector<int64_t> near;
      if (summary != nullptr) {
        for (int64_t span = 0; span < spans; ++span)
          if (!(summary[span] < threshold))
            scan_at_or_above(row, span * kSpan, (span + 1) * kSpan < N ? (span + 1) * kSpan : N, threshold, near);
      } else {
        const int64_t parts_count = (N + span_grain - 1) / span_grain;
        std::vector<std::vector<int64_t>> parts(parts_count);
        at::parallel_for(0, parts_count, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t part = lo; part < hi; ++part) {
            const int64_t last = (part + 1) * span_grain < N ? (part + 1) * span_grain : N;
            scan_at_or_above(row, part * span_grain, last, threshold, parts[part]);
          }
        });
        for (const auto& part : parts) near.insert(near.end(), part.begin(), part.end());
      }
      bool not_a_number = false;
      for (int64_t i : near) not_a_number |= std::isnan(row[i]);
      if (not_a_number) {
        counts[r] = -1;
        continue;
      }
      double lo_max = floor_lo;
      for (int64_t i : near) {
        const double si = row[i], bi = band(i);
        const double lo = si - bi - u * (std::fabs(si) + bi);
        lo_max = lo > lo_max ? lo : lo_max;
      }
      auto& kept = found[r];
      cuts[r] = lo_max - mp[r];
      for (int64_t i : near) {
        const double si = row[i], bi = band(i);
        if (si + bi + u * (std::fabs(si) + bi) >= cuts[r]) {
          if (static_cast<int64_t>(kept.size()) == cap) {
            kept.clear();
            counts[r] = -1;
            break;
          }
          kept.push_back(i);
        }
      }
      if (counts[r] == 0) counts[r] = static_cast<int64_t>(kept.size());
    }
  });
  at::Tensor offsets = at::empty({M + 1}, s.options().dtype(at::kLong));
  at::Tensor count_tensor = at::empty({M}, s.options().dtype(at::kLong));
  int64_t* op = offsets.data_ptr<int64_t>();
  op[0] = 0;
  for (int64_t r = 0; r < M; ++r) {
    op[r + 1] = op[r] + (counts[r] > 0 ? counts[r] : 0);
    count_tensor.data_ptr<int64_t>()[r] = counts[r];
  }
  at::Tensor indices = at::empty({op[M]}, s.options().dtype(at::kLong));
  int64_t* ip = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    if (counts[r] > 0)
      for (size_t j = 0; j < found[r].size(); ++j) ip[op[r] + j] = found[r][j];
  at::Tensor cut_tensor = at::empty({M}, s.options().dtype(at::kDouble));
  for (int64_t r = 0; r < M; ++r) cut_tensor.data_ptr<double>()[r] = cuts[r];
  return {indices, offsets, count_tensor, cut_tensor};
}

// Activation rows h [M, H] (bf16) -> int16 codes [M, K] (K = groups * group, zero past
// H), their float32 scales [M, G] (alpha = the group's largest |h| / 32767, rounded up)
// and the bound's coefficients [M, 3] in float64: (||h|| + ||d||, ||d||, gamma (|h|_1 +
// |d|_1)), d = h - alpha x the remainder, each inflated by 2^-40 for its own rounding;
// and whether each row is finite (a row that is not gets zero codes).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& h, int64_t group, int64_t groups,
                                                                    double gamma) {
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.is_contiguous(), "h: contiguous bf16 [M, H]");
  const int64_t M = h.size(0), H = h.size(1), K = group * groups;
  TORCH_CHECK(H <= K, "more columns than the packed width");
  at::Tensor codes = at::zeros({M, K}, h.options().dtype(at::kShort));
  at::Tensor alpha = at::zeros({M, groups}, h.options().dtype(at::kFloat));
  at::Tensor coefficients = at::zeros({M, 3}, h.options().dtype(at::kDouble));
  at::Tensor finite = at::empty({M}, h.options().dtype(at::kBool));
  const auto* bits = reinterpret_cast<const uint16_t*>(h.data_ptr());
  constexpr double kCodes = 32767.0, kInflate = 1 + 0x1p-40;
  for (int64_t r = 0; r < M; ++r) {
    std::vector<double> x(K, 0.0);
    bool ok = true;
    for (int64_t k = 0; k < H; ++k) {
      const uint32_t word = uint32_t(bits[r * H + k]) << 16;
      float value;
      std::memcpy(&value, &word, sizeof value);
      ok &= std::isfinite(value);
      x[k] = value;
    }
    finite.data_ptr<bool>()[r] = ok;
    if (!ok) continue;
    double h_sq = 0, d_sq = 0, h_abs = 0, d_abs = 0;
    for (int64_t g = 0; g < groups; ++g) {
      double largest = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) largest = std::fabs(x[k]) > largest ? std::fabs(x[k]) : largest;
      float a = static_cast<float>(largest / kCodes);
      if (double(a) < largest / kCodes) a = std::nextafter(a, INFINITY);  // rounded up: |x / a| <= 32767
      alpha.data_ptr<float>()[r * groups + g] = a;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const double code = a > 0 ? std::nearbyint(x[k] / double(a)) : 0.0;
        const double clamped = code > kCodes ? kCodes : (code < -kCodes ? -kCodes : code);
        codes.data_ptr<int16_t>()[r * K + k] = static_cast<int16_t>(clamped);
        const double d = x[k] - clamped * double(a);
        h_sq += x[k] * x[k];
        d_sq += d * d;
        h_abs += std::fabs(x[k]);
        d_abs += std::fabs(d);
      }
    }
    double* k3 = coefficients.data_ptr<double>() + 3 * r;
    k3[0] = (std::sqrt(h_sq) + std::sqrt(d_sq)) * kInflate;
    k3[1] = std::sqrt(d_sq) * kInflate;
    k3[2] = gamma * (h_abs + d_abs) * kInflate;
  }
  return {codes, alpha, coefficients, finite};
}

// The rows outside a sampler's candidates (upper bound below `cut`), by how far below:
// row i falls in bin b = floor((cut - hi_i) / step), the last bin taking every row further
// down, so every row of bin b has hi_i <= cut - b step (its envelope). `pick` >= 0 asks
// instead for the pick-th row (ascending) of bin `bin`. Rows far below need no exact
// bound: a float test with the largest band puts them in the last bin.
// The screen below which a row's upper bound cannot reach the last bin's top: such rows
// are in the last bin.
float far_below(const double* k, const double* maxima, double u, double tiny, double cut, double step, int64_t bins) {
  const double band_max = k[0] * maxima[0] + k[1] * maxima[1] + k[2] * maxima[2] + tiny;
  const double last_top = cut - (bins - 1) * step;
  const double reach = last_top - band_max * (1 + u);
  const double least = reach >= 0 ? reach / (1 + u) : reach / (1 - u);
  return std::nextafter(std::nextafter(static_cast<float>(least), -INFINITY), -INFINITY);
}

template <class Visit>
void tail_bins(const float* row, int64_t begin, int64_t N, const float* ep, const float* wp, const float* cp,
               const double* k, const double* maxima, double u, double tiny, double cut, double step, int64_t bins,
               Visit visit) {
  const double a = k[0], d = k[1], b = k[2];
  const float far = far_below(k, maxima, u, tiny, cut, step, bins);
  for (int64_t i = begin; i < N; ++i) {
    if (row[i] < far) {
      visit(i, bins - 1);
      continue;
    }
    const double si = row[i], band = a * ep[i] + d * wp[i] + b * cp[i] + tiny;
    const double hi = si + band + u * (std::fabs(si) + band);
    if (hi >= cut) continue;  // a candidate
    const double below = std::floor((cut - hi) / step);
    visit(i, below >= bins - 1 ? bins - 1 : static_cast<int64_t>(below));
  }
}

at::Tensor tail(const at::Tensor& s, const std::optional<at::Tensor>& summary, const at::Tensor& e,
                const at::Tensor& w, const at::Tensor& c, const at::Tensor& coefficients, const at::Tensor& maxima,
                double u, double tiny, double cut, double step, int64_t bins, int64_t bin, int64_t pick) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.is_contiguous(), "s: one row of the screen, float32");
  const int64_t N = s.numel(), spans = (N + kSpan - 1) / kSpan;
  TORCH_CHECK(!summary.has_value() || (summary->scalar_type() == at::kFloat && summary->is_contiguous() &&
                                       summary->numel() == spans),
              "summary: float32 [spans], the screen's own for this row");
  const float* span_max = summary.has_value() ? summary->data_ptr<float>() : nullptr;
  TORCH_CHECK(e.numel() == N && w.numel() == N && c.numel() == N && coefficients.numel() == 3 && maxima.numel() == 3 &&
                  coefficients.scalar_type() == at::kDouble && maxima.scalar_type() == at::kDouble,
              "the head's constants and one row's coefficients");
  TORCH_CHECK(bins >= 1 && step > 0, "bins >= 1, step > 0");
  const float* row = s.data_ptr<float>();
  const float *ep = e.data_ptr<float>(), *wp = w.data_ptr<float>(), *cp = c.data_ptr<float>();
  const double *k = coefficients.data_ptr<double>(), *m = maxima.data_ptr<double>();
  if (pick < 0) {  // counts per bin, the row split among the threads
    // A span whose summary is below `far` lies in the last bin whole.
    const float far = far_below(k, m, u, tiny, cut, step, bins);
    std::vector<std::vector<int64_t>> partial(spans, std::vector<int64_t>(bins, 0));
    at::parallel_for(0, spans, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t part = lo; part < hi; ++part) {
        auto& count = partial[part];
        const int64_t end = (part + 1) * kSpan < N ? (part + 1) * kSpan : N;
        if (span_max != nullptr && span_max[part] < far) {
          count[bins - 1] += end - part * kSpan;
          continue;
        }
        tail_bins(row, part * kSpan, end, ep, wp, cp, k, m, u, tiny, cut, step, bins,
                  [&](int64_t, int64_t b) { ++count[b]; });
      }
    });
    at::Tensor counts = at::zeros({bins}, s.options().dtype(at::kLong));
    int64_t* count = counts.data_ptr<int64_t>();
    for (const auto& part : partial)
      for (int64_t b = 0; b < bins; ++b) count[b] += part[b];
    return counts;
  }
  int64_t seen = 0, found = -1;
  tail_bins(row, 0, N, ep, wp, cp, k, m, u, tiny, cut, step, bins, [&](int64_t i, int64_t b) {
    if (b == bin && seen++ == pick && found < 0) found = i;
  });
  TORCH_CHECK(found >= 0, "bin ", bin, " has no row ", pick);
  at::Tensor index = at::empty({1}, s.options().dtype(at::kLong));
  index.data_ptr<int64_t>()[0] = found;
  return index;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("int8_screen(Tensor x, Tensor alpha, Tensor packed, Tensor scales, int n, int group) -> (Tensor, Tensor)");
  m.impl("int8_screen", c10::DispatchKey::CPU, TORCH_FN(screen));
  m.def("int8_screen_with(Tensor x, Tensor alpha, Tensor packed, Tensor scales, int n, int group, int isa) -> "
        "(Tensor, Tensor)");
  m.impl("int8_screen_with", c10::DispatchKey::CPU, TORCH_FN(screen_with));
  m.def("int8_screen_isas() -> int[]", &screen_isas);
  m.def("int8_screen_candidates(Tensor s, Tensor? summary, Tensor e, Tensor w, Tensor c, Tensor coefficients, "
        "Tensor margins, Tensor maxima, float u, float tiny, int cap) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("int8_screen_candidates", c10::DispatchKey::CPU, TORCH_FN(candidates));
  m.def("int8_screen_quantize(Tensor h, int group, int groups, float gamma) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("int8_screen_quantize", c10::DispatchKey::CPU, TORCH_FN(quantize));
  m.def("int8_screen_tail(Tensor s, Tensor? summary, Tensor e, Tensor w, Tensor c, Tensor coefficients, "
        "Tensor maxima, float u, float tiny, float cut, float step, int bins, int bin, int pick) -> Tensor");
  m.impl("int8_screen_tail", c10::DispatchKey::CPU, TORCH_FN(tail));
}
