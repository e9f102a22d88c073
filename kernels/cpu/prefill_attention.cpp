// Prefill attention over the paged KV cache on the CPU: the query tokens of each prefill chunk attend causally over
// their sequence's context (the cached prefix and the chunk itself), which is read where it lies in the cache.
// Under a sliding window a position sees only the last `window` positions, its own included, and the keys before
// the first row's window of a work item are not read at all (their blocks may have been freed); a soft-cap makes each
// scaled score s softcap * tanh(s / softcap).
//
// A work item is (chunk, kv head, tile of query positions): its rows are those positions times the query
// heads of the kv head, and it walks the keys up to its last position in tiles (KEY_TILE; BF16_KEY_TILE in the bf16
// walk) with an online softmax (flash attention's running max and sum), so nothing of the context is gathered or
// padded and no mask is built.
// Each key tile is laid out once per item for the products (walk_float widens it to float; walk_bf16, on AVX-512
// bf16 CPUs, pairs its bf16 values for vdpbf16ps) and serves every row of the item.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SPINDLE_FLOAT_WALK_AVX2 1  // walk_float's products in AVX2 registers (tile_scores, add_values)
#include <immintrin.h>
#endif

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
#ifdef SPINDLE_FLOAT_WALK_AVX2
constexpr int64_t ROW_BLOCK = 6;  // walk_float's rows a block: 6 x 16 scores or outputs fill 12 of AVX2's 16 registers
#else
constexpr int64_t ROW_BLOCK = 4;
#endif
// The head size of the generic instantiation's buffers: the largest it accepts.
constexpr int64_t MAX_HEAD = 256;

struct Item {
  int64_t chunk, kv_head, first_row;
};

// One work item's walk: its rows (row r is query position first_position + r / group, the group's head r % group)
// against the keys [key_begin, key_end) of its sequence, read where they lie in the cache. window is 0 for none,
// softcap 0 for none.
struct Walk {
  const int32_t* table;
  int64_t block_size, token_stride, kv_offset;
  int64_t rows, group, first_position;
  int64_t key_begin, key_end;
  int64_t window;
  float softcap;

  // Where the keys (or values) of the item's KV head of tokens first.. first + n - 1 start in the cache, in
  // elements: one division a tile, not one a key (block_size is known at run time only).
  void offsets(int64_t first, int64_t n, int64_t* out) const {
    int64_t block = first / block_size, slot = first % block_size;
    for (int64_t j = 0; j < n; ++j) {
      out[j] = (static_cast<int64_t>(table[block]) * block_size + slot) * token_stride + kv_offset;
      if (++slot == block_size) slot = 0, ++block;
    }
  }
  // How many keys of the tile at k0 (num_keys of them) row r may see: those up to its own position; none for a
  // padding row or a row before the tile.
  int64_t visible(int64_t r, int64_t k0, int64_t num_keys) const {
    return r < rows ? std::clamp<int64_t>(first_position + r / group - k0 + 1, 0, num_keys) : 0;
  }
  // How many keys at the start of the tile row r may not see: those before its window.
  int64_t hidden(int64_t r, int64_t k0, int64_t num_keys) const {
    return window ? std::clamp<int64_t>(first_position + r / group - window + 1 - k0, 0, num_keys) : 0;
  }
};

// The online softmax of one row's tile of scores s (KEY_TILE of them, those in [hidden, visible) valid):
// exponentiates them in place (0 outside), updates the row's running max and sum, and returns the factor for its
// earlier output.
inline float softmax_tile(float* s, int64_t hidden, int64_t visible, float& row_max, float& row_sum) {
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = hidden; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
  const float new_max = std::max(row_max, tile_max);
  const bool seen = visible > hidden;
  const float rescale = seen ? std::exp(row_max - new_max) : 1.f;
  float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t j = 0; j < KEY_TILE; ++j) {
    const float p = j >= hidden && j < visible ? std::exp(s[j] - new_max) : 0.f;
    s[j] = p;
    tile_sum += p;
  }
  if (seen) row_max = new_max;
  row_sum = row_sum * rescale + tile_sum;
  return rescale;
}

