// A decode step's decoder layers in one call: every token is its sequence's one new token, and each layer is a plain
// Llama-family layer (or Mixtral's, its MLP a mixture of experts, tiled or quantized by a8_pack) whose projections run
// a8_linear, bf16_linear or a dense linear (oneDNN's over its packed weight, or ATen's). Per layer, the same ops the
// Python layers call, in the same order (the input norm with the previous layer's residual add, qkv and its bias,
// rotary and cache write, decode attention, o, the post-attention norm, then gate/up, SiLU-and-mul and down, or the
// router's top-k and the fused experts), so results are the same bit for bit; what goes is the Python and the
// argument conversions between them, about 25 us a layer at one token on two cores (bench/results/single_stream.md).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <optional>
#include <tuple>
#include <vector>

#include "decode_stack.h"
#include "ops.h"

namespace {

// oneDNN's linear over its packed weight, the op spindle.kernels.linear.Projection calls for one
// (torch.ops.mkldnn._linear_pointwise, no post-op), looked up once in torch's dispatcher.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// As spindle.kernels.linear.Projection runs the projection: bf16_linear with its bias; oneDNN's or ATen's linear with
// its bias; or a8_linear, one part into a new tensor, several each into its columns of one, then the bias.
at::Tensor project(const at::Tensor& x, const StackProjection& projection) {
  if (projection.tiles.defined()) return bf16_linear(x, projection.tiles, projection.out_features, projection.bias);
  if (projection.weight.defined())
    return projection.onednn ? onednn_linear(x, projection.weight, projection.bias)
                             : at::linear(x, projection.weight, projection.bias);
  at::Tensor out;
  if (projection.parts.size() == 1) {
    const A8Part& p = projection.parts[0];
    out = a8_linear(x, p.packed, p.scales, p.offsets, p.supers, p.group_size, p.outputs, std::nullopt);
  } else {
    out = at::empty({x.size(0), projection.out_features}, x.options());
    int64_t start = 0;
    for (const A8Part& p : projection.parts) {
      a8_linear(x, p.packed, p.scales, p.offsets, p.supers, p.group_size, p.outputs, out.narrow(1, start, p.outputs));
      start += p.outputs;
    }
  }
  return projection.bias ? at::add(out, *projection.bias) : out;
}

}  // namespace

StackProjection StackProjection::a8(const std::vector<A8PartArgs>& parts, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!parts.empty(), "an a8 projection needs at least one part");
  StackProjection projection;
  for (const auto& [packed, scales, offsets, supers, group_size, outputs] : parts) {
    projection.parts.push_back({packed, scales, offsets, supers, group_size, outputs});
    projection.out_features += outputs;
  }
  projection.bias = bias;
  return projection;
}

StackProjection StackProjection::bf16(const at::Tensor& tiles, int64_t outputs, const std::optional<at::Tensor>& bias) {
  StackProjection projection;
  projection.tiles = tiles;
  projection.out_features = outputs;
  projection.bias = bias;
  return projection;
}

StackProjection StackProjection::dense(const at::Tensor& weight, bool onednn, int64_t outputs,
                                       const std::optional<at::Tensor>& bias) {
  StackProjection projection;
  projection.weight = weight;
  projection.onednn = onednn;
  projection.out_features = outputs;
  projection.bias = bias;
  return projection;
}

DecodeStack::DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double scale, double eps,
                         const at::Tensor& cos_sin_cache)
    : num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_size_(head_size),
      scale_(scale),
      eps_(eps),
      cos_sin_cache_(cos_sin_cache) {}

void DecodeStack::add_attention(const at::Tensor& input_norm, const at::Tensor& post_norm,
                                const StackProjection& qkv, const StackProjection& o, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, int64_t window) {
  const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
  TORCH_CHECK(qkv.out_features == q_size + 2 * kv_size, "qkv has ", qkv.out_features, " outputs, not ",
              q_size + 2 * kv_size);
  TORCH_CHECK(layers_.empty() || layers_.back().gate_up || layers_.back().moe, "the last layer has no MLP yet");
  layers_.push_back({input_norm, post_norm, qkv, o, k_cache, v_cache, window, std::nullopt, std::nullopt, std::nullopt});
}

