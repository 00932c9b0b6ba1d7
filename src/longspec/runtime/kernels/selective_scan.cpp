// Mamba's selective scan over a whole sequence, forward and backward, for the CPU.
// `transformers`' Mamba has no CPU kernel: its reference path loops over time steps in
// Python (one batched product per step), too slow to train a small drafter on a CPU
// (docs/lab-notes/mamba-and-draft-models.md#training-the-selective-scan-in-a-native-kernel).
// Here each channel's recurrence runs in C++ with its states in a small buffer; the
// projections around the scan stay PyTorch operations.
//
// Per batch row b, channel d, state n (A is negative, so every decay a is in (0, 1]):
//   a_t = exp(delta_t * A_n)
//   h_t = a_t * h_{t-1} + delta_t * B_tn * u_t          h_{-1} = 0
//   y_t = sum_n C_tn * h_tn + D_d * u_t
// Layouts (contiguous): u, delta, y [batch, L, D]; B, C [batch, L, N]; A [D, N]; D [D];
// the final state [batch, D, N] (what a decoding step continues from). The forward may
// start from a given state (a drafter catching up on many tokens); training starts empty.
//
// The backward pass recomputes the states of one block of channels at a time into a
// buffer (L x block x N values) and walks back in time with g_t = dLoss/dh_t:
//   g_t = gy_t * C_tn + a_{t+1} * g_{t+1}
//   dC_tn += gy_t * h_tn          dB_tn += g_t * delta_t * u_t      (sums over channels)
//   ddelta_t += g_t * (h_{t-1} * a_t * A_n + B_tn * u_t)
//   dA_n += g_t * h_{t-1} * a_t * delta_t
//   du_t += g_t * delta_t * B_tn + D_d * gy_t                        dD_d += gy_t * u_t
// `selective_state_step` is one decoding step of the same recurrence for many rows.
// Batch rows run in parallel; dA and dD are returned per row (the caller sums them).
// float32 with N a multiple of 16 runs 16 states per AVX-512 register where the CPU has
// AVX-512F (exp by Cephes' polynomial, within ~2 float ulps); everything else (float64,
// the tests' exact reference) runs the scalar loops with std::exp.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <immintrin.h>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd_exp.h"

namespace {

// Channels whose states live in the buffer at once: the forward keeps h for a block,
// the backward its whole history (L x block x N), which stays in the L2 cache for the
// sequence lengths drafters train on.
constexpr int64_t kBlock = 16;

constexpr int64_t kLanes = 16;  // float32 values per 512-bit register

#define LONGSPEC_AVX512 __attribute__((target("avx512f")))

// exp(x) for x <= 0 (decays: delta > 0, A < 0): simd_exp.h.
using simd_exp::exp_nonpositive;

struct Shapes {
  int64_t batch, length, channels, states;
};

Shapes check(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
             const at::Tensor& C, const at::Tensor& D) {
  TORCH_CHECK(u.dim() == 3 && u.is_contiguous(), "u: contiguous [batch, L, D]");
  const Shapes s{u.size(0), u.size(1), u.size(2), A.size(-1)};
  TORCH_CHECK(delta.sizes() == u.sizes() && delta.is_contiguous(), "delta: contiguous, shaped like u");
  TORCH_CHECK(A.dim() == 2 && A.size(0) == s.channels && A.is_contiguous(), "A: contiguous [D, N]");
  for (const at::Tensor* t : {&B, &C}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == s.batch && t->size(1) == s.length && t->size(2) == s.states &&
                    t->is_contiguous(),
                "B, C: contiguous [batch, L, N]");
  }
  TORCH_CHECK(D.dim() == 1 && D.size(0) == s.channels && D.is_contiguous(), "D: contiguous [D]");
  for (const at::Tensor* t : {&delta, &A, &B, &C, &D}) {
    TORCH_CHECK(t->scalar_type() == u.scalar_type(), "every input has u's dtype");
  }
  return s;
}

// One channel at one time step. Scalar reference versions (any dtype, any N) ...

// h <- exp(dt A) h + dt x B (from `previous`, null for the empty state); returns sum_n C h.
template <typename T>
T channel_step(const T* An, const T* previous, T* h, const T* Bt, const T* Ct, T dt, T x, int64_t N) {
  T out = 0;
  for (int64_t n = 0; n < N; ++n) {
    h[n] = std::exp(dt * An[n]) * (previous ? previous[n] : T(0)) + dt * Bt[n] * x;
    if (Ct) out += Ct[n] * h[n];
  }
  return out;
}

