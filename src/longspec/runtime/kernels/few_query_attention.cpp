// Attention of a few new queries per row (a decode token, a speculative tree, a batch of
// decode rows) over keys read in place from the cache, bf16 in, float32 inside:
//
//   out[b, h, t] = sum_s softmax_s(scale * q[b, h, t] . k[b, g, s]) v[b, g, s]   over visible s
//   lse[b, h, t] = log sum_s exp(scale * q[b, h, t] . k[b, g, s])                over visible s
//
// g = h / (Hq / Hkv): grouped-query heads read their K/V head once, never repeated. The
// log-sum-exp lets a caller merge this with attention over other keys (the prefix and
// tree parts of Hybrid Tree Attention); a query that sees no key gets out 0, lse -inf.
//
// Why: for a few queries per head, PyTorch's CPU flash kernel spends several times the
// K/V read in setup (BENCHMARKS.md, "Decode at the bandwidth floor", "Few-query attention
// at long context"). Here every query of a K/V head (its group of heads x T tokens) is
// served by ONE pass over that head's keys: each key row is loaded once per block of
// queries for the scores, each value row converted to float32 once per block of queries
// and accumulated into accumulators held in registers. Keys are split into chunks processed
// in parallel (so a single K/V head still uses every thread), each chunk keeps its own
// running max and sum per query (online softmax over blocks of keys), and the chunks are
// merged exactly at the end. A block's value rows are prefetched while it is scored (its
// value pass walks them 16 values at a time across rows, which met them cold: a batch's
// attention read K/V at half the bandwidth before; BENCHMARKS.md).

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
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kLanes = 32;          // bf16 values per 512-bit register
constexpr int64_t kFloats = 16;         // float32 values per 512-bit register
constexpr int64_t kBlock = 64;          // keys per softmax block: 64 keys of head dim 256 are 32 KB, one L1
constexpr int64_t kMinChunk = kBlock;   // keys per parallel task, at least
constexpr int64_t kTasksPerThread = 4;  // parallel tasks per thread, for load balance
constexpr int kScoreQueries = 4;        // queries sharing one load of a key row (independent dot chains)
constexpr int kValueQueries = 16;       // queries sharing one conversion of a value row (accumulators in registers)
constexpr float kNone = -std::numeric_limits<float>::infinity();

#define LONGSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// exp(x) for x <= 0 (Cephes' single-precision polynomial, within ~2 float ulps; far below one bf16 ulp);
// -inf gives exactly 0.
LONGSPEC_AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kNone), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below, exp rounds to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}

// Ask for a bf16 row of D values to be brought into L2 (the next pass over it is a strided walk).
inline void prefetch_row(const uint16_t* row, int64_t D) {
  for (int64_t offset = 0; offset < D; offset += 32) _mm_prefetch(reinterpret_cast<const char*>(row + offset), _MM_HINT_T1);
}

LONGSPEC_AVX512_BF16 inline __m512 bf16_to_float(const uint16_t* values) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The queries of one K/V head (its `group` heads x T tokens, query = h * T + t) over its keys.
struct HeadTask {
  const uint16_t* q;    // [queries, D] for this K/V head
  const uint16_t* k;    // key s at k + s * k_stride
  const uint16_t* v;
  int64_t k_stride, v_stride;
  const bool* visible;  // [T, S] for this row, or nullptr (all visible)
  int64_t T, S, D, queries;
  float scale;
};

// Per-thread scratch for one block of keys.
struct Workspace {
  std::vector<float> scores;     // [queries, kBlock]: scaled scores, then probabilities
  std::vector<uint8_t> any_seen; // [kBlock]: some query sees the key (others are never read)
  explicit Workspace(int64_t queries) : scores(queries * kBlock), any_seen(kBlock) {}
};

// scores[q0 + j][i] = scale * q[q0 + j] . k_i for Q queries (Q independent accumulator chains).
template <int Q>
LONGSPEC_AVX512_BF16 void score_queries(const HeadTask& task, const uint16_t* key, int64_t q0, int64_t i, float* scores) {
  __m512 acc[Q];
  for (int j = 0; j < Q; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < task.D; d += kLanes) {
    const __m512bh kd = (__m512bh)_mm512_loadu_si512(key + d);
    for (int j = 0; j < Q; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], kd, (__m512bh)_mm512_loadu_si512(task.q + (q0 + j) * task.D + d));
  }
  for (int j = 0; j < Q; ++j) scores[(q0 + j) * kBlock + i] = _mm512_reduce_add_ps(acc[j]) * task.scale;
}

using ScoreFn = void (*)(const HeadTask&, const uint16_t*, int64_t, int64_t, float*);
constexpr ScoreFn kScoreFns[kScoreQueries] = {score_queries<1>, score_queries<2>, score_queries<3>, score_queries<4>};

