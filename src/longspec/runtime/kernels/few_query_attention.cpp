// Attention of a few new queries per row (a decode token, a speculative tree, a batch of
// decode rows) over keys read in place from the cache, bf16 in, float32 inside:
//
//   out[b, h, t] = sum_s softmax_s(scale * q[b, h, t] . k[b, g, s]) v[b, g, s]   over visible s
//   lse[b, h, t] = log sum_s exp(scale * q[b, h, t] . k[b, g, s])                over visible s
//
// g = h / (Hq / Hkv): grouped-query heads read their K/V head once, never repeated. The
// log-sum-exp lets a caller merge this with attention over other keys; a query that sees
// no key gets out 0, lse -inf.
//
// Two entry points share one kernel:
// - `few_query_attention(q, k, v, visible)`: the keys are the slots 0..S-1 in order.
// - `ordered_attention(q, k, v, slots, positions, ...)`: the keys are listed in the order
//   of their sequence positions, whatever slots they occupy (a ring, a tree's pending
//   tokens). Every step of the arithmetic is then fixed by the positions a query sees,
//   not by the slots, the number of queries, the other rows or the threads: blocks of
//   64 positions (a key's lane in its block is its position mod 64), chunks of a fixed
//   number of positions chosen by the caller, chunks merged in position order. So a
//   token verified inside a tree gets the same bits as the same token decoded alone,
//   and speculative decoding in bf16 returns exactly plain decoding's tokens.
//
// Instruction sets: AMX where Linux grants its bf16 tiles (scores by tile products, values as
// on AVX-512 BF16), else AVX-512 BF16 (bf16 dot products), else AVX2 with FMA (queries, keys
// and values widened to float32). Only the kernels are compiled for them;
// `attention_supported()` can be asked on any CPU.
//
// Why a kernel of our own: for a few queries per head, PyTorch's CPU flash kernel spends
// several times the K/V read in setup (docs/lab-notes/native-kernels.md#decode-at-the-bandwidth-floor-native-cpu-kernels-issue-runtime-speed,
// docs/lab-notes/attention.md#few-query-attention-at-long-context-issue-runtime-speed).
// Here every query of a K/V head (its group of heads x T tokens) is served by ONE pass
// over that head's keys: each key row is loaded
// once per block of queries for the scores, each value row converted to float32 once per
// block of queries and accumulated into accumulators held in registers. Keys are split
// into chunks processed in parallel (so a single K/V head still uses every thread), each
// chunk keeps its own running max and sum per query (online softmax over blocks of
// keys), and the chunks are merged exactly at the end. A block's value rows are
// prefetched while it is scored (its value pass walks them 16 values at a time across
// rows, which met them cold: a batch's attention read K/V at half the bandwidth before).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "simd_exp.h"

namespace {

constexpr int64_t kBlock = 64;          // positions per softmax block: 64 keys of head dim 256 are 32 KB, one L1
constexpr int64_t kMinChunk = kBlock;   // positions per parallel task, at least
constexpr int64_t kTasksPerThread = 4;  // parallel tasks per thread, for load balance
constexpr int64_t kSplitQueries = 4;   // queries per task, at least, where a chunk's queries are split among tasks
constexpr float kNone = -std::numeric_limits<float>::infinity();

// Ask for a bf16 row of D values to be brought into L2 (the next pass over it is a strided walk).
inline void prefetch_row(const uint16_t* row, int64_t D) {
  for (int64_t offset = 0; offset < D; offset += 32) _mm_prefetch(reinterpret_cast<const char*>(row + offset), _MM_HINT_T1);
}

// The queries of one task: bf16 as given, and widened to float32 where the instruction set
// has no bf16 dot product (then once per task, not once per key).
struct Queries {
  const uint16_t* bf16;  // [queries, D]
  const float* f32;      // [queries, D] or nullptr
  int64_t D;
  float scale;
};

// One block's weights: query j's weight of entry i at w[j * w_stride + i].
struct BlockWeights {
  const float* w;
  int64_t w_stride, n;
  const uint8_t* any_seen;
  const uint16_t* const* value_rows;
};

using ScoreFn = void (*)(const Queries&, const uint16_t* key, int64_t q0, float* out, int64_t stride);
using ValueFn = void (*)(const BlockWeights&, int64_t D, int64_t q0, float* acc);

// ---------------------------------------------------------------- AVX-512 BF16
#define LONGSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

struct Avx512Bf16 {
  static constexpr int64_t kFloats = 16;  // float32 values per register
  static constexpr int64_t kLanes = 32;   // bf16 values per register
  static constexpr int kScoreQueries = 4;   // queries sharing one load of a key row (independent dot chains)
  static constexpr int kValueQueries = 16;  // queries sharing one conversion of a value row (accumulators in registers)
  static constexpr bool kFloatQueries = false;
  static constexpr bool kTiles = false;  // scores by AMX tiles (`Avx512Tiles`)


  LONGSPEC_AVX512_BF16 static inline __m512 widen(const uint16_t* values) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }

