// Attention of one new token per row over its cached keys (a decode step), bf16 in,
// float32 inside, bf16 out:
//
//   out[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, g, s]) v[b, g, s]   over visible s,
//   g = h / (Hq / Hkv)  (grouped-query heads read their K/V head once, never repeated).
//
// Why: PyTorch's CPU flash kernel is built for blocks of queries; for one query per head
// it spends several times the K/V read in setup (BENCHMARKS.md, "Decode at the
// bandwidth floor"). Keys are split into chunks processed in parallel, each with its
// own running max and sum, merged exactly at the end (the log-sum-exp merge), so a
// single K/V head still uses every thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 32;      // bf16 values per 512-bit register
constexpr int64_t kChunk = 128;     // keys per parallel task
constexpr int64_t kMaxGroup = 16;   // query heads per K/V head handled in one pass
constexpr int64_t kMaxDim = 512;    // head dimension bound of the per-task accumulators

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

struct Partial {  // one chunk's softmax state for one query head
  float max;
  float sum;
};

LONGSPEC_AVX512_BF16 void attend_chunk(const uint16_t* q, int64_t group, const uint16_t* k, const uint16_t* v,
                                       int64_t k_stride, int64_t v_stride, const bool* visible, int64_t s_begin,
                                       int64_t s_end, int64_t D, float scale, Partial* partial, float* acc) {
  float scores[kMaxGroup][kChunk];
  for (int64_t h = 0; h < group; ++h) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t s = s_begin; s < s_end; ++s) {
      float score = -std::numeric_limits<float>::infinity();
      if (visible == nullptr || visible[s]) score = dot(q + h * D, k + s * k_stride, D) * scale;
      scores[h][s - s_begin] = score;
      best = score > best ? score : best;
    }
    partial[h].max = best;
    partial[h].sum = 0.0f;
    float* out = acc + h * D;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    if (best == -std::numeric_limits<float>::infinity()) continue;  // nothing visible here
    for (int64_t s = s_begin; s < s_end; ++s) {
      const float score = scores[h][s - s_begin];
      if (score == -std::numeric_limits<float>::infinity()) continue;
      const float weight = std::exp(score - best);
      partial[h].sum += weight;
      add_scaled_row(out, v + s * v_stride, weight, D);
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& visible, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 q, k, v");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.is_contiguous(), "q [B, Hq, 1, D], contiguous");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v [B, Hkv, S, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hq % Hkv == 0, "shapes of q and k/v disagree");
  const int64_t group = Hq / Hkv;
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxDim && group <= kMaxGroup, "head dim a multiple of 32 up to 512, group <= 16");
  const bool* mask = nullptr;
  int64_t mask_rows = 0;
  if (visible.has_value()) {
    TORCH_CHECK(visible->scalar_type() == at::kBool && visible->is_contiguous() && visible->dim() == 2 &&
                    visible->size(1) == S && (visible->size(0) == 1 || visible->size(0) == B),
                "visible [1 or B, S] bool");
    mask = visible->data_ptr<bool>();
    mask_rows = visible->size(0);
  }
  const int64_t chunks = (S + kChunk - 1) / kChunk;
  const int64_t tasks = B * Hkv * chunks;
  std::vector<Partial> partials(tasks * group);
  std::vector<float> accs(tasks * group * D);
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const float softmax_scale = static_cast<float>(scale);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % chunks, g = (task / chunks) % Hkv, b = task / (chunks * Hkv);
      const bool* row_mask = mask ? mask + (mask_rows == 1 ? 0 : b) * S : nullptr;
      attend_chunk(qs + (b * Hq + g * group) * D, group, ks + b * k.stride(0) + g * k.stride(1),
                   vs + b * v.stride(0) + g * v.stride(1), k.stride(2), v.stride(2), row_mask, c * kChunk,
                   std::min(S, (c + 1) * kChunk), D, softmax_scale, partials.data() + task * group,
                   accs.data() + task * group * D);
    }
  });
  at::Tensor out = at::empty({B, Hq, 1, D}, q.options());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t h = 0; h < group; ++h) {
        const int64_t first = (b * Hkv + g) * chunks;
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) best = std::max(best, partials[(first + c) * group + h].max);
        uint16_t* o = os + (b * Hq + g * group + h) * D;
        if (best == -std::numeric_limits<float>::infinity()) {  // no visible key: zeros, as an empty sum
          for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(0.0f).x;
          continue;
        }
        std::vector<float> merged(D, 0.0f);
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const Partial& p = partials[(first + c) * group + h];
          if (p.max == -std::numeric_limits<float>::infinity()) continue;
          const float weight = std::exp(p.max - best);
          total += p.sum * weight;
          const float* acc = accs.data() + ((first + c) * group + h) * D;
          for (int64_t d = 0; d < D; ++d) merged[d] += acc[d] * weight;
        }
        for (int64_t d = 0; d < D; ++d) o[d] = c10::BFloat16(merged[d] / total).x;
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? visible, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
