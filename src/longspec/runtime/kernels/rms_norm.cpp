// RMSNorm of bf16 rows in one pass, float32 inside, one rounding to bf16 at the end:
// what `RMSNorm.forward` in runtime/model.py computes with ~10 tensor operations (to
// float32, square, mean, rsqrt, scale, back to bf16). A decode step normalises 5 small
// rows per layer, where those operations' dispatch costs more than their arithmetic.
//
//   Gemma:        out = bf16(x * rsqrt(mean(x^2) + eps) * scale)     scale = 1 + w, float32
//   Llama family: out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))  w in bf16
//
// x is [rows, H] (contiguous); the scale/weight is [S, H] and row r uses its row r % S,
// so a per-head q/k norm ([heads, head_dim]) normalises [tokens * heads, head_dim].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

inline float to_float(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }
inline uint16_t to_bits(float value) { return c10::BFloat16(value).x; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps, bool gemma) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() > 0, "scale: contiguous");
  TORCH_CHECK(scale.scalar_type() == (gemma ? at::kFloat : at::kBFloat16), "scale: float32 (Gemma) or bf16 weight");
  const int64_t H = scale.size(-1), S = scale.numel() / H;
  TORCH_CHECK(x.numel() % (S * H) == 0 && x.size(-1) == H, "x [..., S, H] for a scale [S, H]");
  const int64_t rows = x.numel() / H;
  at::Tensor out = at::empty_like(x);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* gemma_scale = gemma ? scale.data_ptr<float>() : nullptr;
  const auto* weight = gemma ? nullptr : reinterpret_cast<const uint16_t*>(scale.data_ptr());
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xs + r * H;
      float squares = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        const float v = to_float(row[h]);
        squares += v * v;
      }
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(H) + epsilon);
      const int64_t s = (r % S) * H;
      uint16_t* o = os + r * H;
      if (gemma) {
        for (int64_t h = 0; h < H; ++h) o[h] = to_bits(to_float(row[h]) * inverse * gemma_scale[s + h]);
      } else {
        for (int64_t h = 0; h < H; ++h) o[h] = to_bits(to_float(weight[s + h]) * to_float(to_bits(to_float(row[h]) * inverse)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("rms_norm(Tensor x, Tensor scale, float eps, bool gemma) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
