// The cache write on the CPU: each new token's key and value heads copied into their paged cache slot.
//
// torch's index_copy_ took 22-42 us a call for a batch-64 decode step's keys (64 tokens x 3 heads x 64 floats, a
// view into the fused qkv rows) on 2 AVX2 cores (Zen 3), up to 2.5 ms a step over 30 layers' keys and values; this
// copies each head's row where it lies, ~7 us a call.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#include "ops.h"

namespace {

void check_source(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, " must be [num_tokens, num_kv_heads, head_size], last dim dense");
  TORCH_CHECK(x.size(1) == cache.size(2) && x.size(2) == cache.size(3), name, " heads do not match the cache's");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " and the cache must share a dtype");
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be contiguous [num_blocks, block_size, num_kv_heads, head_size] of one shape and dtype");
  check_source(key, k_cache, "key");
  check_source(value, v_cache, "value");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be int64 [num_tokens], one slot per key and value row");
  const int64_t tokens = key.size(0), heads = key.size(1);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t element = key.element_size();
  const int64_t row = key.size(2) * element;  // one head's bytes
  const int64_t slot_bytes = heads * row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " of token ", t, " is outside the cache");
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + slots[t] * slot_bytes + h * row, k + (t * key.stride(0) + h * key.stride(1)) * element, row);
      std::memcpy(vc + slots[t] * slot_bytes + h * row, v + (t * value.stride(0) + h * value.stride(1)) * element, row);
    }
  }
}

// The rotary embedding of the query and key heads (elementwise.cpp's), then the rotated keys and the values written to
// their slots; returns the rotated query. One call of the extension in place of two: a call's argument conversions
// and Python wrapper cost about as much as a decode step's rotation and cache write of one token (~1.5 us a layer).
at::Tensor rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value, const at::Tensor& cos_sin_cache, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  auto [rotated_query, rotated_key] = rotary_embedding(positions, query, key, cos_sin_cache);
  reshape_and_cache(rotated_key, value, k_cache, v_cache, slot_mapping);
  return rotated_query;
}
