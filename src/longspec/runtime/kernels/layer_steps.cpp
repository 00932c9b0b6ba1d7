// A decoder layer's steps around its attention, as two native calls:
// - `layer_head`: the input norm, the q/k/v product, the per-head q/k norm (Qwen3, Gemma 3)
//   and RoPE, as `DecoderLayer.project` computes them;
// - `layer_tail`: the output projection, the post-attention norm (Gemma), the residual, the
//   pre-MLP norm, gate and up, the activation, down, the post-MLP norm (Gemma) and the
//   residual, as `DecoderLayer.finish` computes them.
// A decode step of Gemma 3 270M runs 18 of each; as ~15 Python-dispatched operations each
// they cost more than their arithmetic. Each step here is the very operation the Python
// path calls (the native product and norm through the dispatcher, the rest as ATen
// operations on the same views), so the results are the Python path's bits.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);

at::Tensor product(const at::Tensor& x, const at::Tensor& tiles, int64_t out,
                   const std::optional<at::Tensor>& bias = std::nullopt) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::bf16_packed_linear", "").typed<Product>();
  return op.call(x, tiles, out, bias);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& scale, double eps, bool gemma) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::rms_norm", "").typed<Norm>();
  return op.call(x, scale, eps, gemma);
}

// x [N, H] the residual stream's rows of a [B, T] forward (N = B T, contiguous bf16); cos and
// signed_sin broadcast against [B, heads, T, D]. Returns q [B, Hq, T, D] after RoPE, k after
// RoPE and v [B, Hkv, T, D], laid out as the Python path lays them out.
std::vector<at::Tensor> layer_head(const at::Tensor& x, int64_t batch, const at::Tensor& input_scale,
                                   const at::Tensor& qkv_tiles, const std::optional<at::Tensor>& qkv_bias,
                                   const std::optional<at::Tensor>& qk_scale, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, const at::Tensor& cos, const at::Tensor& signed_sin, double eps,
                                   bool gemma) {
  TORCH_CHECK(x.dim() == 2 && batch > 0 && x.size(0) % batch == 0, "x [B T, H]");
  const int64_t tokens = x.size(0) / batch, qk_dim = (heads + kv_heads) * head_dim, kv_dim = kv_heads * head_dim;
  at::Tensor qkv = product(norm(x, input_scale, eps, gemma), qkv_tiles, qk_dim + kv_dim, qkv_bias).view({batch, tokens, -1});
  at::Tensor qk = qkv.slice(-1, 0, qk_dim).view({batch, tokens, heads + kv_heads, head_dim});
  if (qk_scale.has_value()) qk = norm(qk.contiguous(), *qk_scale, eps, gemma);
  qk = qk.transpose(1, 2);
  at::Tensor rotated = qk * cos + qk.roll(head_dim / 2, -1) * signed_sin;
  auto q_k = rotated.split({heads, kv_heads}, 1);
  at::Tensor v = qkv.slice(-1, qk_dim).view({batch, tokens, kv_heads, head_dim}).transpose(1, 2);
  return {q_k[0], q_k[1], v};
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
  m.def("layer_head(Tensor x, int batch, Tensor input_scale, Tensor qkv_tiles, Tensor? qkv_bias, Tensor? qk_scale, "
        "int heads, int kv_heads, int head_dim, Tensor cos, Tensor signed_sin, float eps, bool gemma) -> Tensor[]");
  m.impl("layer_head", c10::DispatchKey::CPU, TORCH_FN(layer_head));
}