void DecodeStack::add_dense_mlp(const StackProjection& gate_up, const StackProjection& down) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up && !layers_.back().moe, "an MLP follows an attention");
  layers_.back().gate_up = gate_up;
  layers_.back().down = down;
}

void DecodeStack::add_moe_mlp(const at::Tensor& router, int64_t top_k, bool renormalize, const at::Tensor& w13,
                              const at::Tensor& w2, int64_t num_experts, int64_t intermediate, bool tiled) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up && !layers_.back().moe, "an MLP follows an attention");
  layers_.back().moe = Moe{router, w13, w2, top_k, num_experts, intermediate, renormalize, tiled};
}

void DecodeStack::add_moe_a8_mlp(const at::Tensor& router, int64_t top_k, bool renormalize,
                                 const std::vector<std::optional<at::Tensor>>& w13, int64_t w13_group_size,
                                 const std::vector<std::optional<at::Tensor>>& w2, int64_t w2_group_size,
                                 int64_t intermediate) {
  TORCH_CHECK(!layers_.empty() && !layers_.back().gate_up && !layers_.back().moe, "an MLP follows an attention");
  TORCH_CHECK(w13.size() == 4 && w2.size() == 4 && w13[0], "w13 and w2 are a8_pack's four tensors, stacked");
  Moe moe{router, {}, {}, top_k, w13[0]->size(0), intermediate, renormalize, false};
  moe.a8_w13 = w13;
  moe.a8_w2 = w2;
  moe.a8_w13_group_size = w13_group_size;
  moe.a8_w2_group_size = w2_group_size;
  layers_.back().moe = std::move(moe);
}

// As spindle.kernels.moe.route_tokens and Experts run it: the routing op, then the fused experts.
at::Tensor DecodeStack::mlp(const Layer& layer, const at::Tensor& x) const {
  if (layer.gate_up) return project(silu_and_mul(project(x, *layer.gate_up)), *layer.down);
  const Moe& moe = *layer.moe;
  const auto [weights, ids] = moe_route(x, moe.router, moe.top_k, moe.renormalize);
  if (!moe.a8_w13.empty()) {
    return fused_moe_a8(x, moe.a8_w13, moe.a8_w13_group_size, moe.a8_w2, moe.a8_w2_group_size, moe.intermediate,
                        weights, ids);
  }
  return fused_moe(x, moe.w13, moe.w2, weights, ids, moe.num_experts, moe.intermediate, moe.tiled);
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::run(const at::Tensor& hidden, const at::Tensor& positions,
                                                    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                    const at::Tensor& seq_lens) {
  TORCH_CHECK(hidden.dim() == 2 && positions.size(0) == hidden.size(0), "hidden must be [tokens, hidden_size]");
  const int64_t tokens = hidden.size(0), q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
  at::Tensor x = hidden, residual;
  TORCH_CHECK(layers_.empty() || layers_.back().gate_up || layers_.back().moe, "the last layer has no MLP");
  for (Layer& layer : layers_) {
    at::Tensor normed;
    if (residual.defined()) {
      std::tie(normed, residual) = add_rms_norm(x, residual, layer.input_norm, eps_);
    } else {
      residual = x;
      normed = rms_norm(x, layer.input_norm, eps_);
    }
    const at::Tensor qkv = project(normed, layer.qkv);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_size_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_size_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_size_});
    const at::Tensor rotated =
        rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache_, layer.k_cache, layer.v_cache, slot_mapping);
    const at::Tensor attended =
        decode_attention(rotated, layer.k_cache, layer.v_cache, block_tables, seq_lens, scale_, layer.window, 0.0);
    const at::Tensor o = project(attended.view({tokens, q_size}), layer.o);
    std::tie(normed, residual) = add_rms_norm(o, residual, layer.post_norm, eps_);
    x = mlp(layer, normed);
  }
  return {x, residual};
}
