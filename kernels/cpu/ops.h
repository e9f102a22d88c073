// The kernels' entry points, each defined in its own file: what bindings.cpp exposes to Python, and what one kernel
// calls of another (decode_stack.cpp, moe.cpp, cache.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                               double softcap);
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, double scale, int64_t window, double softcap);
at::Tensor argmax_rows(const at::Tensor& x);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping);
at::Tensor rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value, const at::Tensor& cos_sin_cache, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps);
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
bool bf16_linear_supported();
at::Tensor bf16_pack(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t outputs,
                       const std::optional<at::Tensor>& bias);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, int64_t group_size);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size);
void dequantize_rows(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                     int64_t group_size, const at::Tensor& ids, const at::Tensor& out);
bool a8_linear_supported();
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> a8_pack(
    const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros, int64_t group_size,
    const std::optional<at::Tensor>& super_scales);
at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& supers,
                     int64_t group_size, int64_t outputs, const std::optional<at::Tensor>& out);
// Rows [starts[w], starts[w + 1]) of x against weight w of a stack of a8_pack's tensors ([weights, ...] each).
at::Tensor a8_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& supers,
                      int64_t group_size, int64_t outputs, const std::vector<int64_t>& starts);
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, int64_t group_size, const std::optional<at::Tensor>& bias);
bool w8a8_supported();
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& qweight);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sums, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
               const at::Tensor& segments, const std::vector<int64_t>& part_ends, const at::Tensor& ranks);
at::Tensor moe_pack(const at::Tensor& weights);
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, int64_t num_experts, int64_t intermediate, bool tiled);
// Experts packed by a8_pack and stacked ([experts, ...] each of packed, scales, offsets, supers): each expert's rows
// through a8_grouped's gate/up, SiLU-and-mul and down, then each token's outputs weighted and summed.
at::Tensor fused_moe_a8(const at::Tensor& x, const std::vector<std::optional<at::Tensor>>& w13, int64_t w13_group_size,
                        const std::vector<std::optional<at::Tensor>>& w2, int64_t w2_group_size,
                        int64_t intermediate, const at::Tensor& topk_weights, const at::Tensor& topk_ids);
at::Tensor fused_moe_quantized(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scales,
                               const std::optional<at::Tensor>& w13_zeros, int64_t w13_group_size,
                               const at::Tensor& w2, const at::Tensor& w2_scales,
                               const std::optional<at::Tensor>& w2_zeros, int64_t w2_group_size,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids);
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool renormalize);