#ifdef SPINDLE_FLOAT_WALK_AVX2
// With AVX2's 16 vector registers the plain loops below spill: 4 rows' 32 scores alone take all 16, and P.V's 4 rows
// of outputs 32 (2 Zen 3 cores, SmolLM2's 9/3 heads of 64: ~62 GFLOP/s, a third of the cores' FMA peak). These run
// the same products in blocks that stay in registers, 12 independent accumulators (two FMA pipes of 4 cycles' latency
// need 8 in flight): 6 rows x 16 keys (Q.K), 6 rows x 16 dimensions (P.V).

// s[b][j] = the scores of ROW_BLOCK rows (q: the first's, rows HEAD floats apart) against the tile (kt: [d][j]).
template <int64_t HEAD>
inline void tile_scores(const float* q, const float* kt, int64_t head_size, float s[ROW_BLOCK][KEY_TILE]) {
  static_assert(KEY_TILE % 16 == 0);
  for (int64_t j0 = 0; j0 < KEY_TILE; j0 += 16) {
    __m256 a[ROW_BLOCK][2];
    for (int64_t b = 0; b < ROW_BLOCK; ++b) a[b][0] = a[b][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_size; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kt + d * KEY_TILE + j0), k1 = _mm256_loadu_ps(kt + d * KEY_TILE + j0 + 8);
      for (int64_t b = 0; b < ROW_BLOCK; ++b) {
        const __m256 qd = _mm256_broadcast_ss(q + b * HEAD + d);
        a[b][0] = _mm256_fmadd_ps(qd, k0, a[b][0]);
        a[b][1] = _mm256_fmadd_ps(qd, k1, a[b][1]);
      }
    }
    for (int64_t b = 0; b < ROW_BLOCK; ++b) {
      _mm256_storeu_ps(s[b] + j0, a[b][0]);
      _mm256_storeu_ps(s[b] + j0 + 8, a[b][1]);
    }
  }
}

// acc's ROW_BLOCK rows (HEAD floats apart) = acc x rescale + p.V over the tile's keys (p: s, vf: [j][d]).
template <int64_t HEAD>
inline void add_values(const float s[ROW_BLOCK][KEY_TILE], const float rescale[ROW_BLOCK], const float* vf,
                       int64_t num_keys, float* acc) {
  static_assert(HEAD % 16 == 0);
  for (int64_t d0 = 0; d0 < HEAD; d0 += 16) {
    __m256 o[ROW_BLOCK][2];
    for (int64_t b = 0; b < ROW_BLOCK; ++b) {
      const __m256 factor = _mm256_set1_ps(rescale[b]);
      o[b][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + b * HEAD + d0), factor);
      o[b][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + b * HEAD + d0 + 8), factor);
    }
    for (int64_t j = 0; j < num_keys; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vf + j * HEAD + d0), v1 = _mm256_loadu_ps(vf + j * HEAD + d0 + 8);
      for (int64_t b = 0; b < ROW_BLOCK; ++b) {
        const __m256 p = _mm256_broadcast_ss(s[b] + j);
        o[b][0] = _mm256_fmadd_ps(p, v0, o[b][0]);
        o[b][1] = _mm256_fmadd_ps(p, v1, o[b][1]);
      }
    }
    for (int64_t b = 0; b < ROW_BLOCK; ++b) {
      _mm256_storeu_ps(acc + b * HEAD + d0, o[b][0]);
      _mm256_storeu_ps(acc + b * HEAD + d0 + 8, o[b][1]);
    }
  }
}
#else
// s[b][j] = the scores of ROW_BLOCK rows (q: the first's, rows HEAD floats apart) against the tile (kt: [d][j]).
template <int64_t HEAD>
inline void tile_scores(const float* q, const float* kt, int64_t head_size, float s[ROW_BLOCK][KEY_TILE]) {
  for (int64_t b = 0; b < ROW_BLOCK; ++b)
    for (int64_t j = 0; j < KEY_TILE; ++j) s[b][j] = 0.f;
  for (int64_t d = 0; d < head_size; ++d) {
    const float* kd = kt + d * KEY_TILE;
    for (int64_t b = 0; b < ROW_BLOCK; ++b) {
      const float qd = q[b * HEAD + d];
#pragma omp simd
      for (int64_t j = 0; j < KEY_TILE; ++j) s[b][j] += qd * kd[j];
    }
  }
}

