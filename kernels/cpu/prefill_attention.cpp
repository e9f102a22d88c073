// Prefill attention over the paged KV cache on the CPU: the query tokens of each prefill chunk attend causally over
// their sequence's context (the cached prefix and the chunk itself), which is read where it lies in the cache.
//
// A work item is (chunk, kv head, tile of query positions): its rows are those positions times the query
// heads of the kv head, and it walks the keys up to its last position in tiles of KEY_TILE with an online softmax
// (flash attention's running max and sum), so nothing of the context is gathered or padded and no mask is built.
// Each key tile is converted to float once per item, K transposed, so that both products vectorize over a tile's
// keys (Q.K) or over the head dimension (P.V) without horizontal sums, and is reused by every row of the item.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <omp.h>

#include "common.h"

namespace {

// Query positions per work item, at most: larger tiles convert each key tile for more rows (bf16, 9/3 heads, 2 cores,
// a 512-token chunk after 500 cached: 10 ms at 64 positions, 16 ms at 16), but a chunk must still split into enough
// items to keep every thread busy, so short chunks get smaller tiles, down to MIN_QUERY_TILE (below it each item
// converts the whole context for too few rows: 4 positions after 7,000 cached took 4.5 ms in tiles of 1, 2.3 in one).
constexpr int64_t MAX_QUERY_TILE = 64;
constexpr int64_t MIN_QUERY_TILE = 16;
constexpr int64_t ITEMS_PER_THREAD = 4;
// When the tiles are still too few for the threads (a short chunk after a long prefix), each tile's keys split into
// ranges of at least this many, whose partial softmax states are merged afterwards, as flash-decoding does.
constexpr int64_t MIN_SPLIT_KEYS = 512;
constexpr int64_t KEY_TILE = 32;
constexpr int64_t ROW_BLOCK = 4;
// The head size of the generic instantiation's buffers: the largest it accepts.
constexpr int64_t MAX_HEAD = 256;

struct Item {
  int64_t chunk, kv_head, first_row;
};

// HEAD is the head size when it is known at compile time (the loops over it then unroll and vectorize), or MAX_HEAD
// for any smaller head size: buffers then have rows of MAX_HEAD floats, and the padding stays zero.
template <typename T, int64_t HEAD>
void prefill_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_chunks = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  // The tiles nearest the end of a chunk walk the most keys: they go first, so the dynamic schedule ends balanced.
  const int64_t wanted_items = ITEMS_PER_THREAD * omp_get_max_threads();
  const int64_t query_tile =
      std::clamp<int64_t>((starts[num_chunks] - starts[0]) * num_kv_heads / wanted_items, MIN_QUERY_TILE, MAX_QUERY_TILE);
  std::vector<Item> items;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t r = (starts[c + 1] - starts[c] - 1) / query_tile * query_tile; r >= 0; r -= query_tile)
      for (int64_t g = 0; g < num_kv_heads; ++g) items.push_back({c, g, r});
  if (items.empty()) return;
  const int64_t longest = *std::max_element(lens, lens + num_chunks);
  const int64_t splits = std::clamp<int64_t>(wanted_items / static_cast<int64_t>(items.size()), 1,
                                             std::max<int64_t>(1, longest / MIN_SPLIT_KEYS));
  const int64_t num_work = static_cast<int64_t>(items.size()) * splits;
  // Row r of an item is query position first_row + r / group, head kv_head * group + r % group.
  auto output_row = [&](const Item& item, int64_t r) {
    return o + (starts[item.chunk] - starts[0] + item.first_row + r / group) * num_heads * head_size +
           (item.kv_head * group + r % group) * head_size;
  };
  auto item_rows = [&](const Item& item) {
    return std::min(query_tile, starts[item.chunk + 1] - starts[item.chunk] - item.first_row) * group;
  };

  // Rows are processed ROW_BLOCK at a time, so that one load of a key tile's values serves that many rows and the
  // block's scores and outputs stay in registers; the query rows are padded to whole blocks with zeros.
  const int64_t max_rows = (query_tile * group + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
  // Partial states of split work, per (work, row): the running max, the sum of exponentials, the unnormalized output.
  std::vector<float> part_max, part_sum, part_acc;
  if (splits > 1) {
    part_max.resize(num_work * max_rows);
    part_sum.resize(num_work * max_rows);
    part_acc.resize(num_work * max_rows * HEAD);
  }
#pragma omp parallel
  {
    std::vector<float> qf(max_rows * HEAD), acc(max_rows * HEAD), row_max(max_rows), row_sum(max_rows);
    std::vector<float> kt(HEAD * KEY_TILE), vf(KEY_TILE * HEAD);
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < num_work; ++work) {
      const Item item = items[work / splits];
      const int64_t chunk_len = starts[item.chunk + 1] - starts[item.chunk];
      const int64_t context = lens[item.chunk] - chunk_len;  // tokens cached before the chunk
      const int64_t num_positions = std::min(query_tile, chunk_len - item.first_row);
      const int64_t rows = item_rows(item);
      const int64_t padded_rows = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
      const int32_t* table = tables + item.chunk * max_blocks;
      std::fill_n(qf.data(), padded_rows * HEAD, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = q + (starts[item.chunk] - starts[0] + item.first_row + r / group) * q_token_stride +
                       (item.kv_head * group + r % group) * q_head_stride;
        for (int64_t d = 0; d < head_size; ++d) qf[r * HEAD + d] = to_float(src[d]) * fscale;
      }
      std::fill_n(acc.data(), padded_rows * HEAD, 0.f);
      std::fill_n(row_max.data(), padded_rows, -std::numeric_limits<float>::infinity());
      std::fill_n(row_sum.data(), padded_rows, 0.f);
      // This work's share of the keys up to the tile's last position: a range of whole key tiles.
      const int64_t key_end = context + item.first_row + num_positions;
      const int64_t num_key_tiles = (key_end + KEY_TILE - 1) / KEY_TILE, split = work % splits;
      const int64_t k_begin = split * num_key_tiles / splits * KEY_TILE;
      const int64_t k_stop = std::min(key_end, (split + 1) * num_key_tiles / splits * KEY_TILE);
      for (int64_t k0 = k_begin; k0 < k_stop; k0 += KEY_TILE) {
        const int64_t num_keys = std::min(KEY_TILE, k_stop - k0);
        for (int64_t j = 0; j < num_keys; ++j) {
          const int64_t token = k0 + j;
          const int64_t slot = static_cast<int64_t>(table[token / block_size]) * block_size + token % block_size;
          const T* k_src = kc + slot * token_stride + item.kv_head * head_size;
          const T* v_src = vc + slot * token_stride + item.kv_head * head_size;
          for (int64_t d = 0; d < head_size; ++d) {
            kt[d * KEY_TILE + j] = to_float(k_src[d]);
            vf[j * HEAD + d] = to_float(v_src[d]);
          }
        }
        for (int64_t j = num_keys; j < KEY_TILE; ++j) {
          for (int64_t d = 0; d < HEAD; ++d) kt[d * KEY_TILE + j] = 0.f;
          for (int64_t d = 0; d < HEAD; ++d) vf[j * HEAD + d] = 0.f;
        }
        for (int64_t r0 = 0; r0 < padded_rows; r0 += ROW_BLOCK) {
          // Scores of the block's rows against the tile: ROW_BLOCK x KEY_TILE accumulators.
          float s[ROW_BLOCK][KEY_TILE] = {};
          for (int64_t d = 0; d < head_size; ++d) {
            const float* kd = kt.data() + d * KEY_TILE;
            for (int64_t b = 0; b < ROW_BLOCK; ++b) {
              const float qd = qf[(r0 + b) * HEAD + d];
#pragma omp simd
              for (int64_t j = 0; j < KEY_TILE; ++j) s[b][j] += qd * kd[j];
            }
          }
          float rescale[ROW_BLOCK];
          for (int64_t b = 0; b < ROW_BLOCK; ++b) {
            const int64_t r = r0 + b;
            // Keys of this tile that row r may see: up to its own position (none for a padding row).
            const int64_t visible =
                r < rows ? std::min(num_keys, context + item.first_row + r / group - k0 + 1) : int64_t{0};
            float tile_max = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, s[b][j]);
            const float new_max = std::max(row_max[r], tile_max);
            rescale[b] = visible > 0 ? std::exp(row_max[r] - new_max) : 1.f;
            float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
            for (int64_t j = 0; j < KEY_TILE; ++j) {
              const float p = j < visible ? std::exp(s[b][j] - new_max) : 0.f;
              s[b][j] = p;
              tile_sum += p;
            }
            if (visible > 0) row_max[r] = new_max;
            row_sum[r] = row_sum[r] * rescale[b] + tile_sum;
          }
          float out_block[ROW_BLOCK][HEAD];
          for (int64_t b = 0; b < ROW_BLOCK; ++b)
            for (int64_t d = 0; d < HEAD; ++d) out_block[b][d] = acc[(r0 + b) * HEAD + d] * rescale[b];
          for (int64_t j = 0; j < num_keys; ++j) {
            const float* vj = vf.data() + j * HEAD;
            for (int64_t b = 0; b < ROW_BLOCK; ++b) {
              const float p = s[b][j];
#pragma omp simd
              for (int64_t d = 0; d < HEAD; ++d) out_block[b][d] += p * vj[d];
            }
          }
          for (int64_t b = 0; b < ROW_BLOCK; ++b)
            for (int64_t d = 0; d < HEAD; ++d) acc[(r0 + b) * HEAD + d] = out_block[b][d];
        }
      }
      if (splits > 1) {
        std::copy_n(row_max.data(), rows, part_max.data() + work * max_rows);
        std::copy_n(row_sum.data(), rows, part_sum.data() + work * max_rows);
        std::copy_n(acc.data(), rows * HEAD, part_acc.data() + work * max_rows * HEAD);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / row_sum[r];  // every row sees at least its own key
        T* dst = output_row(item, r);
        for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<T>(acc[r * HEAD + d] * inv);
      }
    }
    if (splits > 1) {
      // A split past a row's position saw none of its keys: its max stayed -inf and it weighs nothing.
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < items.size(); ++i) {
        const int64_t rows = item_rows(items[i]);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = i * splits * max_rows + r;
          merge_partials(splits, part_max.data() + at, part_sum.data() + at, max_rows, part_acc.data() + at * HEAD,
                         max_rows * HEAD, head_size, acc.data(), output_row(items[i], r));
        }
      }
    }
  }
}

}  // namespace

// query [num_tokens, num_heads, head_size]: the tokens of every chunk, chunk c's at rows query_start_loc[c] -
// query_start_loc[0] onwards (so a slice of a whole step's boundaries will do); seq_lens[c] counts chunk c's cached
// prefix and its own tokens, whose K/V must already be in the cache; block_tables[c] holds its blocks.
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_tokens, num_heads, head_size], last dim dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32, contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "query_start_loc: int32, contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32, contiguous");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "one query_start_loc boundary, block table row and seq_len per chunk");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) <= MAX_HEAD, "head_size must be at most ", MAX_HEAD);
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  DISPATCH_MODEL_TYPES(query.scalar_type(), "prefill_attention", [&] {
    switch (query.size(2)) {
      case 64:
        prefill_attention_impl<scalar_t, 64>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out);
        break;
      case 128:
        prefill_attention_impl<scalar_t, 128>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out);
        break;
      default:
        prefill_attention_impl<scalar_t, MAX_HEAD>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out);
    }
  });
  return out;
}
