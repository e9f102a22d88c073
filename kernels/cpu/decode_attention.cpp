// Decode attention over the paged KV cache on the CPU: one query token per sequence, every context read in place.
//
// Work items are (sequence, partition of 256 tokens), spread over OpenMP threads with dynamic
// scheduling, so a batch of very different context lengths costs the sum of its contexts (no padding to the
// longest) and one long context still keeps every core busy. Each item computes, for the query heads of its kv
// head, the partition's scores, their max, the sum of their exponentials and the exp-weighted sum of V; a second
// pass merges the partitions of each (sequence, query head) with the usual log-sum-exp rescaling.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t PARTITION = 256;

template <typename T>
void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Calls fn(i, kvh) for the i-th token from `start` to `end` of one sequence and each kv head, with that head's row
// of the token loaded into `row` as floats. A cache slot holds every kv head of a token side by side, so each slot
// is read whole, once. `start` is on a block boundary.
template <typename T, typename Fn>
void for_each_row(const T* cache, const int32_t* table, int64_t start, int64_t end, int64_t block_size,
                  int64_t num_kv_heads, int64_t head_size, float* __restrict row, Fn&& fn) {
  const int64_t token_stride = num_kv_heads * head_size;
  for (int64_t t0 = start; t0 < end; t0 += block_size) {
    const T* block = cache + static_cast<int64_t>(table[t0 / block_size]) * block_size * token_stride;
    const int64_t n = std::min(block_size, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        load_row(block + j * token_stride + kvh * head_size, row, head_size);
        fn(t0 + j - start, kvh);
      }
    }
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const float fscale = static_cast<float>(scale);

  // Work item i covers partition i - first_item[s] of sequence s = item_seq[i]; its partials go to slot i.
  // A partition starts on a block boundary: it spans PARTITION tokens, or one block when blocks are larger.
  const int64_t partition = std::max(PARTITION, block_size);
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t parts = std::max<int64_t>(1, (lens[s] + partition - 1) / partition);
    first_item[s + 1] = first_item[s] + parts;
  }
  const int64_t num_items = first_item[num_seqs];
  std::vector<int64_t> item_seq(num_items);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t i = first_item[s]; i < first_item[s + 1]; ++i) item_seq[i] = s;
  // Partials, per (item, query head): max score, sum of exp, and the exp-weighted V sum.
  std::vector<float> part_max(num_items * num_heads), part_sum(num_items * num_heads);
  std::vector<float> part_acc(num_items * num_heads * head_size);

#pragma omp parallel
  {
    // Per query head: its scaled query, then the partition's scores (exponentiated in place).
    std::vector<float> qf(num_heads * head_size), row(head_size), scores(num_heads * partition), maxes(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = item_seq[item];
      const int64_t start = (item - first_item[s]) * partition;
      const int64_t end = std::min<int64_t>(lens[s], start + partition);
      const int32_t* table = tables + s * max_blocks;
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* src = q + s * q_seq_stride + h * q_head_stride;
        for (int64_t d = 0; d < head_size; ++d) qf[h * head_size + d] = to_float(src[d]) * fscale;
      }
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      for_each_row(kc, table, start, end, block_size, num_kv_heads, head_size, row.data(), [&](int64_t i, int64_t kvh) {
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          float dot = 0.f;
          const float* qh = qf.data() + h * head_size;
          for (int64_t d = 0; d < head_size; ++d) dot += qh[d] * row[d];
          scores[h * partition + i] = dot;
          maxes[h] = std::max(maxes[h], dot);
        }
      });
      float* acc_item = part_acc.data() + item * num_heads * head_size;
      std::fill_n(acc_item, num_heads * head_size, 0.f);
      for (int64_t h = 0; h < num_heads; ++h) {
        float total = 0.f;
        float* sh = scores.data() + h * partition;
        for (int64_t t = 0; t < end - start; ++t) {
          sh[t] = std::exp(sh[t] - maxes[h]);
          total += sh[t];
        }
        part_max[item * num_heads + h] = maxes[h];
        part_sum[item * num_heads + h] = total;
      }
      for_each_row(vc, table, start, end, block_size, num_kv_heads, head_size, row.data(), [&](int64_t i, int64_t kvh) {
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          const float p = scores[h * partition + i];
          float* acc = acc_item + h * head_size;
          for (int64_t d = 0; d < head_size; ++d) acc[d] += p * row[d];
        }
      });
    }
#pragma omp for collapse(2)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t first = first_item[s];
        merge_partials(first_item[s + 1] - first, part_max.data() + first * num_heads + h,
                       part_sum.data() + first * num_heads + h, num_heads,
                       part_acc.data() + (first * num_heads + h) * head_size, num_heads * head_size, head_size,
                       row.data(), out.data_ptr<T>() + (s * num_heads + h) * head_size);
      }
    }
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_heads, head_size], last dim dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32, contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32, contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, scale, out);
  });
  return out;
}
