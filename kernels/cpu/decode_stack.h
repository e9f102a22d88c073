// DecodeStack (decode_stack.cpp): a decode step's Llama-family layers in one call.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

// One part of an a8 projection, as spindle.kernels.linear.Projection keeps it: a8_pack's tensors, the part's group
// size and output rows.
struct A8Part {
  at::Tensor packed, scales;
  std::optional<at::Tensor> offsets, supers;
  int64_t group_size, outputs;
};
using A8PartArgs = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, int64_t,
                              int64_t>;

// A projection as the stack runs it: a8_linear's parts, or else bf16_linear's tiles, or else a dense weight (oneDNN's
// packed layout, or a plain [out, in] one for ATen's linear); its output rows and bias.
struct StackProjection {
  std::vector<A8Part> parts;
  at::Tensor tiles, weight;
  bool onednn = false;  // whether `weight` is oneDNN's packed layout
  int64_t out_features = 0;
  std::optional<at::Tensor> bias;

  static StackProjection a8(const std::vector<A8PartArgs>& parts, const std::optional<at::Tensor>& bias);
  static StackProjection bf16(const at::Tensor& tiles, int64_t outputs, const std::optional<at::Tensor>& bias);
  static StackProjection dense(const at::Tensor& weight, bool onednn, int64_t outputs,
                               const std::optional<at::Tensor>& bias);
};

class DecodeStack {
 public:
  // The model's attention shapes, softmax scale, RMSNorm epsilon and rotary cos/sin cache.
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double scale, double eps,
              const at::Tensor& cos_sin_cache);

  // Appends a layer's attention: its two norms' weights, its qkv and o projections, its KV cache and its sliding
  // window (0 for none). Its MLP follows (add_dense_mlp or add_moe_mlp).
  void add_attention(const at::Tensor& input_norm, const at::Tensor& post_norm, const StackProjection& qkv,
                     const StackProjection& o, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t window);
  // The last layer's MLP: gate/up, SiLU-and-mul, down.
  void add_dense_mlp(const StackProjection& gate_up, const StackProjection& down);
  // The last layer's MLP: its router's top_k experts per token (softmax weights, of the top-k logits where
  // renormalize), through fused_moe's tiled or plain expert stacks.
  void add_moe_mlp(const at::Tensor& router, int64_t top_k, bool renormalize, const at::Tensor& w13,
                   const at::Tensor& w2, int64_t num_experts, int64_t intermediate, bool tiled);
  // The same with quantized experts laid out by a8_pack and stacked (fused_moe_a8's w13 and w2, int8 activations).
  void add_moe_a8_mlp(const at::Tensor& router, int64_t top_k, bool renormalize,
                      const std::vector<std::optional<at::Tensor>>& w13, int64_t w13_group_size,
                      const std::vector<std::optional<at::Tensor>>& w2, int64_t w2_group_size, int64_t intermediate);

  // Runs every layer over `hidden` [tokens, hidden_size], one token per sequence, writing each token's K/V into the
  // caches; returns the last layer's output and the residual stream, not yet summed (the final norm adds them).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens);

 private:
  struct Moe {
    at::Tensor router, w13, w2;
    int64_t top_k, num_experts, intermediate;
    bool renormalize, tiled;
    std::vector<std::optional<at::Tensor>> a8_w13, a8_w2;  // a8_pack's stacks where the experts run fused_moe_a8
    int64_t a8_w13_group_size = 0, a8_w2_group_size = 0;
  };
  struct Layer {
    at::Tensor input_norm, post_norm;
    StackProjection qkv, o;
    at::Tensor k_cache, v_cache;
    int64_t window;
    std::optional<StackProjection> gate_up, down;  // a dense MLP's, or
    std::optional<Moe> moe;                        // a mixture of experts
  };
  at::Tensor mlp(const Layer& layer, const at::Tensor& x) const;

  int64_t num_heads_, num_kv_heads_, head_size_;
  double scale_, eps_;
  at::Tensor cos_sin_cache_;
  std::vector<Layer> layers_;
};