// The gradients of one channel at step t (see the header); returns (du_t without the
// skip term, ddelta_t). `g` holds a_{t+1} g_{t+1} on entry and a_t g_t on return.
template <typename T>
std::pair<T, T> channel_grad(const T* An, const T* previous, const T* h, const T* Bt, const T* Ct, T dt, T x, T gyt,
                             T* g, T* dA, T* dBt, T* dCt, int64_t N) {
  T dx = 0, ddt = 0;
  for (int64_t n = 0; n < N; ++n) {
    const T a = std::exp(dt * An[n]);
    const T gt = gyt * Ct[n] + g[n];
    dCt[n] += gyt * h[n];
    dBt[n] += gt * dt * x;
    const T decay_grad = gt * (previous ? previous[n] : T(0)) * a;  // dLoss / d(delta_t * A_n)
    ddt += decay_grad * An[n] + gt * Bt[n] * x;
    dA[n] += decay_grad * dt;
    dx += gt * dt * Bt[n];
    g[n] = a * gt;
  }
  return {dx, ddt};
}

// ... and float32 ones, 16 states per register (N a multiple of 16).
LONGSPEC_AVX512 float channel_step_avx512(const float* An, const float* previous, float* h, const float* Bt,
                                          const float* Ct, float dt, float x, int64_t N) {
  const __m512 vdt = _mm512_set1_ps(dt), vdtx = _mm512_set1_ps(dt * x);
  __m512 out = _mm512_setzero_ps();
  for (int64_t n = 0; n < N; n += kLanes) {
    const __m512 a = exp_nonpositive(_mm512_mul_ps(vdt, _mm512_loadu_ps(An + n)));
    const __m512 hp = previous ? _mm512_loadu_ps(previous + n) : _mm512_setzero_ps();
    const __m512 hn = _mm512_fmadd_ps(a, hp, _mm512_mul_ps(vdtx, _mm512_loadu_ps(Bt + n)));
    _mm512_storeu_ps(h + n, hn);
    if (Ct) out = _mm512_fmadd_ps(_mm512_loadu_ps(Ct + n), hn, out);
  }
  return Ct ? _mm512_reduce_add_ps(out) : 0.0f;
}

LONGSPEC_AVX512 std::pair<float, float> channel_grad_avx512(const float* An, const float* previous, const float* h,
                                                            const float* Bt, const float* Ct, float dt, float x,
                                                            float gyt, float* g, float* dA, float* dBt, float* dCt,
                                                            int64_t N) {
  const __m512 vdt = _mm512_set1_ps(dt), vx = _mm512_set1_ps(x), vgy = _mm512_set1_ps(gyt);
  __m512 dx = _mm512_setzero_ps(), ddt = _mm512_setzero_ps();
  for (int64_t n = 0; n < N; n += kLanes) {
    const __m512 An_ = _mm512_loadu_ps(An + n), Bn = _mm512_loadu_ps(Bt + n);
    const __m512 a = exp_nonpositive(_mm512_mul_ps(vdt, An_));
    const __m512 gt = _mm512_fmadd_ps(vgy, _mm512_loadu_ps(Ct + n), _mm512_loadu_ps(g + n));
    _mm512_storeu_ps(dCt + n, _mm512_fmadd_ps(vgy, _mm512_loadu_ps(h + n), _mm512_loadu_ps(dCt + n)));
    const __m512 gdt = _mm512_mul_ps(gt, vdt);
    _mm512_storeu_ps(dBt + n, _mm512_fmadd_ps(gdt, vx, _mm512_loadu_ps(dBt + n)));
    const __m512 hp = previous ? _mm512_loadu_ps(previous + n) : _mm512_setzero_ps();
    const __m512 decay_grad = _mm512_mul_ps(_mm512_mul_ps(gt, hp), a);
    ddt = _mm512_fmadd_ps(decay_grad, An_, _mm512_fmadd_ps(_mm512_mul_ps(gt, Bn), vx, ddt));
    _mm512_storeu_ps(dA + n, _mm512_fmadd_ps(decay_grad, vdt, _mm512_loadu_ps(dA + n)));
    dx = _mm512_fmadd_ps(gdt, Bn, dx);
    _mm512_storeu_ps(g + n, _mm512_mul_ps(a, gt));
  }
  return {_mm512_reduce_add_ps(dx), _mm512_reduce_add_ps(ddt)};
}

template <typename T>
bool use_avx512(int64_t N) {
  if constexpr (std::is_same_v<T, float>) {
    return N % kLanes == 0 && __builtin_cpu_supports("avx512f");
  }
  return false;
}

template <typename T>
T step(bool vector, const T* An, const T* previous, T* h, const T* Bt, const T* Ct, T dt, T x, int64_t N) {
  if constexpr (std::is_same_v<T, float>) {
    if (vector) return channel_step_avx512(An, previous, h, Bt, Ct, dt, x, N);
  }
  return channel_step(An, previous, h, Bt, Ct, dt, x, N);
}