  // out[(q0 + j) * stride] = scale * q[q0 + j] . key for Q queries (Q independent accumulator chains).
  template <int Q>
  LONGSPEC_AVX512_BF16 static void score(const Queries& qs, const uint16_t* key, int64_t q0, float* out, int64_t stride) {
    __m512 acc[Q];
    for (int j = 0; j < Q; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < qs.D; d += kLanes) {
      const __m512bh kd = (__m512bh)_mm512_loadu_si512(key + d);
      for (int j = 0; j < Q; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], kd, (__m512bh)_mm512_loadu_si512(qs.bf16 + (q0 + j) * qs.D + d));
    }
    for (int j = 0; j < Q; ++j) out[(q0 + j) * stride] = _mm512_reduce_add_ps(acc[j]) * qs.scale;
  }

  LONGSPEC_AVX512_BF16 static float block_max(const float* row) {
    __m512 top = _mm512_set1_ps(kNone);
    for (int64_t i = 0; i < kBlock; i += kFloats) top = _mm512_max_ps(top, _mm512_loadu_ps(row + i));
    return _mm512_reduce_max_ps(top);
  }

  // row[i] = exp(row[i] - shift) over the block; returns their sum.
  LONGSPEC_AVX512_BF16 static float exp_and_sum(float* row, float shift) {
    __m512 total = _mm512_setzero_ps();
    const __m512 by = _mm512_set1_ps(shift);
    for (int64_t i = 0; i < kBlock; i += kFloats) {
      const __m512 prob = simd_exp::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + i), by));
      _mm512_storeu_ps(row + i, prob);
      total = _mm512_add_ps(total, prob);
    }
    return _mm512_reduce_add_ps(total);
  }

  // acc[j][d0 .. d0 + 16 C) += sum_i w[j][i] * v_i[d0 .. d0 + 16 C) for Q queries (local index j
  // from q0), entries in position order, each value segment converted once for all Q
  // accumulators and each weight broadcast once for all C segments.
  template <int Q, int C>
  LONGSPEC_AVX512_BF16 static void accumulate_segments(const BlockWeights& block, int64_t D, int64_t q0, int64_t d0,
                                                       float* acc) {
    __m512 sums[Q][C];
    for (int j = 0; j < Q; ++j)
      for (int c = 0; c < C; ++c) sums[j][c] = _mm512_loadu_ps(acc + (q0 + j) * D + d0 + c * kFloats);
    for (int64_t i = 0; i < block.n; ++i) {
      if (!block.any_seen[i]) continue;  // a slot no query sees may hold anything
      __m512 value[C];
      for (int c = 0; c < C; ++c) value[c] = widen(block.value_rows[i] + d0 + c * kFloats);
      for (int j = 0; j < Q; ++j) {
        const __m512 weight = _mm512_set1_ps(block.w[(q0 + j) * block.w_stride + i]);
        for (int c = 0; c < C; ++c) sums[j][c] = _mm512_fmadd_ps(weight, value[c], sums[j][c]);
      }
    }
    for (int j = 0; j < Q; ++j)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (q0 + j) * D + d0 + c * kFloats, sums[j][c]);
  }

  // Every value dimension for Q queries: as many segments at once as keep the Q x C sums, C
  // values and a weight in the 32 registers. Each output is the same chain of FMAs over the
  // entries whatever C, so the segments' grouping never changes a bit.
  template <int Q>
  LONGSPEC_AVX512_BF16 static void accumulate(const BlockWeights& block, int64_t D, int64_t q0, float* acc) {
    constexpr int C = Q <= 4 ? 4 : Q <= 8 ? 2 : 1;
    int64_t d0 = 0;
    for (; d0 + C * kFloats <= D; d0 += C * kFloats) accumulate_segments<Q, C>(block, D, q0, d0, acc);
    for (; d0 < D; d0 += kFloats) accumulate_segments<Q, 1>(block, D, q0, d0, acc);
  }

  static constexpr ScoreFn kScoreFns[kScoreQueries] = {score<1>, score<2>, score<3>, score<4>};
  static constexpr ValueFn kValueFns[kValueQueries] = {
      accumulate<1>,  accumulate<2>,  accumulate<3>,  accumulate<4>,  accumulate<5>,  accumulate<6>,
      accumulate<7>,  accumulate<8>,  accumulate<9>,  accumulate<10>, accumulate<11>, accumulate<12>,
      accumulate<13>, accumulate<14>, accumulate<15>, accumulate<16>};
};

// ---------------------------------------------------------------- AVX2 + FMA
// The same kernel for CPUs without AVX-512 BF16: queries widened to float32 once per task,
// each key and value row widened as it is read, products by float32 FMAs. Its sums run in
// another order than the AVX-512 path's, so the two paths' bits differ; on either, a query's
// bits are fixed by the positions it sees, which is what plain-decoding identity needs.
#define LONGSPEC_AVX2_FMA __attribute__((target("avx2,fma")))

struct Avx2Fma {
  static constexpr int64_t kFloats = 8;
  // 16 ymm registers: a key and 8 dot chains; a value, a weight and 12 sums. As many
  // independent chains as fit, to cover the FMA latency of two pipes.
  static constexpr int kScoreQueries = 8;
  static constexpr int kValueQueries = 12;
  static constexpr bool kFloatQueries = true;
  static constexpr bool kTiles = false;


