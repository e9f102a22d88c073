// DecodeStack (decode_stack.cpp): a decode step's Llama-family layers of a8_linear projections in one call.
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

// A projection's parts, their output rows in all, and its bias.
struct A8Projection {
  std::vector<A8Part> parts;
  int64_t out_features;
  std::optional<at::Tensor> bias;
};

class DecodeStack {
 public:
  // The model's attention shapes, softmax scale, RMSNorm epsilon and rotary cos/sin cache.
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double scale, double eps,
              const at::Tensor& cos_sin_cache);

  // Appends a layer: its two norms' weights, its projections' parts (qkv with its bias), its KV cache and its sliding
  // window (0 for none).
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const std::vector<A8PartArgs>& qkv,
                 const std::optional<at::Tensor>& qkv_bias, const std::vector<A8PartArgs>& o,
                 const std::vector<A8PartArgs>& gate_up, const std::vector<A8PartArgs>& down,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t window);

  // Runs every layer over `hidden` [tokens, hidden_size], one token per sequence, writing each token's K/V into the
  // caches; returns the last layer's output and the residual stream, not yet summed (the final norm adds them).
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens);

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    A8Projection qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;
    int64_t window;
  };
  int64_t num_heads_, num_kv_heads_, head_size_;
  double scale_, eps_;
  at::Tensor cos_sin_cache_;
  std::vector<Layer> layers_;
};
