// Few-row bf16 matrix products that stream the weight once: y[m, n] = x[m, :] . w[n, :]
// (+ bias[n]), accumulated in float32 with AVX-512 BF16 dot products, rounded to bf16
// once at the end, as a bf16 linear layer does.
//
// Why: a decode step multiplies one row by every weight matrix, so its speed is the
// rate at which the weights stream from memory. Walking each weight row linearly with
// two independent accumulators reaches the measured read bandwidth of a core, about
// twice what oneDNN's bf16 matrix-vector product reaches on the same machine
// (measurements in BENCHMARKS.md). Only the kernels are compiled for AVX-512; the rest of
// the library is baseline x86-64, so `avx512_bf16_supported()` can be asked on any CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kLanes = 32;         // bf16 values per 512-bit register
// Rows of x per pass over the weight. At 4 rows this loop streams the weight slower than oneDNN's
// blocked GEMM (a whole 4-token Gemma 3 270M forward is 8-10% faster through oneDNN; BENCHMARKS.md).
constexpr int64_t kMaxRows = 3;
constexpr int64_t kRowsPerTask = 256;  // weight rows per parallel task (> 320 KB for K = 640)

#define LONGSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

template <int M>
LONGSPEC_AVX512_BF16 void rows_times_weight(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                            uint16_t* y, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t full = K / (2 * kLanes) * (2 * kLanes);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* row = w + n * K;
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 2 * kLanes) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + kLanes);
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + kLanes));
      }
    }
    for (int64_t k = full; k < K; k += kLanes) {
      const int64_t left = K - k < kLanes ? K - k : kLanes;
      const __mmask32 mask = left == kLanes ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
      const __m512bh wk = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
      for (int m = 0; m < M; ++m)
        even[m] = _mm512_dpbf16_ps(even[m], wk, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    const float b = bias ? static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits())) : 0.0f;
    for (int m = 0; m < M; ++m) {
      const c10::BFloat16 out(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + b);
      y[m * N + n] = out.x;
    }
  }
}

using Kernel = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t);

Kernel kernel_for(int64_t rows) {
  switch (rows) {
    case 1: return rows_times_weight<1>;
    case 2: return rows_times_weight<2>;
    case 3: return rows_times_weight<3>;
    default: return nullptr;
  }
}

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

int64_t max_rows() { return kMaxRows; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 inputs only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous x and weight");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "1 to ", kMaxRows, " rows of x");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const uint16_t* bias_bits = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N, "bias [N] bf16");
    bias_bits = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  const Kernel kernel = kernel_for(M);
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) { kernel(xs, ws, bias_bits, ys, K, N, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("avx512_bf16_supported() -> bool", &supported);
  m.def("bf16_linear_max_rows() -> int", &max_rows);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
