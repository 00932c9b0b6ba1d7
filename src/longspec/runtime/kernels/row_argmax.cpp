// argmax of each bf16 row: the greedy token of every verified node, over a whole
// vocabulary (262k for Gemma). PyTorch's CPU argmax over bf16 is not vectorised, and
// even over float32 a verified tree of 65 rows spends longer finding its argmaxes than
// reading the logits (docs/lab-notes/batching.md#batched-throughput-after-huge-pages-and-the-native-argmax-issue-batching).
// Semantics are torch.argmax's: the first index of the maximum, and the first NaN when a
// row holds one.
//
// Each of 16 lanes (AVX-512) or 4 x 8 lanes (AVX2, four independent chains so the
// compare-and-blend latency does not bound the scan) keeps the first index of its strict
// maximum; the row's answer is the smallest index among the lanes holding the overall
// maximum. bf16 widens to float32 exactly by a 16-bit shift, so no value is rounded on
// the way.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_features.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// The reference (and the path for CPUs without AVX-512): one scan, strict comparison.
int64_t scalar_row_argmax(const uint16_t* row, int64_t V) {
  int64_t best = 0;
  float best_value = widen(row[0]);
  if (std::isnan(best_value)) return 0;
  for (int64_t v = 1; v < V; ++v) {
    const float x = widen(row[v]);
    if (std::isnan(x)) return v;
    if (x > best_value) best_value = x, best = v;
  }
  return best;
}

// The elements after a vector scan's whole steps come after every lane's indices: the
// scan goes on from the lanes' answer over them.
int64_t scan_tail(const uint16_t* row, int64_t from, int64_t V, int64_t answer, float answer_value) {
  for (int64_t v = from; v < V; ++v) {
    const float x = widen(row[v]);
    if (std::isnan(x)) return v;
    if (x > answer_value) answer_value = x, answer = v;
  }
  return answer;
}

__attribute__((target("avx512f,avx512bw"))) int64_t avx512_row_argmax(const uint16_t* row, int64_t V) {
  constexpr int64_t kLanes = 16;
  const int64_t full = V / kLanes * kLanes;
  if (full == 0) return scalar_row_argmax(row, V);
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(kLanes);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < full; v += kLanes) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + v));
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, greater, x);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    index = _mm512_add_epi32(index, step);
  }
  if (nan) return scalar_row_argmax(row, V);  // rare: let the reference find the first NaN
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // Lanes that never beat -inf keep index 0, which is right: the row is all -inf so far.
  const __m512i candidates = _mm512_mask_mov_epi32(_mm512_set1_epi32(std::numeric_limits<int32_t>::max()), holders, best_index);
  return scan_tail(row, full, V, _mm512_reduce_min_epi32(candidates), top);
}

__attribute__((target("avx2"))) int64_t avx2_row_argmax(const uint16_t* row, int64_t V) {
  constexpr int kChains = 4;
  constexpr int64_t kLanes = 8, kStride = kChains * kLanes;
  const int64_t full = V / kStride * kStride;
  if (full == 0) return scalar_row_argmax(row, V);
  __m256 best[kChains];
  __m256i best_index[kChains], index[kChains];
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    best_index[c] = _mm256_setzero_si256();
    index[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(c * kLanes));
  }
  const __m256i step = _mm256_set1_epi32(kStride);
  __m256 nan = _mm256_setzero_ps();
  for (int64_t v = 0; v < full; v += kStride) {
    for (int c = 0; c < kChains; ++c) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + v + c * kLanes));
      const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      const __m256 greater = _mm256_cmp_ps(x, best[c], _CMP_GT_OQ);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      best[c] = _mm256_blendv_ps(best[c], x, greater);
      best_index[c] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_index[c]), _mm256_castsi256_ps(index[c]), greater));
      index[c] = _mm256_add_epi32(index[c], step);
    }
  }
  if (_mm256_movemask_ps(nan)) return scalar_row_argmax(row, V);  // rare: let the reference find the first NaN
  alignas(32) float values[kChains][kLanes];
  alignas(32) int32_t indices[kChains][kLanes];
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(values[c], best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices[c]), best_index[c]);
  }
  float top = values[0][0];
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < kLanes; ++l) top = std::max(top, values[c][l]);
  // Lanes that never beat -inf keep index 0, which is right: the row is all -inf so far.
  int64_t answer = std::numeric_limits<int64_t>::max();
  for (int c = 0; c < kChains; ++c)
    for (int l = 0; l < kLanes; ++l)
      if (values[c][l] == top) answer = std::min<int64_t>(answer, indices[c][l]);
  return scan_tail(row, full, V, answer, top);
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

enum class Scan { kScalar, kAvx2, kAvx512 };

at::Tensor row_argmax_with(const at::Tensor& logits, Scan scan) {
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 && logits.is_contiguous(),
              "logits: contiguous bf16 [rows, V]");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(), "1 <= V < 2^31");
  const int64_t rows = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const auto* bits = reinterpret_cast<const uint16_t*>(logits.data_ptr());
  auto* answers = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = bits + r * V;
      answers[r] = scan == Scan::kAvx512 ? avx512_row_argmax(row, V)
                   : scan == Scan::kAvx2 ? avx2_row_argmax(row, V)
                                         : scalar_row_argmax(row, V);
    }
  });
  return out;
}

at::Tensor row_argmax(const at::Tensor& logits) {
  const Scan scan = has_avx512() ? Scan::kAvx512 : avx2_fma_supported() ? Scan::kAvx2 : Scan::kScalar;
  return row_argmax_with(logits, scan);
}

// The AVX2 scan on any CPU that has it, so AVX-512 machines test it too.
at::Tensor row_argmax_avx2(const at::Tensor& logits) {
  TORCH_CHECK(avx2_fma_supported(), "row_argmax_avx2 needs AVX2");
  return row_argmax_with(logits, Scan::kAvx2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("row_argmax(Tensor logits) -> Tensor");
  m.def("row_argmax_avx2(Tensor logits) -> Tensor");
  m.impl("row_argmax", c10::DispatchKey::CPU, TORCH_FN(row_argmax));
  m.impl("row_argmax_avx2", c10::DispatchKey::CPU, TORCH_FN(row_argmax_avx2));
}
