// Batched LoRA deltas on the CPU: y[t] += (x[t] @ A[s].T) @ B.T[s] for the tokens of each segment, a run of
// consecutive tokens that use adapter slot s, in place; tokens in no segment (the base model's) are not touched.
//
// Why not torch: a step's deltas are 2 small matmuls per projection and adapter (SmolLM2 at rank 8: [8, 576] x
// [576, 24] and the like), and on 2 EPYC cores each bf16 matmul costs 20-30 us of oneDNN overhead whatever its size.
// Measured over SmolLM2's 120 adapted projections, rank 8, bf16, 2 cores (ms per step; `python -m bench.lora
// --formulations`): base projections / two matmuls per segment / gather-bmm (each token's A and B gathered) / one
// masked matmul pair over all 4 slots, oneDNN-packed / this kernel:
//   decode 32 tokens, 4 adapters    26.0 / 28.9 / 47.6 /  9.5 /  3.2
//   decode 64 tokens, 4 adapters    42.6 / 29.8 / 90.1 / 13.2 /  5.6
//   decode 64 tokens, 1 adapter     45.4 / 10.7 /  119 / 14.2 /  3.7
//   prefill 512 tokens, 1 adapter    282 / 26.3 /    - / 72.4 / 24.5
//   prefill 512 tokens, 4 adapters   273 / 52.1 /    - / 49.6 / 22.9
//
// The tokens of a segment go in blocks of up to 8, which share every weight load (an accumulator register each). The
// shrink runs over the blocks, the expand over (block, 256-column tile) items; both in float32, x and the weights
// read as stored (float32 or bfloat16), y rounded once. Only each slot's own ranks are computed: a fused projection's
// B is block-diagonal (a part's columns read its own rank block), and an adapter's rank pads to the slot's with
// zeros: the kernel skips both.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t LANES = 16;         // floats in one AVX-512 register
constexpr int MAX_BLOCK = 8;          // tokens that share each weight load
constexpr int64_t COLUMN_TILE = 256;  // output columns per expand work item
// Below this many multiply-adds a call takes microseconds, less than waking the OpenMP threads.
constexpr int64_t PARALLEL_WORK = 1 << 18;

struct TokenBlock {
  int64_t first;  // its first token
  int tokens;     // 1 to MAX_BLOCK
  int64_t slot;
};

// t[m * rank + k] = sum_i xf[m * in + i] * a[k * in + i] for the block's M tokens (xf: their rows in float) and the
// rows k in [k0, k1) of A. Two rows at a time, so that each load of x feeds two multiply-adds.
template <typename T, int M>
void shrink_block(const float* xf, int64_t in, const T* a, int64_t rank, int64_t k0, int64_t k1, float* t) {
  int64_t k = k0;
#ifdef __AVX512F__
  const int64_t vector_end = in - in % LANES;
  for (; k + 2 <= k1; k += 2) {
    const T* row0 = a + k * in;
    const T* row1 = row0 + in;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < vector_end; i += LANES) {
      const __m512 w0 = load16(row0 + i), w1 = load16(row1 + i);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_loadu_ps(xf + m * in + i);
        acc0[m] = _mm512_fmadd_ps(w0, xv, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(w1, xv, acc1[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float total0 = _mm512_reduce_add_ps(acc0[m]), total1 = _mm512_reduce_add_ps(acc1[m]);
      for (int64_t i = vector_end; i < in; ++i) {
        total0 += to_float(row0[i]) * xf[m * in + i];
        total1 += to_float(row1[i]) * xf[m * in + i];
      }
      t[m * rank + k] = total0;
      t[m * rank + k + 1] = total1;
    }
  }
#endif
  for (; k < k1; ++k) {
    const T* row = a + k * in;
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t i = 0; i < in; ++i) total += to_float(row[i]) * xf[m * in + i];
      t[m * rank + k] = total;
    }
  }
}

// y[m, c] += sum_k t[m * rank + k] * bt[k * out + c] for the block's M tokens, the columns [c0, c1) and the rows k in
// [k0, k1) of B.T (the columns' part's rank block: the rest of their column of B.T is zeros).
template <typename T, int M>
void expand_block(const float* t, int64_t rank, int64_t k0, int64_t k1, const T* bt, int64_t out, int64_t c0,
                  int64_t c1, T* y, int64_t y_stride) {
  int64_t c = c0;
#ifdef __AVX512F__
  for (; c + LANES <= c1; c += LANES) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 w = load16(bt + k * out + c);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(t[m * rank + k]), w, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      T* row = y + m * y_stride + c;
      store16(row, _mm512_add_ps(load16(row), acc[m]));
    }
  }
#endif
  for (; c < c1; ++c) {
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t k = k0; k < k1; ++k) sum += t[m * rank + k] * to_float(bt[k * out + c]);
      T* cell = y + m * y_stride + c;
      *cell = static_cast<T>(to_float(*cell) + sum);
    }
  }
}

// A tile of output columns [c0, c1) inside one part of a fused projection.
struct ColumnTile {
  int64_t part, c0, c1;
};

