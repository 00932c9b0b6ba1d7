// exp(x) for x <= 0 in float32 lanes, one copy for every kernel that needs it (attention's
// softmax, the selective scan's decays, the sampler's normaliser).
//
// Cephes' single-precision polynomial: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// for the reduction), exp(r) by a degree-6 polynomial, then times 2^n: within ~2 float ulps.
//
// The one edge rule: x below kExpFloor = ln(2^-126), the smallest normal float's exponent,
// gives exactly 0, and so do -inf and NaN. Above it 2^n is a normal float, so the AVX2 path
// can build it in the exponent field; what the rule drops is below 1.2e-38, under float32's
// resolution beside the largest term of any sum these kernels take (exp(0) = 1), so the
// float64 references the tests compare with see no difference.
#pragma once

#include <immintrin.h>

namespace simd_exp {

constexpr float kExpFloor = -87.33654475f;  // ln(2^-126)

__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  const __m512 floor = _mm512_set1_ps(kExpFloor);
  const __mmask16 kept = _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ);  // false for -inf and NaN
  x = _mm512_max_ps(x, floor);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(kExpFloor);
  const __m256 kept = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);  // all ones where kept; -inf and NaN not
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(kept, _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n)));
}

}  // namespace simd_exp
