// Decode attention over the paged KV cache on the CPU: one query token per sequence, every context read in place.
//
// Work items are (sequence, KV head, part of the context), spread over OpenMP threads with dynamic scheduling, so a
// batch of very different context lengths costs the sum of its contexts (no padding to the longest); with several
// threads a context is split into 256-token parts, so that one long context still keeps every core busy, and the
// parts of each (sequence, query head) are merged after with the usual log-sum-exp rescaling (decode_attention_impl).
// A batch of many parts hands a thread a part's KV heads together (a unit): the cache interleaves the heads in each
// token's row, which one core then reads whole.
// On a CPU with AVX-512 bf16, a bf16 cache of head size 64 or 128 takes a walk of its own (group_partition_bf16),
// 2-3x the generic one.
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
// Units (see decode_attention_impl) a thread needs before each takes a part's KV heads together: enough that the
// dynamic schedule still evens out parts of different lengths.
constexpr int64_t UNITS_PER_THREAD = 8;

// The largest head size the kernel takes (a head's query and accumulators are stack arrays of this many floats).
constexpr int64_t MAX_HEAD = 256;

// The explicit vectors of common.h (load8), because gcc's own vectorizer turned the four-key dot products below into
// gathers, 2x slower.
// Each of a row's n scores replaced by its exponential less the row's max score; returns their sum.
inline float exp_in_place(float* row, int64_t n, float max_score) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    row[i] = std::exp(row[i] - max_score);
    total += row[i];
  }
  return total;
}