  LONGSPEC_AVX2_FMA static inline __m256 widen(const uint16_t* values) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }

  LONGSPEC_AVX2_FMA static inline float reduce_add(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }

  LONGSPEC_AVX2_FMA static inline float reduce_max(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }

  template <int Q>
  LONGSPEC_AVX2_FMA static void score(const Queries& qs, const uint16_t* key, int64_t q0, float* out, int64_t stride) {
    __m256 acc[Q];
    for (int j = 0; j < Q; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < qs.D; d += kFloats) {
      const __m256 kd = widen(key + d);
      for (int j = 0; j < Q; ++j) acc[j] = _mm256_fmadd_ps(kd, _mm256_loadu_ps(qs.f32 + (q0 + j) * qs.D + d), acc[j]);
    }
    for (int j = 0; j < Q; ++j) out[(q0 + j) * stride] = reduce_add(acc[j]) * qs.scale;
  }

  LONGSPEC_AVX2_FMA static float block_max(const float* row) {
    __m256 top = _mm256_set1_ps(kNone);
    for (int64_t i = 0; i < kBlock; i += kFloats) top = _mm256_max_ps(top, _mm256_loadu_ps(row + i));
    return reduce_max(top);
  }

  LONGSPEC_AVX2_FMA static float exp_and_sum(float* row, float shift) {
    __m256 total = _mm256_setzero_ps();
    const __m256 by = _mm256_set1_ps(shift);
    for (int64_t i = 0; i < kBlock; i += kFloats) {
      const __m256 prob = simd_exp::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + i), by));
      _mm256_storeu_ps(row + i, prob);
      total = _mm256_add_ps(total, prob);
    }
    return reduce_add(total);
  }

  template <int Q, int C>
  LONGSPEC_AVX2_FMA static void accumulate_segments(const BlockWeights& block, int64_t D, int64_t q0, int64_t d0,
                                                    float* acc) {
    __m256 sums[Q][C];
    for (int j = 0; j < Q; ++j)
      for (int c = 0; c < C; ++c) sums[j][c] = _mm256_loadu_ps(acc + (q0 + j) * D + d0 + c * kFloats);
    for (int64_t i = 0; i < block.n; ++i) {
      if (!block.any_seen[i]) continue;
      __m256 value[C];
      for (int c = 0; c < C; ++c) value[c] = widen(block.value_rows[i] + d0 + c * kFloats);
      for (int j = 0; j < Q; ++j) {
        const __m256 weight = _mm256_set1_ps(block.w[(q0 + j) * block.w_stride + i]);
        for (int c = 0; c < C; ++c) sums[j][c] = _mm256_fmadd_ps(weight, value[c], sums[j][c]);
      }
    }
    for (int j = 0; j < Q; ++j)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + (q0 + j) * D + d0 + c * kFloats, sums[j][c]);
  }

  // As the AVX-512 path: Q x C sums, C values and a weight within the 16 registers.
  template <int Q>
  LONGSPEC_AVX2_FMA static void accumulate(const BlockWeights& block, int64_t D, int64_t q0, float* acc) {
    constexpr int C = Q <= 2 ? 4 : Q == 3 ? 3 : Q <= 6 ? 2 : 1;
    int64_t d0 = 0;
    for (; d0 + C * kFloats <= D; d0 += C * kFloats) accumulate_segments<Q, C>(block, D, q0, d0, acc);
    for (; d0 < D; d0 += kFloats) accumulate_segments<Q, 1>(block, D, q0, d0, acc);
  }

  static constexpr ScoreFn kScoreFns[kScoreQueries] = {score<1>, score<2>, score<3>, score<4>,
                                                       score<5>, score<6>, score<7>, score<8>};
  static constexpr ValueFn kValueFns[kValueQueries] = {accumulate<1>, accumulate<2>,  accumulate<3>,  accumulate<4>,
                                                       accumulate<5>, accumulate<6>,  accumulate<7>,  accumulate<8>,
                                                       accumulate<9>, accumulate<10>, accumulate<11>, accumulate<12>};
};

// One row's keys in position order: entry e is slot `slot(e)` at position `position(e)`.
struct RowKeys {
  const int64_t* slots;      // nullptr: entry e is slot e
  const int64_t* positions;  // nullptr: entry e is at position e
  int64_t count;             // entries
  int64_t shared;            // entries [0, shared) are seen by every query (no mask read)
  const bool* visible;       // [T, columns], column = entry - shared; nullptr: every entry seen
  int64_t columns;
  int64_t slot(int64_t e) const { return slots ? slots[e] : e; }
  int64_t position(int64_t e) const { return positions ? positions[e] : e; }
  bool seen(int64_t t, int64_t e) const { return e < shared || visible == nullptr || visible[t * columns + e - shared]; }
};

// Queries [q_begin, q_end) of one K/V head (its `group` heads x T tokens, query = h * T + t) over its keys.
struct HeadTask {
  const uint16_t* q;  // [queries, D] for this K/V head
  const uint16_t* k;  // slot s at k + s * k_stride
  const uint16_t* v;
  int64_t k_stride, v_stride;
  RowKeys keys;
  int64_t T, D, q_begin, q_end;
  float scale;
  const uint16_t* query_tiles;  // AMX: the task's queries as B tiles (`query_tiles`), else nullptr
};

