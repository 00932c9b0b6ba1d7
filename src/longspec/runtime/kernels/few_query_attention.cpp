// Attention of a few new queries per row (a decode token, a speculative tree) over keys
// read in place from the cache, bf16 in, float32 inside:
//
//   out[b, h, t] = sum_s softmax_s(scale * q[b, h, t] . k[b, g, s]) v[b, g, s]   over visible s
//   lse[b, h, t] = log sum_s exp(scale * q[b, h, t] . k[b, g, s])                over visible s
//
// g = h / (Hq / Hkv): grouped-query heads read their K/V head once, never repeated. The
// log-sum-exp lets a caller merge this with attention over other keys (the prefix and
// tree parts of Hybrid Tree Attention); a query that sees no key gets out 0, lse -inf.
//
// Why: for one query per head, PyTorch's CPU flash kernel spends several times the K/V
// read in setup (1.6-2.4x slower than this kernel; BENCHMARKS.md, "Decode at the bandwidth
// floor"). Keys are split into chunks processed in parallel, each keeping its own running
// max and sum per query, and the chunks are merged exactly at the end, so a single K/V
// head still uses every thread. From 2 queries on, flash's GEMMs and vectorised exp win:
// this kernel computes one dot product, one exp and one row update per key and query.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kLanes = 32;   // bf16 values per 512-bit register
constexpr int64_t kChunk = 64;   // keys per parallel task: 64 keys of head dim 256 are 32 KB, one L1
constexpr float kNone = -std::numeric_limits<float>::infinity();

#define LONGSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

LONGSPEC_AVX512_BF16 inline float dot(const uint16_t* a, const uint16_t* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
  return _mm512_reduce_add_ps(acc);
}

LONGSPEC_AVX512_BF16 inline void add_scaled_row(float* acc, const uint16_t* row, float weight, int64_t D) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
    const __m512 values = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(values, w, _mm512_loadu_ps(acc + d)));
  }
}

struct Partial {  // one chunk's softmax state for one query
  float max;
  float sum;
};

// The queries of one K/V head (its `group` heads x T tokens) over keys [s_begin, s_end).
struct ChunkTask {
  const uint16_t* q;     // [group, T, D] for this K/V head
  const uint16_t* k;     // key s at k + s * k_stride
  const uint16_t* v;
  int64_t k_stride, v_stride;
  const bool* visible;   // [T, S] for this row, or nullptr (all visible)
  int64_t group, T, S, D;
  float scale;
};

LONGSPEC_AVX512_BF16 void attend_chunk(const ChunkTask& task, int64_t s_begin, int64_t s_end, float* scores,
                                       Partial* partial, float* acc) {
  const int64_t n = s_end - s_begin;
  for (int64_t h = 0; h < task.group; ++h) {
    for (int64_t t = 0; t < task.T; ++t) {
      const int64_t query = h * task.T + t;
      const uint16_t* qv = task.q + query * task.D;
      const bool* mask = task.visible ? task.visible + t * task.S + s_begin : nullptr;
      float best = kNone;
      for (int64_t i = 0; i < n; ++i) {  // keys the query cannot see are never read
        scores[i] = mask == nullptr || mask[i] ? dot(qv, task.k + (s_begin + i) * task.k_stride, task.D) * task.scale : kNone;
        best = scores[i] > best ? scores[i] : best;
      }
      Partial& p = partial[query];
      p.max = best;
      p.sum = 0.0f;
      float* out = acc + query * task.D;
      for (int64_t d = 0; d < task.D; ++d) out[d] = 0.0f;
      if (best == kNone) continue;  // nothing visible in this chunk
      for (int64_t i = 0; i < n; ++i) {
        if (scores[i] == kNone) continue;
        const float weight = std::exp(scores[i] - best);
        p.sum += weight;
        add_scaled_row(out, task.v + (s_begin + i) * task.v_stride, weight, task.D);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> few_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<at::Tensor>& visible, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q [B, Hq, T, D], contiguous");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v [B, Hkv, S, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hq % Hkv == 0 && S > 0, "shapes of q and k/v disagree");
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
  const int64_t chunks = (S + kChunk - 1) / kChunk;
  const int64_t tasks = B * Hkv * chunks;
  // Every task writes all of its partials and accumulators: no zero-filling needed.
  std::unique_ptr<Partial[]> partials(new Partial[tasks * queries]);
  std::unique_ptr<float[]> accs(new float[tasks * queries * D]);
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunk);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t c = index % chunks, g = (index / chunks) % Hkv, b = index / (chunks * Hkv);
      const ChunkTask task{qs + (b * Hq + g * group) * T * D,
                           ks + b * k.stride(0) + g * k.stride(1),
                           vs + b * v.stride(0) + g * v.stride(1),
                           k.stride(2), v.stride(2),
                           mask ? mask + (mask_rows == 1 ? 0 : b) * T * S : nullptr,
                           group, T, S, D, static_cast<float>(scale)};
      attend_chunk(task, c * kChunk, std::min(S, (c + 1) * kChunk), scores.data(), partials.get() + index * queries,
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