template <typename T>
std::pair<T, T> grad(bool vector, const T* An, const T* previous, const T* h, const T* Bt, const T* Ct, T dt, T x,
                     T gyt, T* g, T* dA, T* dBt, T* dCt, int64_t N) {
  if constexpr (std::is_same_v<T, float>) {
    if (vector) return channel_grad_avx512(An, previous, h, Bt, Ct, dt, x, gyt, g, dA, dBt, dCt, N);
  }
  return channel_grad(An, previous, h, Bt, Ct, dt, x, gyt, g, dA, dBt, dCt, N);
}

template <typename T>
void scan_forward(const Shapes& s, const T* u, const T* delta, const T* A, const T* Bm, const T* Cm, const T* Dv,
                  const T* initial, T* y, T* last) {
  const int64_t L = s.length, Dc = s.channels, N = s.states, blocks = (Dc + kBlock - 1) / kBlock;
  const bool vector = use_avx512<T>(N);
  at::parallel_for(0, s.batch * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> h(kBlock * N);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / blocks, d0 = (job % blocks) * kBlock, width = std::min(kBlock, Dc - d0);
      if (initial) std::copy(initial + (b * Dc + d0) * N, initial + (b * Dc + d0 + width) * N, h.begin());
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = (b * L + t) * Dc + d0;
        const T* Bt = Bm + (b * L + t) * N;
        const T* Ct = Cm + (b * L + t) * N;
        for (int64_t j = 0; j < width; ++j) {
          T* hj = h.data() + j * N;
          const T x = u[row + j];
          y[row + j] = step(vector, A + (d0 + j) * N, t || initial ? hj : nullptr, hj, Bt, Ct, delta[row + j], x, N) +
                       Dv[d0 + j] * x;
        }
      }
      std::copy(h.begin(), h.begin() + width * N, last + (b * Dc + d0) * N);
    }
  });
}

template <typename T>
void scan_backward(const Shapes& s, const T* u, const T* delta, const T* A, const T* Bm, const T* Cm, const T* Dv,
                   const T* gy, T* du, T* ddelta, T* dA, T* dB, T* dC, T* dD) {
  const int64_t L = s.length, Dc = s.channels, N = s.states, stride = kBlock * N;
  const bool vector = use_avx512<T>(N);
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> history(L * stride), g(stride);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t d0 = 0; d0 < Dc; d0 += kBlock) {
        const int64_t width = std::min(kBlock, Dc - d0);
        for (int64_t t = 0; t < L; ++t) {  // recompute h_t of this block for every t
          const int64_t row = (b * L + t) * Dc + d0;
          T* ht = history.data() + t * stride;
          for (int64_t j = 0; j < width; ++j) {
            step<T>(vector, A + (d0 + j) * N, t ? ht - stride + j * N : nullptr, ht + j * N, Bm + (b * L + t) * N,
                    nullptr, delta[row + j], u[row + j], N);
          }
        }
        std::fill(g.begin(), g.end(), T(0));
        for (int64_t t = L - 1; t >= 0; --t) {  // walk back
          const int64_t row = (b * L + t) * Dc + d0, at_t = (b * L + t) * N;
          const T* ht = history.data() + t * stride;
          for (int64_t j = 0; j < width; ++j) {
            const T x = u[row + j], gyt = gy[row + j];
            const auto [dx, ddt] = grad(vector, A + (d0 + j) * N, t ? ht - stride + j * N : nullptr, ht + j * N,
                                        Bm + at_t, Cm + at_t, delta[row + j], x, gyt, g.data() + j * N,
                                        dA + (b * Dc + d0 + j) * N, dB + at_t, dC + at_t, N);
            du[row + j] = dx + Dv[d0 + j] * gyt;
            ddelta[row + j] = ddt;
            dD[b * Dc + d0 + j] += gyt * x;
          }
        }
      }
    }
  });
}

// initial: the state before the sequence [batch, D, N] (None: zeros).
std::tuple<at::Tensor, at::Tensor> selective_scan_forward(const at::Tensor& u, const at::Tensor& delta,
                                                          const at::Tensor& A, const at::Tensor& B,
                                                          const at::Tensor& C, const at::Tensor& D,
                                                          const std::optional<at::Tensor>& initial) {
  const Shapes s = check(u, delta, A, B, C, D);
  if (initial) {
    TORCH_CHECK(initial->dim() == 3 && initial->size(0) == s.batch && initial->size(1) == s.channels &&
                    initial->size(2) == s.states && initial->is_contiguous() && initial->scalar_type() == u.scalar_type(),
                "initial: contiguous [batch, D, N] of u's dtype");
  }
  at::Tensor y = at::empty_like(u);
  at::Tensor last = at::empty({s.batch, s.channels, s.states}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_forward", [&] {
    scan_forward<scalar_t>(s, u.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), A.data_ptr<scalar_t>(),
                           B.data_ptr<scalar_t>(), C.data_ptr<scalar_t>(), D.data_ptr<scalar_t>(),
                           initial ? initial->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(),
                           last.data_ptr<scalar_t>());
  });
  return {y, last};
}