// Per-thread scratch for one block of positions.
struct Workspace {
  std::vector<float> scores;      // [queries, kBlock]: scaled scores by lane (position mod kBlock), then probabilities
  std::vector<float> weights;     // [queries, entries of the block]: each entry's probability for each query, 0 if unseen
  std::vector<float> dots;        // [queries]: one entry's scores
  std::vector<float> queries;     // [queries, D]: the task's queries in float32 (instruction sets without bf16 dots)
  std::vector<uint8_t> any_seen;  // [entries of the block]: some query sees the entry (others are never read)
  std::vector<const uint16_t*> value_rows;  // [entries of the block]
  std::vector<uint16_t> key_rows;           // AMX: 16 key rows gathered where their slots are not evenly spaced
};

// ---------------------------------------------------------------- AMX tiles (scores)
// CPUs with AMX score a block's keys by bf16 tile products: 16 keys (the A tile, read in
// place from the cache) against up to 16 queries (the B tile) per product, 32 dimensions
// a step, float32 sums. Values are then accumulated as on AVX-512 BF16 (the same
// registers' float32 FMAs). A score's sum runs in the tile unit's order over its own
// query and key alone, so a query's bits are fixed by the keys it sees here too; they
// are not the vector path's, so a process takes one path for every call, chosen once
// (`LONGSPEC_AMX=0` keeps the vector path), as the products do.
struct Avx512Tiles : Avx512Bf16 {
  static constexpr bool kTiles = true;
};

#if LONGSPEC_HAS_AMX
#define LONGSPEC_AMX_ATTENTION __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

