// Decode attention over the paged KV cache on the CPU: one query token per sequence, every context read in place.
//
// Work items are (sequence, partition of 256 tokens), spread over OpenMP threads with dynamic
// scheduling, so a batch of very different context lengths costs the sum of its contexts (no padding to the
// longest) and one long context still keeps every core busy. Each item computes, for each query head, the
// partition's scores, their max, the sum of their exponentials and the exp-weighted sum of V; a second pass merges
// the partitions of each (sequence, query head) with the usual log-sum-exp rescaling. On a CPU with AVX-512 bf16, a
// bf16 cache of head size 64 or 128 takes a walk of its own (group_partition_bf16), 2-3x the generic one.
// Under a sliding window only the last `window` positions are walked (the blocks before them may have been freed);
// a soft-cap makes each scaled score s softcap * tanh(s / softcap).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t PARTITION = 256;

// The largest head size the kernel takes (a head's query and accumulators are stack arrays of this many floats).
constexpr int64_t MAX_HEAD = 256;

// The explicit vectors of common.h, because gcc's own vectorizer turned the four-key dot products below into
// gathers, 2x slower.
typedef uint16_t u16x8 __attribute__((vector_size(16)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline f8 load8(const c10::BFloat16* p) {
  u16x8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const u32x8 bits = __builtin_convertvector(raw, u32x8) << 16;  // bf16 is the top half of a float
  f8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
template <typename T>  // half: element by element
inline f8 load8(const T* p) {
  f8 v;
  for (int i = 0; i < 8; ++i) v[i] = to_float(p[i]);
  return v;
}
inline float sum8(f8 v) {
  float total = 0.f;
  for (int i = 0; i < 8; ++i) total += v[i];
  return total;
}

#ifdef SPINDLE_AVX512_BF16

// How far ahead of the walk the AVX-512 bf16 path prefetches keys (in its first head's pass) and values, in tokens:
// blocks lie anywhere in memory, so the hardware's stream prefetcher finds little to follow. 10-20% on the case
// measured below, and the first rows of a partition prefetched before its walk 3-20% more (paired runs; prefetching
// further ahead, into L2, or a whole partition at once paid no more). Besides these, each walk fetches what comes
// after it into L2 while it computes, so that memory is busy all along: its values during its second head's keys,
// and the next KV head's keys during its values (1.3-1.5x on that case: 0.68-0.87 ms a layer against 0.92-1.44,
// paired runs; also fetching the keys of the item this thread likely takes next paid nothing more).
constexpr int64_t KEY_PREFETCH = 64, VALUE_PREFETCH = 32;

// 16 vectors to one: lane j holds the sum of v[j]'s lanes (four rounds of shuffles and adds, 45 instructions, in
// place of a horizontal sum per vector).
inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i], v[2i+1] alternating, lanes 0+2 and 1+3 summed
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the four vectors v[4i..4i+3], each summed over that lane
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // The four 128-bit lanes of each quad summed: two rounds of taking lanes (0, 2) and (1, 3) of two vectors.
  const auto fold = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
}

template <int64_t HEAD, _mm_hint HINT = _MM_HINT_T0>
inline void prefetch_row(const c10::BFloat16* row) {  // one head's key or value row, HEAD * 2 bytes
  for (int64_t c = 0; c < HEAD * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + c, HINT);
}

// One work item's partition for GROUP query heads that share a KV head, bf16 on AVX-512 with its bf16 dot products
// (vdpbf16ps: 32 products a vector, summed in pairs into float lanes, exact as bf16 products are). Each key is
// loaded once per head from L1 and its 16-key tile's sums transposed into one vector of scores (sum16); the values go
// two tokens at a time, their rows interleaved for vdpbf16ps against the probabilities rounded to bf16 (as torch's
// flash attention rounds them for its second product), the GROUP heads' accumulators in registers. Writes the
// partials of the GROUP heads as the generic walk does; next_kc (or null) is the keys the next walk over these slots
// reads, fetched while the values are. Measured on 2 AVX-512 cores (Zen 4), SmolLM2's 9/3 heads of 64, 64 contexts
// of 64-400 tokens, 30 layers' caches read from memory: 0.68-0.85 ms a layer, against 2.60 for the generic walk
// below in bf16 (1.75 in float32); the values widened to float and multiplied in float FMAs took 8-10% longer.
template <int64_t HEAD, int GROUP>
void group_partition_bf16(const c10::BFloat16* const* queries, const c10::BFloat16* kc, const c10::BFloat16* vc,
                          const c10::BFloat16* next_kc, const int64_t* slot, int64_t n, float scale, float softcap,
                          float* scores, uint16_t* probs, float* max_out, float* sum_out, float* const* acc_out) {
  constexpr int64_t QV = HEAD / 32, VV = HEAD / 16;  // bf16 pair vectors of a query, float vectors of a row
  const int64_t stride = (n + 15) / 16 * 16;          // scores of head g at scores[g * stride]
  // The first keys and values, which the walk's own prefetches (ahead of it) do not cover.
  for (int64_t i = 0; i < std::min(KEY_PREFETCH, n); ++i) prefetch_row<HEAD>(kc + slot[i]);
  for (int64_t i = 0; i < std::min(VALUE_PREFETCH, n); ++i) prefetch_row<HEAD>(vc + slot[i]);
  for (int g = 0; g < GROUP; ++g) {
    __m512bh qv[QV];
    for (int64_t c = 0; c < QV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(queries[g] + 32 * c);
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n; i += 16) {
      if (g == 0)  // the later heads find the partition's keys in the L1 and L2 caches
        for (int64_t j = i + KEY_PREFETCH; j < std::min(i + KEY_PREFETCH + 16, n); ++j) prefetch_row<HEAD>(kc + slot[j]);
      if (g == std::min(1, GROUP - 1))
        for (int64_t j = i; j < std::min(i + 16, n); ++j) prefetch_row<HEAD, _MM_HINT_T1>(vc + slot[j]);
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        dots[j] = _mm512_setzero_ps();
        if (i + j < n) {
          const c10::BFloat16* key = kc + slot[i + j];
          for (int64_t c = 0; c < QV; ++c)
            dots[j] = _mm512_dpbf16_ps(dots[j], qv[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
        }
      }
      const __mmask16 valid = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 tile = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                             sum16(dots), _mm512_set1_ps(scale));
      best = _mm512_max_ps(best, tile);
      _mm512_storeu_ps(scores + g * stride + i, tile);
    }
    float max_score = _mm512_reduce_max_ps(best);
    float* row = scores + g * stride;
    if (softcap > 0.f) {  // after the scores, in scalar steps: a Gemma-only cost
      max_score = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        row[i] = softcap * std::tanh(row[i] / softcap);
        max_score = std::max(max_score, row[i]);
      }
    }
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - max_score);
      total += row[i];
    }
    max_out[g] = max_score;
    sum_out[g] = total;
    // The probabilities in bf16 for the value products, zero past n (an odd n's last pair takes a zero weight).
    for (int64_t i = 0; i < stride; i += 16) {
      const __mmask16 valid = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * stride + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, _mm512_loadu_ps(row + i))));
    }
  }
  // Values two tokens at a time: their rows interleaved into [dimension][token pair] (unpacklo/hi, within each 128-bit
  // lane) for vdpbf16ps against the pair's two probabilities. Accumulator 2c holds, in lane k, dimension
  // 32c + 8(k / 4) + k % 4, and 2c + 1 the four after each of those: put back in order at the end.
  __m512 acc[GROUP][VV];
  for (int g = 0; g < GROUP; ++g)
    for (int64_t c = 0; c < VV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const c10::BFloat16* first = vc + slot[i];
    const c10::BFloat16* second = i + 1 < n ? vc + slot[i + 1] : first;  // weighs zero
    for (int64_t j = i + VALUE_PREFETCH; j < std::min(i + VALUE_PREFETCH + 2, n); ++j) prefetch_row<HEAD>(vc + slot[j]);
    if (next_kc != nullptr)
      for (int64_t j = i; j < std::min(i + 2, n); ++j) prefetch_row<HEAD, _MM_HINT_T1>(next_kc + slot[j]);
    __m512i pairs[VV];
    for (int64_t c = 0; c < VV / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c), b = _mm512_loadu_si512(second + 32 * c);
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < GROUP; ++g) {
      int32_t weights;
      std::memcpy(&weights, probs + g * stride + i, sizeof(weights));
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weights);
      for (int64_t c = 0; c < VV; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], weight, (__m512bh)pairs[c]);
    }
  }
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GROUP; ++g)
    for (int64_t c = 0; c < VV; c += 2) {
      _mm512_storeu_ps(acc_out[g] + 16 * c, _mm512_permutex2var_ps(acc[g][c], low, acc[g][c + 1]));
      _mm512_storeu_ps(acc_out[g] + 16 * c + 16, _mm512_permutex2var_ps(acc[g][c], high, acc[g][c + 1]));
    }
}
#endif