template <typename T>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
                   const std::vector<TokenBlock>& blocks, const std::vector<ColumnTile>& tiles,
                   const at::Tensor& ranks, int64_t work) {
  const int64_t in = x.size(1), out = y.size(1), rank = lora_a.size(1);
  const int64_t parts = ranks.size(1), part_rank = rank / parts;
  const int64_t* slot_ranks = ranks.data_ptr<int64_t>();
  const T* xs = x.data_ptr<T>();
  const T* a = lora_a.data_ptr<T>();
  const T* bt = lora_bt.data_ptr<T>();
  T* ys = y.data_ptr<T>();
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()), num_tiles = static_cast<int64_t>(tiles.size());
  std::vector<float> t(y.size(0) * rank);  // the shrink's results, by token
#pragma omp parallel if (work >= PARALLEL_WORK)
  {
    std::vector<float> xf(MAX_BLOCK * in);  // one per thread
#pragma omp for schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const TokenBlock& block = blocks[b];
      for (int m = 0; m < block.tokens; ++m) {
        const T* row = xs + (block.first + m) * x.stride(0);
        for (int64_t i = 0; i < in; ++i) xf[m * in + i] = to_float(row[i]);
      }
      with_tokens(block.tokens, [&](auto tokens) {
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t k0 = p * part_rank, k1 = k0 + slot_ranks[block.slot * parts + p];
          shrink_block<T, decltype(tokens)::value>(xf.data(), in, a + block.slot * rank * in, rank, k0, k1,
                                                   t.data() + block.first * rank);
        }
      });
    }
  }
#pragma omp parallel for schedule(static) if (work >= PARALLEL_WORK)
  for (int64_t item = 0; item < num_blocks * num_tiles; ++item) {
    const TokenBlock& block = blocks[item / num_tiles];
    const ColumnTile& tile = tiles[item % num_tiles];
    const int64_t k0 = tile.part * part_rank, k1 = k0 + slot_ranks[block.slot * parts + tile.part];
    if (k0 == k1) continue;  // the adapter does not adapt this part
    with_tokens(block.tokens, [&](auto tokens) {
      expand_block<T, decltype(tokens)::value>(t.data() + block.first * rank, rank, k0, k1,
                                               bt + block.slot * rank * out, out, tile.c0, tile.c1,
                                               ys + block.first * y.stride(0), y.stride(0));
    });
  }
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_bt,
               const at::Tensor& segments, const std::vector<int64_t>& part_ends, const at::Tensor& ranks) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && y.dim() == 2 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "x and y must be [num_tokens, features] with dense rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && lora_a.scalar_type() == x.scalar_type() &&
                  lora_bt.scalar_type() == x.scalar_type(),
              "y and the LoRA weights must have x's dtype");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1),
              "lora_a must be dense [slots, rank, in_features]");
  TORCH_CHECK(lora_bt.dim() == 3 && lora_bt.is_contiguous() && lora_bt.size(0) == lora_a.size(0) &&
                  lora_bt.size(1) == lora_a.size(1) && lora_bt.size(2) == y.size(1),
              "lora_bt must be dense [slots, rank, out_features]");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.is_contiguous() &&
                  segments.scalar_type() == at::kLong,
              "segments must be dense int64 [num_segments, 3] rows of (start, end, slot)");
  const int64_t parts = static_cast<int64_t>(part_ends.size()), rank = lora_a.size(1), out = y.size(1);
  TORCH_CHECK(parts >= 1 && rank % parts == 0 && part_ends.back() == out,
              "part_ends must end each part of the output, the last at out_features, and divide the rank");
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == lora_a.size(0) && ranks.size(1) == parts &&
                  ranks.is_contiguous() && ranks.scalar_type() == at::kLong,
              "ranks must be dense int64 [slots, parts]");
  const int64_t* slot_ranks = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < ranks.numel(); ++i)
    TORCH_CHECK(0 <= slot_ranks[i] && slot_ranks[i] <= rank / parts, "a slot's rank exceeds its part's rank block");
  std::vector<ColumnTile> tiles;
  for (int64_t p = 0, c0 = 0; p < parts; c0 = part_ends[p++]) {
    TORCH_CHECK(c0 <= part_ends[p], "part_ends must be ascending");
    for (int64_t c = c0; c < part_ends[p]; c += COLUMN_TILE)
      tiles.push_back({p, c, std::min(part_ends[p], c + COLUMN_TILE)});
  }
  std::vector<TokenBlock> blocks;
  int64_t work = 0;
  const int64_t* rows = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t start = rows[3 * s], end = rows[3 * s + 1], slot = rows[3 * s + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= x.size(0) && 0 <= slot && slot < lora_a.size(0),
                "segment (", start, ", ", end, ", ", slot, ") is out of range");
    int64_t slot_rank = 0;
    for (int64_t p = 0; p < parts; ++p) slot_rank += slot_ranks[slot * parts + p];
    if (slot_rank == 0) continue;  // the adapter does not adapt this projection
    for (int64_t first = start; first < end; first += MAX_BLOCK)
      blocks.push_back({first, static_cast<int>(std::min<int64_t>(MAX_BLOCK, end - first)), slot});
    work += (end - start) * slot_rank * (x.size(1) + out);
  }
  if (blocks.empty()) return;
  if (x.scalar_type() == at::kFloat) {
    lora_add_impl<float>(y, x, lora_a, lora_bt, blocks, tiles, ranks, work);
  } else {
    lora_add_impl<c10::BFloat16>(y, x, lora_a, lora_bt, blocks, tiles, ranks, work);
  }
}