LONGSPEC_AMX_ATTENTION void tiles_begin() {
  TileConfig config;
  for (int t = 0; t < 3; ++t) {  // 0: sums [16 keys, 16 queries]; 1: keys [16, 32 dims]; 2: queries [16 pairs, 16 x 2]
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  load_tile_config(config);
}

LONGSPEC_AMX_ATTENTION void tiles_end() { _tile_release(); }

// The scores of a block's n entries (from entry e0) for the task's queries, into `scores`
// by lane as the vector path writes them: a query's score of an entry it sees, -inf else.
LONGSPEC_AMX_ATTENTION void tile_scores(const HeadTask& task, int64_t e0, int64_t n, int64_t base, bool uniform,
                                        bool consecutive, int64_t queries, Workspace& ws) {
  const RowKeys& keys = task.keys;
  const int64_t D = task.D, steps = D / 32;
  alignas(64) float sums[16 * 16];
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const __m512 scale = _mm512_set1_ps(task.scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = n - i0 < 16 ? n - i0 : 16;
    const int64_t first = keys.slot(e0 + i0);
    bool in_place = m == 16;
    for (int64_t j = 1; in_place && j < 16; ++j) in_place = keys.slot(e0 + i0 + j) == first + j;
    const uint16_t* rows = task.k + first * task.k_stride;
    int64_t stride = task.k_stride * 2;
    if (!in_place) {  // a ring's wrap, a tree's pending tokens, a block's last few keys
      ws.key_rows.assign(16 * D, 0);
      for (int64_t j = 0; j < m; ++j)
        std::copy_n(task.k + keys.slot(e0 + i0 + j) * task.k_stride, D, ws.key_rows.data() + j * D);
      rows = ws.key_rows.data();
      stride = D * 2;
    }
    for (int64_t g = 0; g < queries; g += 16) {
      _tile_zero(0);
      for (int64_t step = 0; step < steps; ++step) {
        _tile_loadd(1, rows + step * 32, stride);
        _tile_loadd(2, task.query_tiles + ((g / 16) * steps + step) * 16 * 32, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sums, 64);
      const int64_t in_group = queries - g < 16 ? queries - g : 16;
      if (consecutive && m == 16) {  // 16 lanes in a row that every query sees: a query's scores are a column
        const int64_t lane = keys.position(e0 + i0) - base;
        for (int64_t k = 0; k < in_group; ++k)
          _mm512_storeu_ps(ws.scores.data() + (g + k) * kBlock + lane,
                           _mm512_mul_ps(_mm512_i32gather_ps(column, sums + k, 4), scale));
        continue;
      }
      for (int64_t j = 0; j < m; ++j) {
        if (!ws.any_seen[i0 + j]) continue;
        const int64_t e = e0 + i0 + j, lane = keys.position(e) - base;
        for (int64_t k = 0; k < in_group; ++k)
          if (uniform || keys.seen((task.q_begin + g + k) % task.T, e))
            ws.scores[(g + k) * kBlock + lane] = sums[j * 16 + k] * task.scale;
      }
    }
  }
}
#else
void tiles_begin() {}
void tiles_end() {}
void tile_scores(const HeadTask&, int64_t, int64_t, int64_t, bool, bool, int64_t, Workspace&) {
  TORCH_CHECK(false, "this build has no AMX path");
}
#endif

struct Partial {  // one chunk's softmax state for one query: acc holds sum_s exp(score_s - max) v_s
  float max;
  float sum;
};

// Entries [e_begin, e_end) (one chunk of positions) for the task's queries: writes `partial[queries]`
// and `acc[queries, D]`, indexed from the task's first query.
template <class Isa>
void attend_chunk(const HeadTask& task, int64_t e_begin, int64_t e_end, Workspace& ws, Partial* partial, float* acc) {
  const RowKeys& keys = task.keys;
  const int64_t queries = task.q_end - task.q_begin, D = task.D;
  Queries qs{task.q + task.q_begin * D, nullptr, D, task.scale};
  if (Isa::kFloatQueries) {
    ws.queries.resize(queries * D);
    for (int64_t i = 0; i < queries * D; ++i) ws.queries[i] = c10::BFloat16(qs.bf16[i], c10::BFloat16::from_bits());
    qs.f32 = ws.queries.data();
  }
  for (int64_t q = 0; q < queries; ++q) partial[q] = {kNone, 0.0f};
  std::fill(acc, acc + queries * D, 0.0f);
  ws.scores.resize(queries * kBlock);
  ws.dots.resize(queries);
  // Tokens repeat every T queries: the first T of the task cover all of its tokens.
  const int64_t last_token_query = std::min(task.q_end, task.q_begin + task.T);
  for (int64_t e0 = e_begin; e0 < e_end;) {
    // The block: entries whose positions share one multiple of kBlock.
    const int64_t block = keys.position(e0) / kBlock, base = block * kBlock;
    int64_t e1 = e0 + 1;
    while (e1 < e_end && keys.position(e1) / kBlock == block) ++e1;
    const int64_t n = e1 - e0;
    ws.any_seen.resize(n);
    ws.value_rows.resize(n);
    // Uniform: every query sees every entry (the shared prefix; or, from the mask, a block
    // inside every query's window: a sliding layer's ring); then one entry per position,
    // lanes consecutive when the positions are (a committed prefix). The same scores and
    // weights either way: a uniform block only skips the mask.
    bool uniform = e1 <= keys.shared || keys.visible == nullptr;
    // Which entries some query of the task sees; an entry no query sees is never read.
    bool any_key = uniform, every_key = true;
    for (int64_t i = 0; i < n; ++i) {
      bool seen = uniform, by_all = true;
      for (int64_t q = task.q_begin; q < last_token_query && !uniform; ++q) {
        const bool sees = keys.seen(q % task.T, e0 + i);
        seen |= sees;
        by_all &= sees;
      }
      ws.any_seen[i] = seen;
      ws.value_rows[i] = task.v + keys.slot(e0 + i) * task.v_stride;
      any_key |= seen;
      every_key &= by_all;
    }
    uniform |= every_key;
    const bool consecutive = uniform && keys.position(e1 - 1) - keys.position(e0) == n - 1;
    if (!any_key) {
      e0 = e1;
      continue;
    }
    // Scores by lane: a query sees at most one entry per position, so lanes never collide.
    std::fill(ws.scores.begin(), ws.scores.end(), kNone);
    if constexpr (Isa::kTiles) {
      for (int64_t i = 0; i < n; ++i)
        if (ws.any_seen[i]) prefetch_row(ws.value_rows[i], D);
      tile_scores(task, e0, n, base, uniform, consecutive, queries, ws);
    }
    for (int64_t i = 0; i < n && !Isa::kTiles; ++i) {
      if (!ws.any_seen[i]) continue;
      // The value rows are read next, across all rows per few values: fetch them while scoring.
      prefetch_row(ws.value_rows[i], D);
      const uint16_t* key = task.k + keys.slot(e0 + i) * task.k_stride;
      const int64_t lane = keys.position(e0 + i) - base;
      for (int64_t q0 = 0; q0 < queries; q0 += Isa::kScoreQueries) {
        const ScoreFn score = Isa::kScoreFns[std::min<int64_t>(Isa::kScoreQueries, queries - q0) - 1];
        if (uniform) score(qs, key, q0, ws.scores.data() + lane, kBlock);
        else score(qs, key, q0, ws.dots.data(), 1);
      }
      if (!uniform)
        for (int64_t q = 0; q < queries; ++q)
          if (keys.seen((task.q_begin + q) % task.T, e0 + i)) ws.scores[q * kBlock + lane] = ws.dots[q];
    }
    // Online softmax: per query, the block's probabilities relative to the running max.
    for (int64_t q = 0; q < queries; ++q) {
      float* row = ws.scores.data() + q * kBlock;
      const float block_max = Isa::block_max(row);
      Partial& p = partial[q];
      const float best = std::max(p.max, block_max);
      if (best == kNone) {  // nothing visible yet: the row stays -inf, its probabilities 0
        std::fill(row, row + kBlock, 0.0f);
        continue;
      }
      if (p.max != best && p.max != kNone) {
        const float shrink = std::exp(p.max - best);
        p.sum *= shrink;
        float* out = acc + q * D;
        for (int64_t d = 0; d < D; ++d) out[d] *= shrink;
      }
      p.max = best;
      p.sum += Isa::exp_and_sum(row, best);
    }
    // Each entry's weight for each query: its lane's probability if the query sees it, else 0.
    BlockWeights weights{nullptr, 0, n, ws.any_seen.data(), ws.value_rows.data()};
    if (consecutive) {  // entry i is lane (first lane + i) of every query: read the probabilities in place
      weights.w = ws.scores.data() + (keys.position(e0) - base);
      weights.w_stride = kBlock;
    } else {
      ws.weights.resize(queries * n);
      for (int64_t q = 0; q < queries; ++q)
        for (int64_t i = 0; i < n; ++i) {
          const bool seen = ws.any_seen[i] && keys.seen((task.q_begin + q) % task.T, e0 + i);
          ws.weights[q * n + i] = seen ? ws.scores[q * kBlock + keys.position(e0 + i) - base] : 0.0f;
        }
      weights.w = ws.weights.data();
      weights.w_stride = n;
    }
    for (int64_t e = e1; e < std::min(e1 + kBlock, e_end); ++e)  // the next block's keys
      prefetch_row(task.k + keys.slot(e) * task.k_stride, D);
    for (int64_t q0 = 0; q0 < queries; q0 += Isa::kValueQueries)
      Isa::kValueFns[std::min<int64_t>(Isa::kValueQueries, queries - q0) - 1](weights, D, q0, acc);
    e0 = e1;
  }
}

// Positions per parallel task for `few_query_attention` (keys = slots): enough tasks for every
// thread, never fewer than a block.
int64_t chunk_keys(int64_t S, int64_t heads) {
  const int64_t tasks_wanted = kTasksPerThread * at::get_num_threads();
  const int64_t chunks_per_head = std::max<int64_t>(1, (tasks_wanted + heads - 1) / heads);
  const int64_t keys = (S + chunks_per_head - 1) / chunks_per_head;
  return std::max(kMinChunk, (keys + kBlock - 1) / kBlock * kBlock);
}

struct Chunk {
  int64_t row, first_entry, end_entry, index;  // index: the chunk's place among its row's chunks
};

using ChunkFn = void (*)(const HeadTask&, int64_t, int64_t, Workspace&, Partial*, float*);

// The queries [queries, D] (bf16) from `q` as AMX B tiles: per group of 16 queries and step of
// 32 dimensions, row p holds each query's dimensions (2p, 2p + 1) of the step; zero past the
// last query.
void query_tiles(const uint16_t* q, int64_t queries, int64_t D, uint16_t* out) {
  const int64_t groups = (queries + 15) / 16, steps = D / 32;
  std::fill(out, out + groups * steps * 16 * 32, uint16_t(0));
  for (int64_t query = 0; query < queries; ++query)
    for (int64_t d = 0; d < D; ++d)
      out[(((query / 16) * steps + d / 32) * 16 + (d % 32) / 2) * 32 + 2 * (query % 16) + d % 2] = q[query * D + d];
}

// Which kernel a call takes: this CPU's best, or (tests: CPUs that never take them
// otherwise) the AVX-512 BF16 vector path or the AVX2 one.
enum Path : int64_t { kBest = 0, kAvx512 = 1, kAvx2 = 2 };

bool tiles_supported() {
  static const bool tiles = LONGSPEC_HAS_AMX && avx512_bf16_supported() && amx_bf16_supported();
  return tiles;
}

struct Kernel {
  ChunkFn chunk;
  bool tiles;  // AMX: each thread configures the tiles once, and the queries come as B tiles
};

Kernel chunk_kernel(int64_t path) {
  static const bool avx512 = avx512_bf16_supported();
  if (path == kBest && tiles_supported()) return {attend_chunk<Avx512Tiles>, true};
  if (avx512 && path != kAvx2) return {attend_chunk<Avx512Bf16>, false};
  TORCH_CHECK(path != kAvx512, "this CPU has no AVX-512 BF16");
  TORCH_CHECK(avx2_fma_supported(), "the native attention kernels need AVX-512 BF16 or AVX2 with FMA");
  return {attend_chunk<Avx2Fma>, false};
}

std::string attention_path() { return tiles_supported() ? "amx" : avx512_bf16_supported() ? "avx512" : "avx2"; }

// Attention of q [B, Hq, T, D] over each row's listed keys, chunks of `chunk` positions.
std::tuple<at::Tensor, at::Tensor> attend(Kernel kernel, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const std::vector<RowKeys>& rows, int64_t chunk,
                                          double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t group = Hq / Hkv, queries = group * T;
  // Each row's chunks: fixed ranges of positions, in position order, found by walking its sorted entries.
  std::vector<Chunk> chunks;
  std::vector<int64_t> row_chunks(B, 0), row_first(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    const RowKeys& keys = rows[b];
    row_first[b] = static_cast<int64_t>(chunks.size());
    for (int64_t e = 0; e < keys.count;) {
      const int64_t id = keys.position(e) / chunk;
      int64_t end = e + 1;
      while (end < keys.count && keys.position(end) / chunk == id) ++end;
      chunks.push_back({b, e, end, row_chunks[b]++});
      e = end;
    }
  }
  // Query blocks split a chunk's queries among more tasks where the chunks alone are too few
  // (a query's arithmetic does not depend on which others share its task).
  const int64_t tasks_wanted = kTasksPerThread * at::get_num_threads();
  const int64_t chunk_tasks = std::max<int64_t>(1, static_cast<int64_t>(chunks.size()) * Hkv);
  const int64_t splits = std::clamp<int64_t>((tasks_wanted + chunk_tasks - 1) / chunk_tasks, 1,
                                             (queries + kSplitQueries - 1) / kSplitQueries);
  const int64_t per_split = (queries + splits - 1) / splits;
  const int64_t tasks = static_cast<int64_t>(chunks.size()) * Hkv * splits;
  // Every task writes all of its partials and accumulators: no zero-filling needed.
  std::unique_ptr<Partial[]> partials(new Partial[chunks.size() * Hkv * queries]);
  std::unique_ptr<float[]> accs(new float[chunks.size() * Hkv * queries * D]);
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  // AMX: each (row, K/V head, split)'s queries as B tiles, made once for all of its chunks.
  const int64_t tile_size = ((per_split + 15) / 16) * (D / 32) * 16 * 32;
  std::vector<uint16_t> tiles(kernel.tiles ? B * Hkv * splits * tile_size : 0);
  if (kernel.tiles)
    at::parallel_for(0, B * Hkv * splits, 1, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const int64_t split = index % splits, g = (index / splits) % Hkv, b = index / (splits * Hkv);
        const int64_t q_begin = split * per_split, q_end = std::min(queries, q_begin + per_split);
        if (q_begin < q_end)
          query_tiles(qs + ((b * Hq + g * group) * T + q_begin) * D, q_end - q_begin, D,
                      tiles.data() + index * tile_size);
      }
    });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    if (kernel.tiles) tiles_begin();  // the tile configuration is a thread's state
    for (int64_t index = begin; index < end; ++index) {
      const int64_t split = index % splits, g = (index / splits) % Hkv, c = index / (splits * Hkv);
      const Chunk& piece = chunks[c];
      const int64_t b = piece.row, q_begin = split * per_split, q_end = std::min(queries, q_begin + per_split);
      if (q_begin >= q_end) continue;
      // The group's heads are consecutive in q, so its queries are one [queries, D] block.
      const HeadTask task{qs + (b * Hq + g * group) * T * D,
                          ks + b * k.stride(0) + g * k.stride(1),
                          vs + b * v.stride(0) + g * v.stride(1),
                          k.stride(2), v.stride(2), rows[b], T, D, q_begin, q_end, static_cast<float>(scale),
                          kernel.tiles ? tiles.data() + ((b * Hkv + g) * splits + split) * tile_size : nullptr};
      const int64_t slot = (c * Hkv + g) * queries + q_begin;
      kernel.chunk(task, piece.first_entry, piece.end_entry, ws, partials.get() + slot, accs.get() + slot * D);
    }
    if (kernel.tiles) tiles_end();
  });
  at::Tensor out = at::empty({B, Hq, T, D}, q.options());
  at::Tensor lse = at::empty({B, Hq, T}, q.options().dtype(at::kFloat));
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* ls = lse.data_ptr<float>();
  // Merge each query's chunks in position order: out and lse rows are laid out [B, Hkv, group, T].
  at::parallel_for(0, B * Hkv * queries, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t query = row % queries, g = (row / queries) % Hkv, b = row / (queries * Hkv);
      const int64_t first = row_first[b], count = row_chunks[b];
      auto at = [&](int64_t c) { return ((first + c) * Hkv + g) * queries + query; };
      float best = kNone;
      for (int64_t c = 0; c < count; ++c) best = std::max(best, partials[at(c)].max);
      uint16_t* o = os + row * D;
      if (best == kNone) {  // no visible key: an empty sum
        for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(0.0f).x;
        ls[row] = kNone;
        continue;
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < count; ++c) {
        const Partial& p = partials[at(c)];
        if (p.max == kNone) continue;
        const float weight = std::exp(p.max - best);
        total += p.sum * weight;
        const float* acc = accs.get() + at(c) * D;
        for (int64_t d = 0; d < D; ++d) merged[d] += acc[d] * weight;
      }
      for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(merged[d] / total).x;
      ls[row] = best + std::log(total);
    }
  });
  return {out, lse};
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q [B, Hq, T, D], contiguous");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v [B, Hkv, S, D]");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0 && q.size(2) > 0,
              "shapes of q and k/v disagree");
  TORCH_CHECK(q.size(3) % Avx512Bf16::kLanes == 0, "head dim a multiple of 32");
}

