// A decoder layer's steps around its attention, as two native calls:
// - `layer_head`: the input norm, the q/k/v product, the per-head q/k norm (Qwen3, Gemma 3)
//   and RoPE, as `DecoderLayer.project` computes them;
// - `layer_tail`: the output projection, the post-attention norm (Gemma), the residual, the
//   pre-MLP norm, gate and up, the activation, down, the post-MLP norm (Gemma) and the
//   residual, as `DecoderLayer.finish` computes them.
// A decode step of Gemma 3 270M runs 18 of each; as ~15 Python-dispatched operations each
// they cost more than their arithmetic. Each step here is the very operation the Python
// path calls (the native product, over bf16 packed tiles or a GGUF quantized weight, and
// the native norm through the dispatcher, the rest as ATen operations on the same views),
// so the results are the Python path's bits.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using QuantizedProduct = at::Tensor(const at::Tensor&, std::vector<at::Tensor>, std::vector<int64_t>,
                                    std::vector<int64_t>, const std::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);

// The kind that marks a weight as the bf16 kernel's packed tiles; any other kinds are
// GGUF's (a `QuantizedWeight`'s segments, `gguf_linear`).
constexpr int64_t kPackedBf16 = -1;

// A layer product's weight as the schema passes it: parts, their kinds and output rows.
// bf16: one part (the packed tiles), kinds [-1], rows [out]; quantized: the segments.
struct Weight {
  at::ArrayRef<at::Tensor> parts;
  at::ArrayRef<int64_t> kinds, rows;

  int64_t out() const {
    int64_t n = 0;
    for (int64_t r : rows) n += r;
    return n;
  }
};

Weight weight_of(const at::TensorList& parts, at::IntArrayRef kinds, at::IntArrayRef rows, const char* name) {
  TORCH_CHECK(!parts.empty() && parts.size() == kinds.size() && kinds.size() == rows.size(), name,
              ": one kind and one row count per part");
  TORCH_CHECK(kinds[0] != kPackedBf16 || parts.size() == 1, name, ": a bf16 weight is one part (its packed tiles)");
  return {parts, kinds, rows};
}

// The product the Python path runs for this weight: `bf16_packed_linear` or `gguf_linear`.
at::Tensor product(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias = std::nullopt) {
  if (w.kinds[0] == kPackedBf16) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::bf16_packed_linear", "").typed<Product>();
    return op.call(x, w.parts[0], w.rows[0], bias);
  }
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::gguf_linear", "").typed<QuantizedProduct>();
  return op.call(x, w.parts.vec(), w.kinds.vec(), w.rows.vec(), bias);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& scale, double eps, bool gemma) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("longspec_native::rms_norm", "").typed<Norm>();
  return op.call(x, scale, eps, gemma);
}

// x [N, H] the residual stream's rows of a [B, T] forward (N = B T, contiguous bf16); cos and
// signed_sin broadcast against [B, heads, T, D]. Returns q [B, Hq, T, D] after RoPE, k after
// RoPE and v [B, Hkv, T, D], laid out as the Python path lays them out.
std::vector<at::Tensor> layer_head(const at::Tensor& x, int64_t batch, const at::Tensor& input_scale,
                                   at::TensorList qkv_parts, at::IntArrayRef qkv_kinds, at::IntArrayRef qkv_rows,
                                   const std::optional<at::Tensor>& qkv_bias,
                                   const std::optional<at::Tensor>& qk_scale, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, const at::Tensor& cos, const at::Tensor& signed_sin, double eps,
                                   bool gemma) {
  TORCH_CHECK(x.dim() == 2 && batch > 0 && x.size(0) % batch == 0, "x [B T, H]");
  const Weight qkv_weight = weight_of(qkv_parts, qkv_kinds, qkv_rows, "qkv");
  const int64_t tokens = x.size(0) / batch, qk_dim = (heads + kv_heads) * head_dim, kv_dim = kv_heads * head_dim;
  TORCH_CHECK(qkv_weight.out() == qk_dim + kv_dim, "qkv: ", qkv_weight.out(), " output rows where the heads need ",
              qk_dim + kv_dim);
  at::Tensor qkv = product(norm(x, input_scale, eps, gemma), qkv_weight, qkv_bias).view({batch, tokens, -1});
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
at::Tensor layer_tail(const at::Tensor& x, const at::Tensor& attn, at::TensorList o_parts, at::IntArrayRef o_kinds,
                      at::IntArrayRef o_rows, const std::optional<at::Tensor>& post_attn_scale,
                      const at::Tensor& pre_mlp_scale, at::TensorList gate_up_parts, at::IntArrayRef gate_up_kinds,
                      at::IntArrayRef gate_up_rows, at::TensorList down_parts, at::IntArrayRef down_kinds,
                      at::IntArrayRef down_rows, const std::optional<at::Tensor>& post_mlp_scale, double eps,
                      bool gemma, bool gelu) {
  const Weight o = weight_of(o_parts, o_kinds, o_rows, "o"), down = weight_of(down_parts, down_kinds, down_rows, "down");
  const Weight gate_up = weight_of(gate_up_parts, gate_up_kinds, gate_up_rows, "gate_up");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(x.dim() == 2 && attn.dim() == 2 && attn.size(0) == x.size(0), "x [N, hidden] and attn [N, q_dim]");
  TORCH_CHECK(o.out() == hidden && down.out() == hidden && gate_up.out() % 2 == 0,
              "o and down give the hidden size's rows, gate_up an even number");
  at::Tensor out = product(attn, o);
  if (post_attn_scale.has_value()) out = norm(out, *post_attn_scale, eps, gemma);
  at::Tensor residual = x + out;
  at::Tensor gate_up_out = product(norm(residual, pre_mlp_scale, eps, gemma), gate_up);
  auto halves = gate_up_out.chunk(2, -1);
  at::Tensor act = (gelu ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1];
  out = product(act, down);
  if (post_mlp_scale.has_value()) out = norm(out, *post_mlp_scale, eps, gemma);
  return residual + out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longspec_native, m) {
  // Each product's weight: parts, kinds and rows; kinds [-1] is the bf16 kernel's packed tiles
  // (rows [out]), other kinds a quantized weight's segments as `gguf_linear` takes them.
  m.def("layer_tail(Tensor x, Tensor attn, Tensor[] o, int[] o_kinds, int[] o_rows, Tensor? post_attn_scale, "
        "Tensor pre_mlp_scale, Tensor[] gate_up, int[] gate_up_kinds, int[] gate_up_rows, Tensor[] down, "
        "int[] down_kinds, int[] down_rows, Tensor? post_mlp_scale, float eps, bool gemma, bool gelu) -> Tensor");
  m.impl("layer_tail", c10::DispatchKey::CPU, TORCH_FN(layer_tail));
  m.def("layer_head(Tensor x, int batch, Tensor input_scale, Tensor[] qkv, int[] qkv_kinds, int[] qkv_rows, "
        "Tensor? qkv_bias, Tensor? qk_scale, int heads, int kv_heads, int head_dim, Tensor cos, Tensor signed_sin, "
        "float eps, bool gemma) -> Tensor[]");
  m.impl("layer_head", c10::DispatchKey::CPU, TORCH_FN(layer_head));
}