// One head's key or value row, `bytes` long, fetched into L1 (LOCALITY 3) or L2 (2): blocks lie anywhere in memory,
// where the hardware's stream prefetcher finds little to follow.
template <int LOCALITY = 3, typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + c, 0, LOCALITY);
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
  for (int64_t i = 0; i < std::min(KEY_PREFETCH, n); ++i) prefetch_row(kc + slot[i], HEAD * 2);
  for (int64_t i = 0; i < std::min(VALUE_PREFETCH, n); ++i) prefetch_row(vc + slot[i], HEAD * 2);
  for (int g = 0; g < GROUP; ++g) {
    __m512bh qv[QV];
    for (int64_t c = 0; c < QV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(queries[g] + 32 * c);
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n; i += 16) {
      if (g == 0)  // the later heads find the partition's keys in the L1 and L2 caches
        for (int64_t j = i + KEY_PREFETCH; j < std::min(i + KEY_PREFETCH + 16, n); ++j)
          prefetch_row(kc + slot[j], HEAD * 2);
      if (g == std::min(1, GROUP - 1))
        for (int64_t j = i; j < std::min(i + 16, n); ++j) prefetch_row<2>(vc + slot[j], HEAD * 2);
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
    max_out[g] = max_score;
    sum_out[g] = exp_in_place(row, n, max_score);
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
    for (int64_t j = i + VALUE_PREFETCH; j < std::min(i + VALUE_PREFETCH + 2, n); ++j)
      prefetch_row(vc + slot[j], HEAD * 2);
    if (next_kc != nullptr)
      for (int64_t j = i; j < std::min(i + 2, n); ++j) prefetch_row<2>(next_kc + slot[j], HEAD * 2);
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

// The sums of eight vectors' lanes, as one vector (lane j: the sum of v[j]'s lanes): three rounds of pairwise adds of
// shuffled lanes, in place of a horizontal sum per vector.
inline f8 sum8x8(const f8* v) {
  const auto pairs = [](f8 a, f8 b) {  // [a01 a23 b01 b23 | a45 a67 b45 b67], each the sum of those two lanes
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  // [v0 v1 v2 v3 | the same], each lane the sum of four of that vector's lanes: the lower four, then the upper.
  const f8 low = pairs(pairs(v[0], v[1]), pairs(v[2], v[3])), high = pairs(pairs(v[4], v[5]), pairs(v[6], v[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

// How far ahead of the generic walk its key rows are prefetched, in tokens; each tile of keys also fetches its value
// rows into L2, read once the chunk's scores are done (bench/results/decode_attention.md: 15-25% on long contexts
// whose cache a decode step's weight stream has evicted).
constexpr int64_t GENERIC_KEY_PREFETCH = 32;

// The softmax states over a chunk of at most PARTITION keys of the `group` query heads that share a KV head
// (generic walk, any CPU). `qf` holds their queries, scaled, head_size floats each; `slot` where each key's row
// starts (the KV head's offset added). Keys go eight at a time, each of the group's heads taking their eight dot
// products (eight independent sums, folded into one vector by sum8x8) while those rows are in the L1 cache; then
// each head's max and sum of exponentials; then the values, TILE tokens at a time, each head adding the tile's
// exp-weighted rows to its accumulators. The earlier walk, once per head (its dot products four keys at a time,
// each summed apart), read each row from L2 per head once a KV head's chunk outgrew L1: at 12/4 heads of 128 on one
// Zen 3 core, 32-34 us a call against 24-26 at a context of 128, 128-136 against 96-108 at 512
// (bench/results/decode_attention.md). HEAD is the head size when it is known at
// compile time (64, 128), or 0 for any other, read from head_size; one not a multiple of 8 ends in scalar steps.
template <typename T, int64_t HEAD>
void group_chunk(const float* qf, const T* kc, const T* vc, const int64_t* slot, int64_t n, int64_t head_size,
                 int64_t group, float softcap, float* scores, float* max_out, float* sum_out, float* acc_out) {
  constexpr int64_t TILE = 16;
  head_size = HEAD ? HEAD : head_size;
  const int64_t chunks = head_size / 8, rest = head_size - 8 * chunks;
  const int64_t stride = (n + 7) / 8 * 8;  // head g's scores at scores[g * stride]
  const int64_t row_bytes = head_size * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < std::min(GENERIC_KEY_PREFETCH, n); ++i) prefetch_row(kc + slot[i], row_bytes);
  for (int64_t i = 0; i < n; i += 8) {
    for (int64_t j = i + GENERIC_KEY_PREFETCH; j < std::min(i + GENERIC_KEY_PREFETCH + 8, n); ++j)
      prefetch_row(kc + slot[j], row_bytes);
    for (int64_t j = i; j < std::min(i + 8, n); ++j) prefetch_row<2>(vc + slot[j], row_bytes);  // values into L2
    const T* keys[8];
    for (int j = 0; j < 8; ++j) keys[j] = kc + slot[std::min(i + j, n - 1)];  // past n: the last key again, unused
    for (int64_t g = 0; g < group; ++g) {
      const float* query = qf + g * head_size;
      f8 sums[8] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        const f8 qv = load8(query + 8 * c);
        for (int j = 0; j < 8; ++j) sums[j] += qv * load8(keys[j] + 8 * c);
      }
      f8 tile = sum8x8(sums);
      for (int j = 0; j < 8; ++j)
        for (int64_t d = 8 * chunks; d < head_size; ++d) tile[j] += query[d] * to_float(keys[j][d]);
      std::memcpy(scores + g * stride + i, &tile, sizeof(tile));
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * stride;
    if (softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) row[i] = softcap * std::tanh(row[i] / softcap);
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) max_score = std::max(max_score, row[i]);
    max_out[g] = max_score;
    sum_out[g] = exp_in_place(row, n, max_score);
  }
  std::fill_n(acc_out, group * head_size, 0.f);
  for (int64_t i = 0; i < n; i += TILE) {
    const int64_t tile = std::min(TILE, n - i);
    for (int64_t g = 0; g < group; ++g) {
      const float* weights = scores + g * stride + i;
      float* out = acc_out + g * head_size;
      f8 acc[HEAD ? HEAD / 8 : MAX_HEAD / 8];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = load8(out + 8 * c);
      for (int64_t t = 0; t < tile; ++t) {
        const T* value = vc + slot[i + t];
        for (int64_t c = 0; c < chunks; ++c) acc[c] += weights[t] * load8(value + 8 * c);
        for (int64_t d = 8 * chunks; d < head_size; ++d) out[d] += weights[t] * to_float(value[d]);
      }
      for (int64_t c = 0; c < chunks; ++c) std::memcpy(out + 8 * c, &acc[c], sizeof(f8));
    }
  }
}

// The least work a thread takes, in multiply-adds (context positions x query heads x head size, twice: about 30 us of
// one Zen 3 core). A call with less than twice this runs on the calling thread alone, in no OpenMP region, whose
// start and barriers were most of a small call (and on a machine that other jobs share, a barrier that waited on a
// descheduled thread took 16 ms). Issue 43's single stream (12/4 heads of 128, contexts 16-150) stays on one thread;
// bench/results/decode_attention.md has the measurements.
constexpr int64_t MIN_THREAD_WORK = 1 << 19;

// Work items are (sequence, KV head, part of the context): each walks its part in chunks of PARTITION tokens for
// the query heads that share the KV head, folding each chunk's softmax state into a running one (online softmax), so
// the heads of a group find that KV head's rows in the L1 and L2 caches. On one thread a sequence is one part, whose
// item writes the output itself; with more, a sequence is split into PARTITION-token parts, so that one long context
// keeps every thread busy, and the parts are merged after (flash-decoding's log-sum-exp rescaling).
template <typename T, int64_t HEAD>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_size = HEAD ? HEAD : query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_size;
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);

  // Chunks (and split parts) span PARTITION tokens, or one block when blocks are larger.
  const int64_t partition = std::max(PARTITION, block_size);
  const auto lowest = [&](int64_t s) { return window ? std::max<int64_t>(0, lens[s] - window) : 0; };
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) work += lens[s] - lowest(s);
  work *= 2 * num_heads * head_size;
  const int64_t threads = std::clamp<int64_t>(work / MIN_THREAD_WORK, 1, omp_get_max_threads());
  const bool split = threads > 1;
  // Sequence s's items are first_item[s] onwards, KV head by KV head, parts[s] each; item i's part starts at
  // lowest(s) / partition + its index among them, in partitions, from the window's first position on.
  std::vector<int64_t> first_item(num_seqs + 1, 0), parts(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    parts[s] = split ? std::max<int64_t>(1, (lens[s] + partition - 1) / partition - lowest(s) / partition) : 1;
    first_item[s + 1] = first_item[s] + parts[s] * num_kv_heads;
  }
  const int64_t num_items = first_item[num_seqs];
  // What a thread takes at a time (a unit): where the parts are plenty for the threads, a part with all its KV heads,
  // walked one after the other, so that one core reads each token's row whole and the keys each walk fetches for the
  // next land in its own L2; else one KV head's part, so that few parts still spread over the threads.
  const int64_t heads_per_unit = num_items / num_kv_heads >= UNITS_PER_THREAD * threads ? num_kv_heads : 1;
  const int64_t num_units = num_items / heads_per_unit;
  std::vector<int64_t> unit_seq(num_units), unit_item(num_units);  // a unit's sequence, and its first KV head's item
  for (int64_t s = 0, u = 0; s < num_seqs; ++s)
    for (int64_t kv = 0; kv < num_kv_heads; kv += heads_per_unit)
      for (int64_t part = 0; part < parts[s]; ++part, ++u) {
        unit_seq[u] = s;
        unit_item[u] = first_item[s] + kv * parts[s] + part;
      }
  // The softmax states of split parts, per (item, query head of its group): max score, sum of exp, the exp-weighted
  // V sum.
  const int64_t num_partials = split ? num_items * group : 0;
  std::vector<float> part_max(num_partials), part_sum(num_partials), part_acc(num_partials * head_size);

#pragma omp parallel num_threads(std::max<int64_t>(1, std::min(threads, num_units))) if (split)
  {
    // A chunk's scores of the group's heads (each padded to whole 16-key tiles for the AVX-512 bf16 walk, which
    // takes up to four heads at a time), where each of its tokens' rows starts, its heads' softmax states, the
    // running states of the item's heads, and their queries scaled to float.
    std::vector<float> scores(std::max<int64_t>(4, group) * (partition + 15));
    std::vector<float> chunk_max(group), chunk_sum(group), chunk_acc(group * head_size);
    std::vector<float> run_max(group), run_sum(group), run_acc(group * head_size), qf(group * head_size);
    std::vector<uint16_t> probs(4 * (partition + 15));
    std::vector<int64_t> slot(partition);
    // One item: KV head kv's part of sequence s, walked for every query head of that KV head.
    const auto walk_item = [&](int64_t s, int64_t item) {
      const int64_t kv = (item - first_item[s]) / parts[s];
      const int64_t kv_offset = kv * head_size;
      const int32_t* table = tables + s * max_blocks;
      const int64_t part_start = (lowest(s) / partition + (item - first_item[s]) % parts[s]) * partition;
      const int64_t begin = std::max(part_start, lowest(s));
      const int64_t end = parts[s] > 1 ? std::min<int64_t>(lens[s], part_start + partition) : lens[s];
      for (int64_t chunk = begin; chunk < end || chunk == begin; chunk += partition) {
        const int64_t n = std::min(end, chunk + partition) - chunk;
        for (int64_t p = chunk; p < chunk + n;) {  // a block at a time
          const int64_t offset = p % block_size, run = std::min(block_size - offset, chunk + n - p);
          const int64_t base = static_cast<int64_t>(table[p / block_size]) * block_size * token_stride;
          for (int64_t j = 0; j < run; ++j) slot[p - chunk + j] = base + (offset + j) * token_stride;
          p += run;
        }
        // The first chunk's states are the running ones; each later chunk's are folded into them.
        const bool first = chunk == begin;
        float* maxes = first ? run_max.data() : chunk_max.data();
        float* sums = first ? run_sum.data() : chunk_sum.data();
        float* accs = first ? run_acc.data() : chunk_acc.data();
        bool walked = false;
#ifdef SPINDLE_AVX512_BF16
        if constexpr (std::is_same_v<T, c10::BFloat16> && HEAD % 32 == 0 && HEAD > 0) {
          // Query heads in runs of up to MAX_RUN of the group: their value accumulators take 16 of the 32 registers.
          constexpr int MAX_RUN = 256 / HEAD;
          for (int64_t g = 0; g < group;) {
            const int run = static_cast<int>(std::min<int64_t>(MAX_RUN, group - g));
            const T* queries[MAX_RUN];
            float* run_accs[MAX_RUN];
            for (int r = 0; r < run; ++r) {
              queries[r] = q + s * q_seq_stride + (kv * group + g + r) * q_head_stride;
              run_accs[r] = accs + (g + r) * head_size;
            }
            // What the next walk over these slots reads: the group's next run's keys, or the next KV head's.
            const T* next_keys = g + run < group ? kc + kv_offset : kv + 1 < num_kv_heads ? kc + kv_offset + head_size
                                                                                          : nullptr;
            const auto walk = [&](auto size) {
              group_partition_bf16<HEAD, decltype(size)::value>(queries, kc + kv_offset, vc + kv_offset, next_keys,
                                                                slot.data(), n, fscale, fsoftcap, scores.data(),
                                                                probs.data(), maxes + g, sums + g, run_accs);
            };
            switch (run) {
              case 1: walk(std::integral_constant<int, 1>{}); break;
              case 2: if constexpr (MAX_RUN >= 2) walk(std::integral_constant<int, 2>{}); break;
              case 3: if constexpr (MAX_RUN >= 3) walk(std::integral_constant<int, 3>{}); break;
              default: if constexpr (MAX_RUN >= 4) walk(std::integral_constant<int, 4>{}); break;
            }
            g += run;
          }
          walked = true;
        }
#endif
        if (!walked) {
          for (int64_t d = 0; d < n; ++d) slot[d] += kv_offset;
          for (int64_t g = 0; g < group; ++g) {
            const T* src = q + s * q_seq_stride + (kv * group + g) * q_head_stride;
            for (int64_t d = 0; d < head_size; ++d) qf[g * head_size + d] = to_float(src[d]) * fscale;
          }
          group_chunk<T, HEAD>(qf.data(), kc, vc, slot.data(), n, head_size, group, fsoftcap, scores.data(), maxes,
                               sums, accs);
        }
        if (!first)
          for (int64_t g = 0; g < group; ++g) {  // online softmax: both states rescaled to the larger max
            const float top = std::max(run_max[g], chunk_max[g]);
            const float old_weight = std::exp(run_max[g] - top), new_weight = std::exp(chunk_max[g] - top);
            run_max[g] = top;
            run_sum[g] = run_sum[g] * old_weight + chunk_sum[g] * new_weight;
            float* acc = run_acc.data() + g * head_size;
            const float* add = chunk_acc.data() + g * head_size;
            for (int64_t d = 0; d < head_size; ++d) acc[d] = acc[d] * old_weight + add[d] * new_weight;
          }
      }
      if (parts[s] > 1) {
        std::copy_n(run_max.data(), group, part_max.data() + item * group);
        std::copy_n(run_sum.data(), group, part_sum.data() + item * group);
        std::copy_n(run_acc.data(), group * head_size, part_acc.data() + item * group * head_size);
        return;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        T* dst = o + (s * num_heads + kv * group + g) * head_size;
        for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<T>(run_acc[g * head_size + d] * inv);
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < num_units; ++unit) {
      const int64_t s = unit_seq[unit];
      for (int64_t h = 0; h < heads_per_unit; ++h) walk_item(s, unit_item[unit] + h * parts[s]);
    }
    if (split) {
#pragma omp for collapse(2)
      for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t h = 0; h < num_heads; ++h) {
          if (parts[s] == 1) continue;
          // The parts of head h: items first_item[s] + (h / group) * parts[s] onwards, one each.
          const int64_t at = (first_item[s] + (h / group) * parts[s]) * group + h % group;
          merge_partials(parts[s], part_max.data() + at, part_sum.data() + at, group,
                         part_acc.data() + at * head_size, group * head_size, head_size, chunk_acc.data(),
                         o + (s * num_heads + h) * head_size);
        }
      }
    }
  }
}

}  // namespace

// Sequence s of the query reads row s of block_tables and seq_lens, which may hold more rows (a step's prefill chunks
// after its decodes: no slice of them per layer). window (0 for none): how many of the last positions, the query's
// own included, it sees; softcap (0 for none) caps the scaled scores.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_seqs, num_heads, head_size], last dim dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32, contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32, contiguous");
  TORCH_CHECK(block_tables.size(0) >= query.size(0) && seq_lens.size(0) >= query.size(0),
              "block_tables and seq_lens need a row for each of the query's ", query.size(0), " sequences");
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