// visible [1 or B, T, columns] bool, contiguous: a pointer per row (nullptr where absent).
std::vector<const bool*> mask_rows(const std::optional<at::Tensor>& visible, int64_t B, int64_t T, int64_t& columns) {
  std::vector<const bool*> rows(B, nullptr);
  columns = 0;
  if (!visible.has_value()) return rows;
  TORCH_CHECK(visible->scalar_type() == at::kBool && visible->is_contiguous() && visible->dim() == 3 &&
                  visible->size(1) == T && (visible->size(0) == 1 || visible->size(0) == B),
              "visible [1 or B, T, columns] bool, contiguous");
  columns = visible->size(2);
  for (int64_t b = 0; b < B; ++b) rows[b] = visible->data_ptr<bool>() + (visible->size(0) == 1 ? 0 : b) * T * columns;
  return rows;
}

std::tuple<at::Tensor, at::Tensor> few_query_attention_on(int64_t path, const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const std::optional<at::Tensor>& visible,
                                                          double scale) {
  check_qkv(q, k, v);
  const int64_t B = q.size(0), T = q.size(2), S = k.size(2);
  TORCH_CHECK(S > 0, "attention over zero keys");
  int64_t columns = 0;
  const std::vector<const bool*> masks = mask_rows(visible, B, T, columns);
  TORCH_CHECK(!visible.has_value() || columns == S, "visible [1 or B, T, S]");
  std::vector<RowKeys> rows;
  for (int64_t b = 0; b < B; ++b) rows.push_back({nullptr, nullptr, S, 0, masks[b], columns});
  return attend(chunk_kernel(path), q, k, v, rows, chunk_keys(S, B * k.size(1)), scale);
}