// acc's ROW_BLOCK rows (HEAD floats apart) = acc x rescale + p.V over the tile's keys (p: s, vf: [j][d]).
template <int64_t HEAD>
inline void add_values(const float s[ROW_BLOCK][KEY_TILE], const float rescale[ROW_BLOCK], const float* vf,
                       int64_t num_keys, float* acc) {
  float out_block[ROW_BLOCK][HEAD];
  for (int64_t b = 0; b < ROW_BLOCK; ++b)
    for (int64_t d = 0; d < HEAD; ++d) out_block[b][d] = acc[b * HEAD + d] * rescale[b];
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* vj = vf + j * HEAD;
    for (int64_t b = 0; b < ROW_BLOCK; ++b) {
      const float p = s[b][j];
#pragma omp simd
      for (int64_t d = 0; d < HEAD; ++d) out_block[b][d] += p * vj[d];
    }
  }
  for (int64_t b = 0; b < ROW_BLOCK; ++b)
    for (int64_t d = 0; d < HEAD; ++d) acc[b * HEAD + d] = out_block[b][d];
}
#endif

// The walk in float: each key tile is widened once, K transposed, so that both products vectorize over a tile's
// keys (Q.K) or over the head dimension (P.V) without horizontal sums, and serves every row of the item. qf holds
// the rows, scaled, padded with zero rows to whole ROW_BLOCKs; kt and vf are a tile's scratch.
template <typename T, int64_t HEAD>
void walk_float(const Walk& w, const float* qf, const T* kc, const T* vc, int64_t head_size, float* kt, float* vf,
                float* acc, float* row_max, float* row_sum) {
  const int64_t padded_rows = (w.rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
  for (int64_t k0 = w.key_begin; k0 < w.key_end; k0 += KEY_TILE) {
    const int64_t num_keys = std::min(KEY_TILE, w.key_end - k0);
    int64_t offsets[KEY_TILE];
    w.offsets(k0, num_keys, offsets);
    for (int64_t j = 0; j < num_keys; ++j) {
      const T* k_src = kc + offsets[j];
      const T* v_src = vc + offsets[j];
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
      float s[ROW_BLOCK][KEY_TILE];
      tile_scores<HEAD>(qf + r0 * HEAD, kt, head_size, s);
      if (w.softcap > 0.f)
        for (int64_t b = 0; b < ROW_BLOCK; ++b)
          for (int64_t j = 0; j < KEY_TILE; ++j) s[b][j] = w.softcap * std::tanh(s[b][j] / w.softcap);
      float rescale[ROW_BLOCK];
      for (int64_t b = 0; b < ROW_BLOCK; ++b)
        rescale[b] = softmax_tile(s[b], w.hidden(r0 + b, k0, num_keys), w.visible(r0 + b, k0, num_keys),
                                  row_max[r0 + b], row_sum[r0 + b]);
      add_values<HEAD>(s, rescale, vf, num_keys, acc + r0 * HEAD);
    }
  }
}

#ifdef SPINDLE_AVX512_BF16
// The bf16 walk's blocks: 4 rows against a tile of 64 keys, whose scores take 16 of the 32 vector registers, as do
// the 4 rows' outputs over 64 dimensions in P.V. Against 8 rows and 32 keys, each row's max reduction, rescale of
// its output (loaded, multiplied and stored again) and softmax bookkeeping come once per 64 keys, not 32.
constexpr int64_t BF16_ROW_BLOCK = 4;
constexpr int64_t BF16_KEY_TILE = 64;

// 2^x in each lane, for finite x <= 0, within 1.0e-4 of it relatively (the probabilities are then rounded to bf16,
// 3.9e-3): 2^n * 2^r with n = round(x) and 2^r = 1 + r * (a degree-2 polynomial), |r| <= 1/2, fitted for the least
// relative error; exactly 1 at 0, so that a row whose max is unchanged keeps its sum and output as they are (a fit
// free at 0 gave 0.99993 there, which compounds over a long context's tiles). A degree-5 Taylor series, within
// 3.3e-6, made the walk slower (see its note). x = -inf gives NaN, so a difference of maxes that may be -inf is
// clamped first. Lanes outside `keep` are 0 (the mask costs nothing there: the last instruction takes it). Working in
// base 2 folds the softmax's scale and its change of base into one product with the scores (a third of the
// instructions of e^x with its range reduction).
inline __m512 exp2_16(__m512 x, __mmask16 keep = 0xffff) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_set1_ps(5.50089292e-2f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(2.42210969e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(6.93282902e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, poly, n);
}

// Transposes a 16 x 16 matrix of 32-bit words held in 16 vectors, in place.
inline void transpose16(__m512i* m) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i+1 interleaved, columns 4L, 4L+1 and 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(m[2 * i], m[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(m[2 * i], m[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // m[4i + k], lane L: column 4L + k of rows 4i..4i+3
    m[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    m[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    m[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    m[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of m[k], m[4 + k], m[8 + k], m[12 + k]
    const __m512i x0 = _mm512_shuffle_i32x4(m[k], m[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x1 = _mm512_shuffle_i32x4(m[k], m[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i y0 = _mm512_shuffle_i32x4(m[8 + k], m[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i y1 = _mm512_shuffle_i32x4(m[8 + k], m[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
    t[k] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + k] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + k] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + k] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 16; ++i) m[i] = t[i];
}

// The walk for bf16 on AVX-512 with its bf16 dot products (vdpbf16ps: 32 products a vector, summed in pairs into
// float lanes), for both products: Q.K over pairs of the head dimension, P.V over pairs of keys, with the
// probabilities rounded to bf16 (as torch's flash attention rounds them for its second GEMM). Each key tile is laid
// out once for that: K as [pair of dimensions][key] (16 x 16 transposes), V as [pair of keys][dimension]. The
// scores are scaled in float, so the query is used as it is. qw and sums are scratch for the item's rows. On 2 Zen 4
// cores, SmolLM2's 9/3 heads of 64, ms a layer, this walk / walk_float in bf16 / torch's flash attention on the
// gathered context: 2,048 tokens fresh 15 / 46 / 47; after 4,096 cached 72 / 240 / 196; 512 after 7,000 26 / 88 /
// 83; 16 after 2,000 0.27 / 0.75 / 2.6. About 335 GFLOP/s, 72% of what the two cores' vdpbf16ps can do (465,
// measured with independent chains): perf puts 73% of the walk's time in the products' two loops, which run at that
// rate, ~13% in the softmax, ~6% in the outputs' rescale and ~3% in laying out the tiles. Blocks of 4 rows x 64 keys
// and the degree-3 exponential ran 1.04-1.06x the earlier 8 rows x 32 keys with a degree-5 Taylor series (four chunk
// shapes, medians of three interleaved runs), the tiles without the new exponential 1.01-1.03x.
// (`python -m bench.cpu_attention` prints these rows, on a run that may differ by 20-30% on this shared machine.)
template <int64_t HEAD, typename QueryRow>
void walk_bf16(const Walk& w, QueryRow query_row, const c10::BFloat16* kc, const c10::BFloat16* vc, float scale,
               uint32_t* qw, float* sums, float* acc, float* row_max, float* row_sum) {
  static_assert(BF16_KEY_TILE == 64 && HEAD % 64 == 0 && BF16_ROW_BLOCK == 4);  // the masks below: 64 keys, 4 rows
  constexpr int64_t WORDS = HEAD / 2;  // bf16 pairs in a row
  constexpr int64_t TILE = BF16_KEY_TILE, VECS = TILE / 16;  // a row's scores: VECS vectors of 16
  const int64_t padded_rows = (w.rows + BF16_ROW_BLOCK - 1) / BF16_ROW_BLOCK * BF16_ROW_BLOCK;
  for (int64_t r = 0; r < w.rows; ++r) std::memcpy(qw + r * WORDS, query_row(r), HEAD * sizeof(c10::BFloat16));
  std::fill(qw + w.rows * WORDS, qw + padded_rows * WORDS, 0u);
  // Each row's sum of exponentials as 16 lanes, reduced once at the end (not once a tile); the maxes, in the walk,
  // are those of the scores times log2(e) (base 2: see exp2_16).
  std::fill(sums, sums + padded_rows * 16, 0.f);
  const float log2_scale = scale * 1.44269504f;
  alignas(64) uint32_t kt[WORDS * TILE];                // [p][j]: dimensions 2p, 2p+1 of key j
  alignas(64) uint32_t vt[TILE / 2 * HEAD];             // [i][d]: dimension d of keys 2i, 2i+1
  alignas(64) uint32_t pw[BF16_ROW_BLOCK][TILE / 2];    // the probabilities of keys 2i, 2i+1 in bf16
  const __m512i pair_low = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i pair_high = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t k0 = w.key_begin; k0 < w.key_end; k0 += TILE) {
    const int64_t num_keys = std::min(TILE, w.key_end - k0);
    int64_t offsets[TILE];
    w.offsets(k0, num_keys, offsets);
    const c10::BFloat16* keys[TILE];
    const c10::BFloat16* values[TILE];
    for (int64_t j = 0; j < num_keys; ++j) {
      keys[j] = kc + offsets[j];
      values[j] = vc + offsets[j];
    }
    for (int64_t j0 = 0; j0 < TILE; j0 += 16)
      for (int64_t p0 = 0; p0 < WORDS; p0 += 16) {
        __m512i m[16];
        for (int64_t j = 0; j < 16; ++j)
          m[j] = j0 + j < num_keys ? _mm512_loadu_si512(keys[j0 + j] + 2 * p0) : _mm512_setzero_si512();
        transpose16(m);
        for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(kt + (p0 + p) * TILE + j0, m[p]);
      }
    for (int64_t i = 0; i < TILE / 2; ++i)
      for (int64_t d = 0; d < HEAD; d += 32) {
        const __m512i a = 2 * i < num_keys ? _mm512_loadu_si512(values[2 * i] + d) : _mm512_setzero_si512();
        const __m512i b = 2 * i + 1 < num_keys ? _mm512_loadu_si512(values[2 * i + 1] + d) : _mm512_setzero_si512();
        // Per 128-bit lane L, dimensions d + 8L.. + 3 (low) and d + 8L + 4.. + 7 (high), put back in order.
        const __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
        _mm512_store_si512(vt + i * HEAD + d, _mm512_permutex2var_epi64(low, pair_low, high));
        _mm512_store_si512(vt + i * HEAD + d + 16, _mm512_permutex2var_epi64(low, pair_high, high));
      }
    const int64_t pairs = (num_keys + 1) / 2;
    for (int64_t r0 = 0; r0 < padded_rows; r0 += BF16_ROW_BLOCK) {
      // Every loop over the block's rows is unrolled, and nothing in them is a call, so that the scores stay in
      // registers (gcc otherwise stored all 16 accumulators at every step of the dot products: 1.6x slower).
      __m512 s[BF16_ROW_BLOCK][VECS];
#pragma GCC unroll 4
      for (int64_t b = 0; b < BF16_ROW_BLOCK; ++b)
#pragma GCC unroll 4
        for (int64_t c = 0; c < VECS; ++c) s[b][c] = _mm512_setzero_ps();
      for (int64_t p = 0; p < WORDS; ++p) {
        __m512bh k[VECS];
#pragma GCC unroll 4
        for (int64_t c = 0; c < VECS; ++c) k[c] = (__m512bh)_mm512_load_si512(kt + p * TILE + 16 * c);
#pragma GCC unroll 4
        for (int64_t b = 0; b < BF16_ROW_BLOCK; ++b) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[(r0 + b) * WORDS + p]));
#pragma GCC unroll 4
          for (int64_t c = 0; c < VECS; ++c) s[b][c] = _mm512_dpbf16_ps(s[b][c], qb, k[c]);
        }
      }
      // The online softmax: the tile's max of each row's visible scores, the rows' new maxes, and the factors
      // for their earlier sums and outputs (1 for a row that has seen no key yet).
      const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 seen[BF16_ROW_BLOCK][VECS];
      __mmask16 seen_rows = 0;
      alignas(64) float tile_max[16];
#pragma GCC unroll 4
      for (int64_t b = 0; b < BF16_ROW_BLOCK; ++b) {
        const int64_t visible = w.visible(r0 + b, k0, num_keys), hidden = w.hidden(r0 + b, k0, num_keys);
        const uint64_t keys_seen =
            (visible >= 64 ? ~0ull : (1ull << visible) - 1) & (hidden >= 64 ? 0ull : ~0ull << hidden);
        __m512 seen_max = lowest;
#pragma GCC unroll 4
        for (int64_t c = 0; c < VECS; ++c) {
          seen[b][c] = static_cast<__mmask16>(keys_seen >> (16 * c));
          seen_max = _mm512_mask_max_ps(seen_max, seen[b][c], seen_max, s[b][c]);
        }
        seen_rows |= static_cast<__mmask16>(visible > hidden) << b;
        tile_max[b] = _mm512_reduce_max_ps(seen_max);
      }
      const __m512 old_max = _mm512_maskz_loadu_ps(0xf, row_max + r0);
      const __m512 new_max =
          _mm512_max_ps(old_max, _mm512_mul_ps(_mm512_maskz_load_ps(0xf, tile_max), _mm512_set1_ps(log2_scale)));
      const __m512 factor =
          _mm512_mask_blend_ps(seen_rows, _mm512_set1_ps(1.f),
                               exp2_16(_mm512_max_ps(_mm512_sub_ps(old_max, new_max), _mm512_set1_ps(-127.f))));
      _mm512_mask_storeu_ps(row_max + r0, seen_rows, new_max);
      alignas(64) float maxes[16], rescale[16];
      _mm512_store_ps(maxes, new_max);
      _mm512_store_ps(rescale, factor);
#pragma GCC unroll 4
      for (int64_t b = 0; b < BF16_ROW_BLOCK; ++b) {
        // p = 2^(score * scale * log2(e) - max), in one product and one difference
        const __m512 c2 = _mm512_set1_ps(log2_scale), m = _mm512_set1_ps(maxes[b]);
        __m512 pr[VECS];
#pragma GCC unroll 4
        for (int64_t c = 0; c < VECS; ++c) pr[c] = exp2_16(_mm512_fmsub_ps(s[b][c], c2, m), seen[b][c]);
        float* sum = sums + (r0 + b) * 16;
        const __m512 tile_sum = _mm512_add_ps(_mm512_add_ps(pr[0], pr[1]), _mm512_add_ps(pr[2], pr[3]));
        _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_set1_ps(rescale[b]), tile_sum));
        _mm512_store_si512(pw[b], (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
        _mm512_store_si512(pw[b] + 16, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
      }
      // P.V in blocks of 4 rows x 64 dimensions: 16 accumulators.
      for (int64_t d0 = 0; d0 < HEAD; d0 += 64) {
        __m512 o[4][4];
        for (int64_t b = 0; b < 4; ++b)
          for (int64_t c = 0; c < 4; ++c)
            o[b][c] =
                _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + b) * HEAD + d0 + 16 * c), _mm512_set1_ps(rescale[b]));
        for (int64_t i = 0; i < pairs; ++i) {
          __m512bh v[4];
          for (int64_t c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_load_si512(vt + i * HEAD + d0 + 16 * c);
          for (int64_t b = 0; b < 4; ++b) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[b][i]));
            for (int64_t c = 0; c < 4; ++c) o[b][c] = _mm512_dpbf16_ps(o[b][c], pb, v[c]);
          }
        }
        for (int64_t b = 0; b < 4; ++b)
          for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (r0 + b) * HEAD + d0 + 16 * c, o[b][c]);
      }
    }
  }
  for (int64_t r = 0; r < w.rows; ++r) {
    row_sum[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + r * 16));
    row_max[r] *= 0.693147181f;  // back to the scores' base e, as the merge of split work takes them
  }
}
#endif

// HEAD is the head size when it is known at compile time (the loops over it then unroll and vectorize), or MAX_HEAD
// for any smaller head size: buffers then have rows of MAX_HEAD floats, and the padding stays zero.
template <typename T, int64_t HEAD>
void prefill_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                            at::Tensor& out) {
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
  // The most keys one item walks: its chunk's whole context, or its window and query tile.
  const int64_t longest = window ? std::min<int64_t>(*std::max_element(lens, lens + num_chunks), window + query_tile)
                                 : *std::max_element(lens, lens + num_chunks);
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

  // The walks take rows in blocks (so that one load of a key tile serves that many rows, and the block's scores
  // and outputs stay in registers): an item's rows are padded to whole blocks of 24, which every walk's blocks divide.
  const int64_t max_rows = (query_tile * group + 23) / 24 * 24;
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
    std::vector<uint32_t> qw(max_rows * HEAD / 2);
    std::vector<float> sums(max_rows * 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < num_work; ++work) {
      const Item item = items[work / splits];
      const int64_t chunk_len = starts[item.chunk + 1] - starts[item.chunk];
      const int64_t context = lens[item.chunk] - chunk_len;  // tokens cached before the chunk
      const int64_t num_positions = std::min(query_tile, chunk_len - item.first_row);
      const int64_t rows = item_rows(item);
      // This work's share of the keys from the first row's window to the tile's last position: whole key tiles.
      const int64_t key_end = context + item.first_row + num_positions;
      const int64_t key_lo = window ? std::max<int64_t>(0, context + item.first_row - window + 1) : 0;
      const int64_t num_key_tiles = (key_end - key_lo + KEY_TILE - 1) / KEY_TILE, split = work % splits;
      const Walk walk{tables + item.chunk * max_blocks,
                      block_size,
                      token_stride,
                      item.kv_head * head_size,
                      rows,
                      group,
                      context + item.first_row,
                      key_lo + split * num_key_tiles / splits * KEY_TILE,
                      std::min(key_end, key_lo + (split + 1) * num_key_tiles / splits * KEY_TILE),
                      window,
                      static_cast<float>(softcap)};
      const auto query_row = [&](int64_t r) {
        return q + (starts[item.chunk] - starts[0] + item.first_row + r / group) * q_token_stride +
               (item.kv_head * group + r % group) * q_head_stride;
      };
      std::fill_n(acc.data(), max_rows * HEAD, 0.f);
      std::fill_n(row_max.data(), max_rows, -std::numeric_limits<float>::infinity());
      std::fill_n(row_sum.data(), max_rows, 0.f);
      bool walked = false;  // by the bf16 walk, which has no soft-cap
#ifdef SPINDLE_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16> && (HEAD == 64 || HEAD == 128)) {
        if (softcap == 0.) {
          walk_bf16<HEAD>(walk, query_row, kc, vc, fscale, qw.data(), sums.data(), acc.data(), row_max.data(),
                          row_sum.data());
          walked = true;
        }
      }
#endif
      if (!walked) {
        const int64_t padded_rows = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
        std::fill_n(qf.data(), padded_rows * HEAD, 0.f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < head_size; ++d) qf[r * HEAD + d] = to_float(query_row(r)[d]) * fscale;
        walk_float<T, HEAD>(walk, qf.data(), kc, vc, head_size, kt.data(), vf.data(), acc.data(), row_max.data(),
                            row_sum.data());
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
// prefix and its own tokens, whose K/V must already be in the cache; block_tables[c] holds its blocks. window (0 for
// none) is how many positions, its own included, a token sees; softcap (0 for none) caps the scaled scores.
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
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
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0 for none)");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  DISPATCH_MODEL_TYPES(query.scalar_type(), "prefill_attention", [&] {
    switch (query.size(2)) {
      case 64:
        prefill_attention_impl<scalar_t, 64>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              window, softcap, out);
        break;
      case 128:
        prefill_attention_impl<scalar_t, 128>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              window, softcap, out);
        break;
      default:
        prefill_attention_impl<scalar_t, MAX_HEAD>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                              window, softcap, out);
    }
  });
  return out;
}