// (du, ddelta, dA per batch row [batch, D, N], dB, dC, dD per batch row [batch, D])
std::vector<at::Tensor> selective_scan_backward(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                                const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                                const at::Tensor& grad_y) {
  const Shapes s = check(u, delta, A, B, C, D);
  TORCH_CHECK(grad_y.sizes() == u.sizes() && grad_y.is_contiguous() && grad_y.scalar_type() == u.scalar_type(),
              "grad_y: contiguous, shaped like u");
  at::Tensor du = at::empty_like(u), ddelta = at::empty_like(u);
  at::Tensor dA = at::zeros({s.batch, s.channels, s.states}, u.options());
  at::Tensor dB = at::zeros_like(B), dC = at::zeros_like(C);
  at::Tensor dD = at::zeros({s.batch, s.channels}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_backward", [&] {
    scan_backward<scalar_t>(s, u.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), A.data_ptr<scalar_t>(),
                            B.data_ptr<scalar_t>(), C.data_ptr<scalar_t>(), D.data_ptr<scalar_t>(),
                            grad_y.data_ptr<scalar_t>(), du.data_ptr<scalar_t>(), ddelta.data_ptr<scalar_t>(),
                            dA.data_ptr<scalar_t>(), dB.data_ptr<scalar_t>(), dC.data_ptr<scalar_t>(),
                            dD.data_ptr<scalar_t>());
  });
  return {du, ddelta, dA, dB, dC, dD};
}

// One decoding step for `rows` sequences (tree branches): state [rows, D, N] advances in
// place by one input (x, delta [rows, D]; B, C [rows, N]); returns y [rows, D].
at::Tensor selective_state_step(at::Tensor& state, const at::Tensor& x, const at::Tensor& delta, const at::Tensor& A,
                                const at::Tensor& B, const at::Tensor& C, const at::Tensor& D) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous(), "state: contiguous [rows, D, N]");
  const int64_t rows = state.size(0), Dc = state.size(1), N = state.size(2);
  TORCH_CHECK(x.sizes() == delta.sizes() && x.dim() == 2 && x.size(0) == rows && x.size(1) == Dc &&
                  x.is_contiguous() && delta.is_contiguous(),
              "x, delta: contiguous [rows, D]");
  TORCH_CHECK(A.dim() == 2 && A.size(0) == Dc && A.size(1) == N && A.is_contiguous(), "A: contiguous [D, N]");
  TORCH_CHECK(B.sizes() == C.sizes() && B.dim() == 2 && B.size(0) == rows && B.size(1) == N && B.is_contiguous() &&
                  C.is_contiguous(),
              "B, C: contiguous [rows, N]");
  TORCH_CHECK(D.dim() == 1 && D.size(0) == Dc && D.is_contiguous(), "D: contiguous [D]");
  for (const at::Tensor* t : {&x, &delta, &A, &B, &C, &D}) {
    TORCH_CHECK(t->scalar_type() == state.scalar_type(), "every input has the state's dtype");
  }
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(state.scalar_type(), "selective_state_step", [&] {
    const bool vector = use_avx512<scalar_t>(N);
    scalar_t* h = state.data_ptr<scalar_t>();
    const scalar_t *xs = x.data_ptr<scalar_t>(), *ds = delta.data_ptr<scalar_t>(), *As = A.data_ptr<scalar_t>();
    const scalar_t *Bs = B.data_ptr<scalar_t>(), *Cs = C.data_ptr<scalar_t>(), *Dv = D.data_ptr<scalar_t>();
    scalar_t* ys = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows * Dc, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / Dc, d = i % Dc;
        scalar_t* hi = h + i * N;
        ys[i] = step(vector, As + d * N, hi, hi, Bs + r * N, Cs + r * N, ds[i], xs[i], N) + Dv[d] * xs[i];
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("selective_scan_forward(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor D, Tensor? initial=None) "
        "-> (Tensor, Tensor)");
  m.def("selective_scan_backward(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor D, Tensor grad_y) "
        "-> Tensor[]");
  m.def("selective_state_step(Tensor(a!) state, Tensor x, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor D) "
        "-> Tensor");
  m.impl("selective_state_step", c10::DispatchKey::CPU, TORCH_FN(selective_state_step));
  m.impl("selective_scan_forward", c10::DispatchKey::CPU, TORCH_FN(selective_scan_forward));
  m.impl("selective_scan_backward", c10::DispatchKey::CPU, TORCH_FN(selective_scan_backward));
}