std::tuple<at::Tensor, at::Tensor> ordered_attention_on(int64_t path, const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& slots,
                                                        const at::Tensor& positions, const at::Tensor& counts,
                                                        const at::Tensor& shared,
                                                        const std::optional<at::Tensor>& visible, int64_t chunk,
                                                        double scale) {
  check_qkv(q, k, v);
  const int64_t B = q.size(0), T = q.size(2), S = k.size(2);
  TORCH_CHECK(chunk > 0 && chunk % kBlock == 0, "chunk: a positive multiple of 64 positions");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.dim() == 2 &&
                  slots.sizes() == positions.sizes() && slots.size(0) == B && slots.is_contiguous() &&
                  positions.is_contiguous(),
              "slots and positions [B, N] int64, contiguous");
  TORCH_CHECK(counts.scalar_type() == at::kLong && shared.scalar_type() == at::kLong && counts.numel() == B &&
                  shared.numel() == B && counts.is_contiguous() && shared.is_contiguous(),
              "counts and shared [B] int64");
  int64_t columns = 0;
  const std::vector<const bool*> masks = mask_rows(visible, B, T, columns);
  const int64_t N = slots.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  std::vector<RowKeys> rows;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t count = counts.data_ptr<int64_t>()[b], common = shared.data_ptr<int64_t>()[b];
    TORCH_CHECK(0 <= common && common <= count && count <= N, "row ", b, ": need 0 <= shared <= count <= N");
    TORCH_CHECK(masks[b] != nullptr || common == count || !visible.has_value(), "row ", b, ": no mask");
    TORCH_CHECK(masks[b] == nullptr || count - common <= columns, "row ", b, ": visible has too few columns");
    for (int64_t e = 0; e < count; ++e) {
      TORCH_CHECK(0 <= slot[b * N + e] && slot[b * N + e] < S, "row ", b, ": slot out of range");
      TORCH_CHECK(position[b * N + e] >= 0 && (e == 0 || position[b * N + e] >= position[b * N + e - 1]),
                  "row ", b, ": positions must be non-negative and sorted");
    }
    rows.push_back({slot + b * N, position + b * N, count, common, masks[b], columns});
  }
  return attend(chunk_kernel(path), q, k, v, rows, chunk, scale);
}