// HEAD is the head size when it is known at compile time (64, 128: a head's query and output then live in
// registers), or 0 for any other, read at run time; a head size that is not a multiple of 8 ends in scalar steps.
//
// Each work item walks its partition once per query head: four keys' dot products at a time (four independent
// sums), then the exp-weighted sum of the values into the head's accumulators. The partition's rows stay in the L2
// cache between the heads of a group. Measured on 2 AVX2 cores (Zen 3), float32, SmolLM2's 9/3 heads of 64, 48
// contexts of 160 tokens, ms per layer: 0.89-0.97, against 1.17-1.23 for the earlier walk (token by token, each
// token's row updating every head's accumulators in memory, its dot products one chain each).
template <typename T, int64_t HEAD>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_size = HEAD ? HEAD : query.size(2);
  const int64_t chunks = head_size / 8;  // whole vectors per row; the rest, head_size % 8, are scalar steps
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_size;
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);

  // Work item i covers partition lowest(s) / partition + i - first_item[s] of sequence s = item_seq[i], from the
  // window's first position on; its partials go to slot i. Partitions span PARTITION tokens, or one block when blocks
  // are larger.
  const int64_t partition = std::max(PARTITION, block_size);
  const auto lowest = [&](int64_t s) { return window ? std::max<int64_t>(0, lens[s] - window) : 0; };
  std::vector<int64_t> first_item(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t parts = std::max<int64_t>(1, (lens[s] + partition - 1) / partition - lowest(s) / partition);
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
    // The partition's scores of one head (exponentiated in place) and where each of its tokens' slots starts.
    // (The AVX-512 bf16 walk keeps up to four heads' scores, each row padded to whole 16-key tiles.)
    std::vector<float> scores(4 * (partition + 15)), merged(head_size);
    std::vector<uint16_t> probs(4 * (partition + 15));
    std::vector<int64_t> slot(partition);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = item_seq[item];
      const int64_t start = (lowest(s) / partition + item - first_item[s]) * partition;
      const int64_t begin = std::max(start, lowest(s));
      const int64_t n = std::min<int64_t>(lens[s], start + partition) - begin;
      const int32_t* table = tables + s * max_blocks;
      for (int64_t p = begin; p < begin + n;) {  // a block at a time
        const int64_t offset = p % block_size, run = std::min(block_size - offset, begin + n - p);
        const int64_t base = static_cast<int64_t>(table[p / block_size]) * block_size * token_stride;
        for (int64_t j = 0; j < run; ++j) slot[p - begin + j] = base + (offset + j) * token_stride;
        p += run;
      }
#ifdef SPINDLE_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> && HEAD % 32 == 0 && HEAD > 0) {
        // Query heads in runs of up to MAX_RUN of a group: their value accumulators take 16 of the 32 registers.
        constexpr int MAX_RUN = 256 / HEAD;
        for (int64_t h = 0; h < num_heads;) {
          const int run = static_cast<int>(std::min<int64_t>({MAX_RUN, group - h % group, num_heads - h}));
          const int64_t kv_offset = (h / group) * head_size;
          const T* queries[MAX_RUN];
          float* accs[MAX_RUN];
          for (int g = 0; g < run; ++g) {
            queries[g] = q + s * q_seq_stride + (h + g) * q_head_stride;
            accs[g] = part_acc.data() + (item * num_heads + h + g) * head_size;
          }
          float* maxes = part_max.data() + item * num_heads + h;
          float* sums = part_sum.data() + item * num_heads + h;
          const T* next_keys = h + run < num_heads ? kc + ((h + run) / group) * head_size : nullptr;
          const auto walk = [&](auto size) {
            group_partition_bf16<HEAD, decltype(size)::value>(queries, kc + kv_offset, vc + kv_offset, next_keys,
                                                              slot.data(), n, fscale, fsoftcap, scores.data(),
                                                              probs.data(), maxes, sums, accs);
          };
          switch (run) {
            case 1: walk(std::integral_constant<int, 1>{}); break;
            case 2: if constexpr (MAX_RUN >= 2) walk(std::integral_constant<int, 2>{}); break;
            case 3: if constexpr (MAX_RUN >= 3) walk(std::integral_constant<int, 3>{}); break;
            default: if constexpr (MAX_RUN >= 4) walk(std::integral_constant<int, 4>{}); break;
          }
          h += run;
        }
        continue;
      }