// acc[q0 + j][d0 .. d0 + 16) += sum_i p[q0 + j][i] * v_i[d0 .. d0 + 16) for Q queries, each value
// segment converted once and used by all Q accumulators.
template <int Q>
LONGSPEC_AVX512_BF16 void accumulate_values(const HeadTask& task, int64_t s0, int64_t n, const Workspace& ws,
                                            int64_t q0, int64_t d0, float* acc) {
  __m512 sums[Q];
  for (int j = 0; j < Q; ++j) sums[j] = _mm512_loadu_ps(acc + (q0 + j) * task.D + d0);
  for (int64_t i = 0; i < n; ++i) {
    if (!ws.any_seen[i]) continue;  // a slot no query sees may hold anything
    const __m512 value = bf16_to_float(task.v + (s0 + i) * task.v_stride + d0);
    for (int j = 0; j < Q; ++j)
      sums[j] = _mm512_fmadd_ps(_mm512_set1_ps(ws.scores[(q0 + j) * kBlock + i]), value, sums[j]);
  }
  for (int j = 0; j < Q; ++j) _mm512_storeu_ps(acc + (q0 + j) * task.D + d0, sums[j]);
}

using ValueFn = void (*)(const HeadTask&, int64_t, int64_t, const Workspace&, int64_t, int64_t, float*);
constexpr ValueFn kValueFns[kValueQueries] = {
    accumulate_values<1>,  accumulate_values<2>,  accumulate_values<3>,  accumulate_values<4>,
    accumulate_values<5>,  accumulate_values<6>,  accumulate_values<7>,  accumulate_values<8>,
    accumulate_values<9>,  accumulate_values<10>, accumulate_values<11>, accumulate_values<12>,
    accumulate_values<13>, accumulate_values<14>, accumulate_values<15>, accumulate_values<16>};

struct Partial {  // one chunk's softmax state for one query: acc holds sum_s exp(score_s - max) v_s
  float max;
  float sum;
};

// Keys [s_begin, s_end) for every query of the head: writes `partial[queries]` and `acc[queries, D]`.
LONGSPEC_AVX512_BF16 void attend_chunk(const HeadTask& task, int64_t s_begin, int64_t s_end, Workspace& ws,
                                       Partial* partial, float* acc) {
  const int64_t queries = task.queries, D = task.D;
  for (int64_t q = 0; q < queries; ++q) partial[q] = {kNone, 0.0f};
  std::fill(acc, acc + queries * D, 0.0f);
  for (int64_t s0 = s_begin; s0 < s_end; s0 += kBlock) {
    const int64_t n = std::min(kBlock, s_end - s0);
    // Which keys each token sees; a key no token sees is never read.
    bool any_key = false;
    for (int64_t i = 0; i < n; ++i) {
      bool seen = task.visible == nullptr;
      for (int64_t t = 0; t < task.T && !seen; ++t) seen = task.visible[t * task.S + s0 + i];
      ws.any_seen[i] = seen;
      any_key |= seen;
    }
    if (!any_key) continue;
    std::fill(ws.scores.begin(), ws.scores.end(), kNone);
    for (int64_t i = 0; i < n; ++i) {
      if (!ws.any_seen[i]) continue;
      // The value rows are read next, across all rows per 16 values: fetch them while scoring.
      prefetch_row(task.v + (s0 + i) * task.v_stride, D);
      const uint16_t* key = task.k + (s0 + i) * task.k_stride;
      for (int64_t q0 = 0; q0 < queries; q0 += kScoreQueries)
        kScoreFns[std::min<int64_t>(kScoreQueries, queries - q0) - 1](task, key, q0, i, ws.scores.data());
    }
    // Online softmax: per query, the block's probabilities relative to the running max.
    for (int64_t q = 0; q < queries; ++q) {
      float* row = ws.scores.data() + q * kBlock;
      if (task.visible != nullptr) {
        const bool* seen = task.visible + (q % task.T) * task.S + s0;
        for (int64_t i = 0; i < n; ++i)
          if (!seen[i]) row[i] = kNone;
      }
      __m512 top = _mm512_set1_ps(kNone);
      for (int64_t i = 0; i < kBlock; i += kFloats) top = _mm512_max_ps(top, _mm512_loadu_ps(row + i));
      const float block_max = _mm512_reduce_max_ps(top);
      Partial& p = partial[q];
      const float best = std::max(p.max, block_max);
      if (best == kNone) continue;  // nothing visible yet: the row stays -inf, its probabilities 0
      if (p.max != best && p.max != kNone) {
        const float shrink = std::exp(p.max - best);
        p.sum *= shrink;
        float* out = acc + q * D;
        for (int64_t d = 0; d < D; ++d) out[d] *= shrink;
      }
      p.max = best;
      __m512 total = _mm512_setzero_ps();
      const __m512 shift = _mm512_set1_ps(best);
      for (int64_t i = 0; i < kBlock; i += kFloats) {
        const __m512 prob = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + i), shift));
        _mm512_storeu_ps(row + i, prob);
        total = _mm512_add_ps(total, prob);
      }
      p.sum += _mm512_reduce_add_ps(total);
    }
    // Rows still at -inf (no visible key yet) hold probabilities 0 after the max of -inf was skipped.
    for (int64_t q = 0; q < queries; ++q)
      if (partial[q].max == kNone) std::fill(ws.scores.begin() + q * kBlock, ws.scores.begin() + (q + 1) * kBlock, 0.0f);
    for (int64_t i = s0 + kBlock; i < std::min(s0 + 2 * kBlock, s_end); ++i)  // the next block's keys
      prefetch_row(task.k + i * task.k_stride, D);
    for (int64_t d0 = 0; d0 < D; d0 += kFloats)
      for (int64_t q0 = 0; q0 < queries; q0 += kValueQueries)
        kValueFns[std::min<int64_t>(kValueQueries, queries - q0) - 1](task, s0, n, ws, q0, d0, acc);
  }
}