// The kernels on the best path of this CPU, and (tests) on a named vector path.
template <int64_t kPath>
std::tuple<at::Tensor, at::Tensor> few_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<at::Tensor>& visible, double scale) {
  return few_query_attention_on(kPath, q, k, v, visible, scale);
}

template <int64_t kPath>
std::tuple<at::Tensor, at::Tensor> ordered_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& slots, const at::Tensor& positions,
                                                     const at::Tensor& counts, const at::Tensor& shared,
                                                     const std::optional<at::Tensor>& visible, int64_t chunk,
                                                     double scale) {
  return ordered_attention_on(kPath, q, k, v, slots, positions, counts, shared, visible, chunk, scale);
}

bool attention_supported() { return avx512_bf16_supported() || avx2_fma_supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("attention_supported() -> bool", &attention_supported);
#define LONGSPEC_FEW_QUERY_SCHEMA "(Tensor q, Tensor k, Tensor v, Tensor? visible, float scale) -> (Tensor, Tensor)"
#define LONGSPEC_ORDERED_SCHEMA                                                                       \
  "(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor positions, Tensor counts, Tensor shared, " \
  "Tensor? visible, int chunk, float scale) -> (Tensor, Tensor)"
  m.def("attention_path() -> str", &attention_path);
  m.def("few_query_attention" LONGSPEC_FEW_QUERY_SCHEMA);
  m.def("ordered_attention" LONGSPEC_ORDERED_SCHEMA);
  m.def("few_query_attention_avx512" LONGSPEC_FEW_QUERY_SCHEMA);
  m.def("ordered_attention_avx512" LONGSPEC_ORDERED_SCHEMA);
  m.def("few_query_attention_avx2" LONGSPEC_FEW_QUERY_SCHEMA);
  m.def("ordered_attention_avx2" LONGSPEC_ORDERED_SCHEMA);
  m.impl("few_query_attention", c10::DispatchKey::CPU, TORCH_FN(few_query_attention<kBest>));
  m.impl("ordered_attention", c10::DispatchKey::CPU, TORCH_FN(ordered_attention<kBest>));
  m.impl("few_query_attention_avx512", c10::DispatchKey::CPU, TORCH_FN(few_query_attention<kAvx512>));
  m.impl("ordered_attention_avx512", c10::DispatchKey::CPU, TORCH_FN(ordered_attention<kAvx512>));
  m.impl("few_query_attention_avx2", c10::DispatchKey::CPU, TORCH_FN(few_query_attention<kAvx2>));
  m.impl("ordered_attention_avx2", c10::DispatchKey::CPU, TORCH_FN(ordered_attention<kAvx2>));
}