#endif
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t kv_offset = (h / group) * head_size;
        const T* src = q + s * q_seq_stride + h * q_head_stride;
        float qf[HEAD ? HEAD : MAX_HEAD];
        for (int64_t d = 0; d < head_size; ++d) qf[d] = to_float(src[d]) * fscale;
        f8 qv[HEAD ? HEAD / 8 : MAX_HEAD / 8];
        for (int64_t c = 0; c < chunks; ++c) qv[c] = load8(qf + 8 * c);
        // The score of the key at `key` whose whole vectors summed to `sum`: the vector's lanes and the scalar rest.
        const auto finish = [&](const T* key, f8 sum) {
          float total = sum8(sum);
          for (int64_t d = 8 * chunks; d < head_size; ++d) total += qf[d] * to_float(key[d]);
          return total;
        };
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
          const T* k0 = kc + slot[i] + kv_offset;
          const T* k1 = kc + slot[i + 1] + kv_offset;
          const T* k2 = kc + slot[i + 2] + kv_offset;
          const T* k3 = kc + slot[i + 3] + kv_offset;
          f8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
          for (int64_t c = 0; c < chunks; ++c) {
            a0 += qv[c] * load8(k0 + 8 * c);
            a1 += qv[c] * load8(k1 + 8 * c);
            a2 += qv[c] * load8(k2 + 8 * c);
            a3 += qv[c] * load8(k3 + 8 * c);
          }
          scores[i] = finish(k0, a0);
          scores[i + 1] = finish(k1, a1);
          scores[i + 2] = finish(k2, a2);
          scores[i + 3] = finish(k3, a3);
        }
        for (; i < n; ++i) {
          const T* key = kc + slot[i] + kv_offset;
          f8 sum = {};
          for (int64_t c = 0; c < chunks; ++c) sum += qv[c] * load8(key + 8 * c);
          scores[i] = finish(key, sum);
        }
        if (fsoftcap > 0.f)
          for (i = 0; i < n; ++i) scores[i] = fsoftcap * std::tanh(scores[i] / fsoftcap);
        float max_score = -std::numeric_limits<float>::infinity();
        for (i = 0; i < n; ++i) max_score = std::max(max_score, scores[i]);
        float total = 0.f;
        for (i = 0; i < n; ++i) {
          scores[i] = std::exp(scores[i] - max_score);
          total += scores[i];
        }
        f8 acc[HEAD ? HEAD / 8 : MAX_HEAD / 8] = {};
        float tail[8] = {};
        for (i = 0; i < n; ++i) {
          const T* value = vc + slot[i] + kv_offset;
          const float weight = scores[i];
          for (int64_t c = 0; c < chunks; ++c) acc[c] += weight * load8(value + 8 * c);
          for (int64_t d = 8 * chunks; d < head_size; ++d) tail[d - 8 * chunks] += weight * to_float(value[d]);
        }
        part_max[item * num_heads + h] = max_score;
        part_sum[item * num_heads + h] = total;
        float* dst = part_acc.data() + (item * num_heads + h) * head_size;
        for (int64_t c = 0; c < chunks; ++c) std::memcpy(dst + 8 * c, &acc[c], sizeof(f8));
        std::copy_n(tail, head_size - 8 * chunks, dst + 8 * chunks);
      }
    }
#pragma omp for collapse(2)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t first = first_item[s];
        merge_partials(first_item[s + 1] - first, part_max.data() + first * num_heads + h,
                       part_sum.data() + first * num_heads + h, num_heads,
                       part_acc.data() + (first * num_heads + h) * head_size, num_heads * head_size, head_size,
                       merged.data(), out.data_ptr<T>() + (s * num_heads + h) * head_size);
      }
    }
  }
}

}  // namespace

// window (0 for none): how many of the last positions, the query's own included, it sees; softcap (0 for none) caps
// the scaled scores.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_heads, head_size], last dim dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32, contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32, contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) <= MAX_HEAD, "head_size must be at most ", MAX_HEAD);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0 for none)");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  DISPATCH_MODEL_TYPES(query.scalar_type(), "decode_attention", [&] {
    switch (query.size(2)) {
      case 64: decode_attention_impl<scalar_t, 64>(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out); break;
      case 128: decode_attention_impl<scalar_t, 128>(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out); break;
      default: decode_attention_impl<scalar_t, 0>(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, out);
    }
  });
  return out;
}