// Keys per parallel task: enough tasks for every thread, never fewer keys than a block.
int64_t chunk_keys(int64_t S, int64_t heads) {
  const int64_t tasks_wanted = kTasksPerThread * at::get_num_threads();
  const int64_t chunks_per_head = std::max<int64_t>(1, (tasks_wanted + heads - 1) / heads);
  const int64_t keys = (S + chunks_per_head - 1) / chunks_per_head;
  return std::max(kMinChunk, (keys + kBlock - 1) / kBlock * kBlock);
}

std::tuple<at::Tensor, at::Tensor> few_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<at::Tensor>& visible, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q [B, Hq, T, D], contiguous");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v [B, Hkv, S, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hq % Hkv == 0 && S > 0 && T > 0, "shapes of q and k/v disagree");
  TORCH_CHECK(D % kLanes == 0, "head dim a multiple of 32");
  const int64_t group = Hq / Hkv, queries = group * T;
  const bool* mask = nullptr;
  int64_t mask_rows = 0;
  if (visible.has_value()) {
    TORCH_CHECK(visible->scalar_type() == at::kBool && visible->is_contiguous() && visible->dim() == 3 &&
                    visible->size(1) == T && visible->size(2) == S && (visible->size(0) == 1 || visible->size(0) == B),
                "visible [1 or B, T, S] bool, contiguous");
    mask = visible->data_ptr<bool>();
    mask_rows = visible->size(0);
  }
  const int64_t chunk = chunk_keys(S, B * Hkv);
  const int64_t chunks = (S + chunk - 1) / chunk;
  const int64_t tasks = B * Hkv * chunks;
  // Every task writes all of its partials and accumulators: no zero-filling needed.
  std::unique_ptr<Partial[]> partials(new Partial[tasks * queries]);
  std::unique_ptr<float[]> accs(new float[tasks * queries * D]);
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Workspace ws(queries);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t c = index % chunks, g = (index / chunks) % Hkv, b = index / (chunks * Hkv);
      // The group's heads are consecutive in q, so its queries are one [queries, D] block.
      const HeadTask task{qs + (b * Hq + g * group) * T * D,
                          ks + b * k.stride(0) + g * k.stride(1),
                          vs + b * v.stride(0) + g * v.stride(1),
                          k.stride(2), v.stride(2),
                          mask ? mask + (mask_rows == 1 ? 0 : b) * T * S : nullptr,
                          T, S, D, queries, static_cast<float>(scale)};
      attend_chunk(task, c * chunk, std::min(S, (c + 1) * chunk), ws, partials.get() + index * queries,
                   accs.get() + index * queries * D);
    }
  });
  at::Tensor out = at::empty({B, Hq, T, D}, q.options());
  at::Tensor lse = at::empty({B, Hq, T}, q.options().dtype(at::kFloat));
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* ls = lse.data_ptr<float>();
  // Merge the chunks of each query: out and lse rows are laid out [B, Hkv, group, T], the same order.
  at::parallel_for(0, B * Hkv * queries, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t query = row % queries, head = row / queries;  // head = b * Hkv + g
      const int64_t first = head * chunks;
      float best = kNone;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, partials[(first + c) * queries + query].max);
      uint16_t* o = os + row * D;
      if (best == kNone) {  // no visible key: an empty sum
        for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(0.0f).x;
        ls[row] = kNone;
        continue;
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial& p = partials[(first + c) * queries + query];
        if (p.max == kNone) continue;
        const float weight = std::exp(p.max - best);
        total += p.sum * weight;
        const float* acc = accs.get() + ((first + c) * queries + query) * D;
        for (int64_t d = 0; d < D; ++d) merged[d] += acc[d] * weight;
      }
      for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(merged[d] / total).x;
      ls[row] = best + std::log(total);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("few_query_attention(Tensor q, Tensor k, Tensor v, Tensor? visible, float scale) -> (Tensor, Tensor)");
  m.impl("few_query_attention", c10::DispatchKey::CPU, TORCH_FN(few_query_attention));
}
