// The rest of a decoder layer after its attention, in one native call: the output
// projection, the post-attention norm (Gemma), the residual, the pre-MLP norm, gate and up,
// the activation, down, the post-MLP norm (Gemma) and the residual. A decode step runs 18
// such tails for Gemma 3 270M; as ~15 Python-dispatched operations each they cost more than
// their arithmetic. Each step here is the very operation the Python path calls (the native
// product and norm through the dispatcher, the activation, product and sums as ATen
// operations on the same views), so the result is the same bits as `DecoderLayer.finish`'s.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);

at::Tensor product(const at::Tensor& x, const at::Tensor& tiles, int64_t out) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::bf16_packed_linear", "").typed<Product>();
  return op.call(x, tiles, out, std::nullopt);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& scale, double eps, bool gemma) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::rms_norm", "").typed<Norm>();
  return op.call(x, scale, eps, gemma);
}

// x [N, H] the residual stream's rows, attn [N, q_dim] their attention outputs (both
// contiguous bf16); returns the residual stream after the layer [N, H].
at::Tensor layer_tail(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_tiles, int64_t hidden,
                      const std::optional<at::Tensor>& post_attn_scale, const at::Tensor& pre_mlp_scale,
                      const at::Tensor& gate_up_tiles, int64_t intermediate, const at::Tensor& down_tiles,
                      const std::optional<at::Tensor>& post_mlp_scale, double eps, bool gemma, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && attn.dim() == 2 && attn.size(0) == x.size(0),
              "x [N, hidden] and attn [N, q_dim]");
  at::Tensor out = product(attn, o_tiles, hidden);
  if (post_attn_scale.has_value()) out = norm(out, *post_attn_scale, eps, gemma);
  at::Tensor residual = x + out;
  at::Tensor gate_up = product(norm(residual, pre_mlp_scale, eps, gemma), gate_up_tiles, 2 * intermediate);
  auto halves = gate_up.chunk(2, -1);
  at::Tensor act = (gelu ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1];
  out = product(act, down_tiles, hidden);
  if (post_mlp_scale.has_value()) out = norm(out, *post_mlp_scale, eps, gemma);
  return residual + out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  m.def("layer_tail(Tensor x, Tensor attn, Tensor o_tiles, int hidden, Tensor? post_attn_scale, Tensor pre_mlp_scale, "
        "Tensor gate_up_tiles, int intermediate, Tensor down_tiles, Tensor? post_mlp_scale, float eps, bool gemma, "
        "bool gelu) -> Tensor");
  m.impl("layer_tail", c10::DispatchKey::CPU, TORCH_FN(layer_tail));
}
