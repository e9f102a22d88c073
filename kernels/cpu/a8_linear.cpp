// Grouped int8 and int4 projections with int8 activations on AVX2 (VNNI and AVX-512 where present): x @ W.T, W in
// spindle.kernels.quant's layout (GGUF's Q4_K/Q4_0/Q4_1 as int4 per 32, Q6_K/Q8_0/Q5_K as int8 per 16 or 32), laid
// out once by a8_pack, each call's rows quantized to int8 per block of 32 inputs on the fly (one scale per block, its
// largest magnitude / 127), as llama.cpp quantizes activations for its K-quant dot products.
//
// The weight-only kernels (quant_rows.h) widen each weight to float and run one FMA per weight and token: on AVX2 that
// is the limit, not reading the weights. Here weights and activations meet in vpmaddubsw (unsigned by signed bytes,
// pairs summed into int16) and vpmaddwd (pairs into int32). int4 values 0..15 are unsigned as they are; signed int8
// weights go in as |w| with the activation's sign flipped where w < 0 (vpsignb).
//
// a8_pack interleaves 8 output rows: one 32-byte register holds 4 consecutive inputs of each of the 8 rows, so a
// broadcast of the token's 4 activations and one vpmaddubsw give 8 rows' partial sums at once, in the lanes where they
// stay. A block of 32 inputs adds its 8 partial sums in int16 (int4: at most 8 x 2 x 15 x 127) or int32 (int8), then
// one conversion and one FMA by the 8 rows' scales x the token's block scale finish 8 rows' blocks: the float work per
// block is shared by 8 rows, where a row at a time spent it per row and a horizontal sum per row at the end. With VNNI
// (AVX-512's or AVX-VNNI), vpdpbusd does vpmaddubsw's, vpmaddwd's and the add's work in one instruction; with AVX-512,
// calls of several tokens run two panels side by side in 512-bit registers (panel_pair_dots).
//
// Offsets (w = q s + z, or (q - 8) s + z for int4) add z' x sum(x) per group (z' = z - 8 s for int4, packed so), the
// sum of the quantized x: the result is the exact product of the quantized activations and the weight
// (spindle.kernels.quant.a8_linear, the reference).
//
// A weight from GGUF's K-quants packs compact: its group scales are d x sc and its offsets z' = -dmin x m with sc an
// int8 and m a uint8 per group and d, dmin per super-block of 256 inputs (QuantizedWeight.super_scales; float16, as
// the file stores them), so the panel keeps 2 bytes a group and row where float32 scales and offsets took 8: a Q4_K
// weight reads 4.625 bits a weight instead of 6 (the file: 4.5), and single-stream decode reads its weights at memory
// speed.
//
// An int8 weight whose values all lie in -32..31 (GGUF's Q6_K; Q5_K's and Q5_1's 0..31, with their offsets) packs in 6
// bits: u = q + 32 in 0..63, its low nibbles laid out as int4's and its top 2 bits in two more chunks a block, so it
// is read at 6.56 bits a weight (Q6_K's own size; Q5_K 6.63 with its compact offsets) instead of 8.56 (8.63).
// vpmaddubsw takes u as it is; the -32 comes back as 32 x the token's integer sum over each 16 inputs.
//
// a8_grouped runs a stack of such weights (a MoE layer's experts, each packed alike), each over its own rows of x,
// in one OpenMP region: the rows are quantized once, and each weight's panels are shared out over the threads in
// turn, without a barrier between weights.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__F16C__)  // every AVX2 CPU has F16C; the compact factors are float16
#define SPINDLE_A8 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "common.h"

namespace {

constexpr int64_t BLOCK = 32;         // inputs per activation scale
constexpr int64_t ROWS = 8;           // output rows a packed panel interleaves (one float lane each)
constexpr int64_t CHUNK = 4;          // consecutive inputs of a row in one 32-bit lane
constexpr int64_t SUPER_BLOCK = 256;  // inputs per (d, dmin) of the compact form
constexpr int64_t TOKEN_BLOCK = 4;    // tokens run against a panel together (accumulators in registers)
constexpr int64_t TOKEN_PANEL = 64;   // tokens whose int8 rows stay in L2 while the weights stream past them
// From this many tokens a call is bound by the cores, not by memory: its units go out in chunks (about
// UNITS_PER_CHUNK a thread) as the threads free up, so that a core the host slows does not keep the other waiting at
// the region's end. Fewer tokens keep static halves, each thread streaming one contiguous half of the weight, which
// its prefetches run along (bench/results/a8_linear.md, stop 71).
constexpr int64_t BALANCED_TOKENS = 16;
constexpr int64_t UNITS_PER_CHUNK = 8;
// Tokens a pass of block_dots_chunked (AVX2 without VNNI) takes: 8 ran SmolLM2's int4 projections at 8-64 tokens
// 5-7% faster than 4 or 6 on a Zen 3, and its int8 LM head no slower (bench/results/a8_linear.md, stop 62).
constexpr int64_t CHUNKED_TOKEN_BLOCK = 8;
static_assert(TOKEN_PANEL % TOKEN_BLOCK == 0 && TOKEN_PANEL % CHUNKED_TOKEN_BLOCK == 0,
              "a block of tokens never crosses a panel");

// Each row of x as int8 blocks of BLOCK inputs with one scale each; and, for offsets, the sums of the quantized x
// over each weight group.
struct Activations {
  std::unique_ptr<int8_t[]> values;    // [tokens][inputs]
  std::unique_ptr<float[]> scales;     // [tokens][inputs / BLOCK]
  std::vector<float> sums;             // [tokens][inputs / group_size], empty without offsets
  std::unique_ptr<int32_t[]> half_sums;  // [tokens][inputs / 16]: the sums of the quantized x, for weights read biased
};

// Rows [begin, end) of x against weight `weight` of a stack (one weight: 0 for all the rows).
struct Segment {
  int64_t weight, begin, end;
};

// The packed weight's form: int4 (with offsets), 6-bit (u = q + 32, no offsets) or int8.
enum class Format { INT4, INT6, INT8 };

// Bytes a packed block of BLOCK inputs x ROWS rows takes.
constexpr int64_t block_bytes_of(Format format) {
  return format == Format::INT4 ? BLOCK / 2 * ROWS : format == Format::INT6 ? BLOCK * 3 / 4 * ROWS : BLOCK * ROWS;
}

#ifdef SPINDLE_A8
// The 8 int32 lanes of v summed.
inline int32_t lane_sum(__m256i v) {
  __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  four = _mm_add_epi32(four, _mm_shuffle_epi32(four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, _MM_SHUFFLE(2, 3, 0, 1))));
}

// sum += scale x integer, the product rounded before the sum as the reference rounds it (-ffast-math would let the
// compiler fuse the two where a group spans several blocks).
inline void add_product(float& sum, float scale, int32_t integer) {
  const __m128 product = _mm_mul_ss(_mm_set_ss(scale), _mm_set_ss(static_cast<float>(integer)));
  sum = _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(sum), product));
}

// Each row of x quantized to int8 per block of 32 inputs, 8 lanes at a time (a scalar loop spent 8-11% of a
// 512-token int4 projection here: its horizontal maximum and sums did not vectorize).
template <typename T>
Activations quantize_activations(const T* x, int64_t stride, int64_t tokens, int64_t inputs, int64_t group_size,
                                 bool with_sums, bool with_half_sums) {
  const int64_t blocks = inputs / BLOCK, groups = inputs / group_size, halves = inputs / (BLOCK / 2);
  // Left uninitialised but the sums, which blocks add to: every other value is written before it is read.
  Activations a{std::unique_ptr<int8_t[]>(new int8_t[tokens * inputs]),
                std::unique_ptr<float[]>(new float[tokens * blocks]),
                std::vector<float>(with_sums ? tokens * groups : 0, 0.f),
                std::unique_ptr<int32_t[]>(new int32_t[with_half_sums ? tokens * halves : 0])};
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(NO_SIGN)));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving of lanes
#pragma omp parallel for if (tokens >= 16)
  for (int64_t m = 0; m < tokens; ++m) {
    const T* row = x + m * stride;
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 values[4];
      for (int i = 0; i < 4; ++i) values[i] = load8(row + b * BLOCK + 8 * i);
      const __m256 eight = _mm256_max_ps(
          _mm256_max_ps(_mm256_and_ps(values[0], no_sign), _mm256_and_ps(values[1], no_sign)),
          _mm256_max_ps(_mm256_and_ps(values[2], no_sign), _mm256_and_ps(values[3], no_sign)));
      __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
      four = _mm_max_ps(four, _mm_movehl_ps(four, four));
      const float largest = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
      const float scale = largest / 127.f;
      a.scales[m * blocks + b] = scale;
      // x x (1 / scale) rounded to nearest, as the reference's x / scale (a value at a rounding tie may land a level
      // apart: the tests allow such near ties). An all-zero block is all zeros.
      const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 1.f / scale : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.values.get() + m * inputs + b * BLOCK),
                          _mm256_permutevar8x32_epi32(bytes, in_order));
      if (!with_sums && !with_half_sums) continue;
      const int32_t half[2] = {lane_sum(_mm256_add_epi32(q[0], q[1])), lane_sum(_mm256_add_epi32(q[2], q[3]))};
      if (with_sums) {  // per group, or per half block for groups of 16
        if (group_size == 16) {
          for (int64_t h = 0; h < 2; ++h) add_product(a.sums[m * groups + 2 * b + h], scale, half[h]);
        } else {
          add_product(a.sums[m * groups + b * BLOCK / group_size], scale, half[0] + half[1]);
        }
      }
      if (with_half_sums) {
        for (int64_t h = 0; h < 2; ++h) a.half_sums[m * halves + 2 * b + h] = half[h];
      }
    }
  }
  return a;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPINDLE_A8_VNNI 1
// acc + the sums of each 32-bit lane's 4 products of u's unsigned and s's signed bytes: vpdpbusd, one instruction for
// vpmaddubsw, vpmaddwd and the add. No sum below saturates vpmaddubsw's int16 pairs, so both give the same integers.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define SPINDLE_A8_VNNI 1
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// Where vpdpbusd runs, int8 weights are read biased, as unsigned w + 128 (their bytes XOR 0x80), and each half block's
// sums start at -128 x the token's sum over those inputs: the same integers as |w| against x signed by w, one
// instruction a chunk and token fewer. Without VNNI, vpmaddubsw's int16 pairs would saturate on the biased bytes.
#ifdef SPINDLE_A8_VNNI
constexpr bool BIASED_INT8 = true;
#else
constexpr bool BIASED_INT8 = false;
#endif

// The bias the walk's unsigned bytes carry in format F (6-bit weights are stored as u = q + 32), 0 for none: the
// half-block sums of x (Activations::half_sums) that take it back out are needed where it is not 0.
template <Format F>
constexpr int32_t WEIGHT_BIAS = F == Format::INT6 ? 32 : F == Format::INT8 && BIASED_INT8 ? 128 : 0;

// The int8 weight bytes of chunk `raw` as the walk multiplies them: biased (see BIASED_INT8), else their magnitudes.
inline __m256i int8_weights(__m256i raw) {
  return BIASED_INT8 ? _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80))) : _mm256_abs_epi8(raw);
}

// The token's 4 activations at x, in every 32-bit lane.
inline __m256i broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  return _mm256_set1_epi32(four);
}

// Bytes ahead of the block in use that each block prefetches: a single stream decode is a race to read the weights, and
// the hardware prefetcher alone left them at 60-75% of the read bandwidth (bench/results/a8_linear.md, prefetch).
constexpr int64_t PREFETCH_DISTANCE = 4096;

inline __m256 load_rows(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_rows(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A panel's scales and offsets per group, 8 rows each: [groups][8] as packed, float32 or (where float16 holds every
// one exactly) float16.
template <typename S>
struct GroupScales {
  const S* scales;
  const S* offsets;  // null without offsets
  __m256 scale(int64_t g, int64_t) const { return load_rows(scales + g * ROWS); }
  // acc[m] += sum over groups of the offsets x token m's sums (sums: token 0's, a row of `groups` each).
  template <int M>
  void add_offsets(const float* sums, int64_t groups, int64_t, __m256 acc[M]) const {
    __m256 shift[M];
    for (int m = 0; m < M; ++m) shift[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 z = load_rows(offsets + g * ROWS);
      for (int m = 0; m < M; ++m) shift[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(sums[m * groups + g]), shift[m]);
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm256_add_ps(acc[m], shift[m]);
  }
};

// The compact form: int8 sub-scales and uint8 sub-minimums [groups][8], float16 d (and dmin, with offsets)
// [supers][factors][8].
struct CompactScales {
  const int8_t* sub_scales;
  const uint8_t* offsets;  // the sub-minimums; null without offsets
  const c10::Half* supers;
  int64_t factors;  // 2 with offsets (d, dmin), else 1 (d)
  __m256 factor(int64_t super, int64_t which) const {
    const auto* at = reinterpret_cast<const __m128i*>(supers + (super * factors + which) * ROWS);
    return _mm256_cvtph_ps(_mm_loadu_si128(at));
  }
  __m256 scale(int64_t g, int64_t super) const {
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub_scales + g * ROWS)));
    return _mm256_mul_ps(factor(super, 0), _mm256_cvtepi32_ps(sc));
  }
  // acc[m] -= dmin x (sum over each super-block's groups of m x token m's sums): dmin applied once a super-block.
  template <int M>
  void add_offsets(const float* sums, int64_t groups, int64_t group_size, __m256 acc[M]) const {
    const int64_t per_super = SUPER_BLOCK / group_size;
    for (int64_t super = 0; super < groups / per_super; ++super) {
      __m256 partial[M];
      for (int m = 0; m < M; ++m) partial[m] = _mm256_setzero_ps();
      for (int64_t g = super * per_super; g < (super + 1) * per_super; ++g) {
        const __m256 mins = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(offsets + g * ROWS))));
        for (int m = 0; m < M; ++m) {
          partial[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(sums[m * groups + g]), partial[m]);
        }
      }
      const __m256 dmin = factor(super, 1);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fnmadd_ps(dmin, partial[m], acc[m]);
    }
  }
};


// The forms whose calls of several tokens run block_dots_chunked: int4, and int8 in groups of 32 or more, without VNNI.
#ifdef SPINDLE_A8_VNNI
template <Format F, bool SIXTEEN>
constexpr bool CHUNKED = false;
#else
template <Format F, bool SIXTEEN>
constexpr bool CHUNKED = F == Format::INT4 || (F == Format::INT8 && !SIXTEEN);
#endif

#ifndef SPINDLE_A8_VNNI
// block_dots for several tokens without VNNI, int4 and int8 in groups of 32 or more, chunk by chunk: each chunk (int4:
// its two nibble halves; int8: its magnitudes, their signs moved to x) meets every token's activations, so that one
// or two chunks are live at once, not the block's 8 against every token (which spilled to the stack). The empty asm
// after each sum's add keeps it a chain: gcc otherwise reassociated the adds into a tree that held every product at
// once, and spilled again. The integers and the float steps are block_dots', so the results are too (rates:
// bench/results/a8_linear.md, stop 62; 6 bits in groups of 16 ran no faster this way, stop 63).
template <int M, Format F>
inline void block_dots_chunked(const uint8_t* q, const int8_t* x, int64_t inputs, const float* token_scales,
                               int64_t blocks, const __m256& scale, __m256 acc[M]) {
  const __m256i* chunks = reinterpret_cast<const __m256i*>(q);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i totals[M];  // int4: int16 pairs until the block's end; int8: int32
  if constexpr (F == Format::INT4) {  // 8 x 2 x 15 x 127 fits int16
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(chunks + c);
      const __m256i low = _mm256_and_si256(raw, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int8_t* xm = x + m * inputs;
        const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(xm + 4 * c)),
                                              _mm256_maddubs_epi16(high, broadcast4(xm + 16 + 4 * c)));
        totals[m] = c == 0 ? both : _mm256_add_epi16(totals[m], both);
        asm("" : "+x"(totals[m]));
      }
    }
    for (int m = 0; m < M; ++m) totals[m] = _mm256_madd_epi16(totals[m], ones);
  } else {  // each product pair may fill int16: into int32 at once
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m256i raw = _mm256_loadu_si256(chunks + k), magnitude = _mm256_abs_epi8(raw);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i x4 = _mm256_sign_epi8(broadcast4(x + m * inputs + 4 * k), raw);
        const __m256i four = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x4), ones);
        totals[m] = k == 0 ? four : _mm256_add_epi32(totals[m], four);
        asm("" : "+x"(totals[m]));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m256 token_scale = _mm256_set1_ps(token_scales[m * blocks]);
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[m]), _mm256_mul_ps(scale, token_scale), acc[m]);
  }
}
#endif

// One block of 32 inputs of a packed panel (q: its block_bytes_of(F) bytes) against M tokens' blocks (x: token m0's,
// the others a row of inputs after it; half_sums: token m0's, for biased weights): acc[m] += the 8 rows' dot products x
// scale x token scale. SIXTEEN: scales are the block's two halves' scales, 8 rows each; else scales[0] is the
// block's group's.
template <int M, Format F, bool SIXTEEN>
inline void block_dots(const uint8_t* q, const int8_t* x, int64_t inputs, const float* token_scales, int64_t blocks,
                       const int32_t* half_sums, const __m256 scales[2], __m256 acc[M]) {
#ifndef SPINDLE_A8_VNNI
  // One token (a single stream's step) keeps this order: the chunked one was no faster there.
  if constexpr (M > 1 && CHUNKED<F, SIXTEEN>) {
    block_dots_chunked<M, F>(q, x, inputs, token_scales, blocks, scales[0], acc);
    return;
  }
#endif
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const __m256i* chunks = reinterpret_cast<const __m256i*>(q);
  __m256i w[BLOCK / CHUNK];  // chunk k: inputs 4k..4k+3 of the 8 rows (int4, 6-bit unpacked; int8: int8_weights)
  if constexpr (F == Format::INT8) {
    for (int k = 0; k < 8; ++k) w[k] = int8_weights(_mm256_loadu_si256(chunks + k));
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(chunks + c);
      w[c] = _mm256_and_si256(raw, nibble);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    }
  }
  if constexpr (F == Format::INT6) {  // chunk 4h + t's top 2 bits: bits 2t, 2t + 1 of chunk 4 + h's bytes
    const __m256i top = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i high = _mm256_loadu_si256(chunks + 4 + h);
      w[4 * h] = _mm256_or_si256(w[4 * h], _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
      w[4 * h + 1] = _mm256_or_si256(w[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
      w[4 * h + 2] = _mm256_or_si256(w[4 * h + 2], _mm256_and_si256(high, top));
      w[4 * h + 3] = _mm256_or_si256(w[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
    }
  }
  for (int m = 0; m < M; ++m) {
    const int8_t* xm = x + m * inputs;
    const __m256 token_scale = _mm256_set1_ps(token_scales[m * blocks]);
    if constexpr (F == Format::INT4) {  // 8 x 2 x 15 x 127 fits int16
#ifdef SPINDLE_A8_VNNI
      __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // two chains of dependent vpdpbusd
      for (int k = 0; k < 8; ++k) sums[k % 2] = dot4(sums[k % 2], w[k], broadcast4(xm + 4 * k));
      const __m256i total = _mm256_add_epi32(sums[0], sums[1]);
#else
      __m256i pairs = _mm256_maddubs_epi16(w[0], broadcast4(xm));
      for (int k = 1; k < 8; ++k) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[k], broadcast4(xm + 4 * k)));
      const __m256i total = _mm256_madd_epi16(pairs, ones);
#endif
      const __m256 scale = _mm256_mul_ps(scales[0], token_scale);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[m]);
    } else {
      __m256i halves[2];
      for (int h = 0; h < 2; ++h) {
        if constexpr (WEIGHT_BIAS<F> != 0) {  // 6-bit: 2 x 2 x 63 x 127 fits int16; the bias by the half sums
          __m256i sum = _mm256_set1_epi32(-WEIGHT_BIAS<F> * half_sums[m * inputs / (BLOCK / 2) + h]);
#ifdef SPINDLE_A8_VNNI
          for (int k = 4 * h; k < 4 * h + 4; ++k) sum = dot4(sum, w[k], broadcast4(xm + 4 * k));
#else
          for (int k = 4 * h; k < 4 * h + 4; k += 2) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w[k], broadcast4(xm + 4 * k)),
                                                   _mm256_maddubs_epi16(w[k + 1], broadcast4(xm + 4 * k + 4)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
          }
#endif
          halves[h] = sum;
        } else {
          halves[h] = _mm256_setzero_si256();
          for (int k = 4 * h; k < 4 * h + 4; ++k) {
            const __m256i x4 = _mm256_sign_epi8(broadcast4(xm + 4 * k), _mm256_loadu_si256(chunks + k));
#ifdef SPINDLE_A8_VNNI
            halves[h] = dot4(halves[h], w[k], x4);
#else
            halves[h] = _mm256_add_epi32(halves[h], _mm256_madd_epi16(_mm256_maddubs_epi16(w[k], x4), ones));
#endif
          }
        }
      }
      if constexpr (SIXTEEN) {
        for (int h = 0; h < 2; ++h) {
          const __m256 scale = _mm256_mul_ps(scales[h], token_scale);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves[h]), scale, acc[m]);
        }
      } else {
        const __m256 scale = _mm256_mul_ps(scales[0], token_scale);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(halves[0], halves[1])), scale, acc[m]);
      }
    }
  }
}

// Walks a panel's blocks in order, each with its scales: its two halves' (groups of 16) or its group's, computed once a
// group and the second vector `zero`. scale(g, super) is group g's scale vector (super: its super-block of 256).
template <bool SIXTEEN, typename Vector, typename ScaleOf, typename Block>
inline void for_each_block(int64_t inputs, int64_t group_size, Vector zero, const ScaleOf& scale, const Block& block) {
  const int64_t blocks = inputs / BLOCK, per_super = SUPER_BLOCK / BLOCK;
  if constexpr (SIXTEEN) {
    for (int64_t b = 0; b < blocks; ++b) {
      const Vector halves[2] = {scale(2 * b, b / per_super), scale(2 * b + 1, b / per_super)};
      block(b, halves);
    }
  } else {
    const int64_t group_blocks = group_size / BLOCK;
    for (int64_t b = 0, g = 0; b < blocks; b += group_blocks, ++g) {
      const Vector group_scale[2] = {scale(g, b / per_super), zero};
      for (int64_t i = b; i < b + group_blocks; ++i) block(i, group_scale);
    }
  }
}

// One packed panel's dot products with M tokens (rows of a, from token m0): acc[m] (lane j: row j).
// q: the panel's blocks; scales: its groups' (GroupScales or CompactScales). Groups of 16 split each block; larger
// ones span blocks, their scale computed once. The offsets gather in their own accumulators, so that they do not
// lengthen the chain of FMAs into acc. prefetch: whether its blocks prefetch the weights ahead (PREFETCH_DISTANCE).
template <int M, Format F, bool SIXTEEN, typename Scales>
inline void panel_dots(const Activations& a, int64_t m0, int64_t inputs, const uint8_t* q, const Scales& scales,
                       int64_t group_size, bool prefetch, __m256 acc[M]) {
  const int64_t blocks = inputs / BLOCK, block_bytes = block_bytes_of(F);
  const int8_t* x = a.values.get() + m0 * inputs;
  const float* token_scales = a.scales.get() + m0 * blocks;
  const int32_t* half_sums = WEIGHT_BIAS<F> != 0 ? a.half_sums.get() + m0 * (inputs / (BLOCK / 2)) : nullptr;
  // A local copy: stores through acc, which the int8 loads may alias, would keep the sums in memory.
  __m256 sums[M];
  for (int m = 0; m < M; ++m) sums[m] = acc[m];
  auto block = [&](int64_t b, const __m256 block_scales[2]) {
    for (int64_t line = 0; prefetch && line < block_bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(q + b * block_bytes + line + PREFETCH_DISTANCE), _MM_HINT_T0);
    }
    block_dots<M, F, SIXTEEN>(q + b * block_bytes, x + b * BLOCK, inputs, token_scales + b, blocks,
                              half_sums ? half_sums + 2 * b : nullptr, block_scales, sums);
  };
  const auto scale = [&](int64_t g, int64_t super) { return scales.scale(g, super); };
  for_each_block<SIXTEEN>(inputs, group_size, _mm256_setzero_ps(), scale, block);
  if (scales.offsets != nullptr) {
    const int64_t groups = inputs / group_size;
    scales.template add_offsets<M>(a.sums.data() + m0 * groups, groups, group_size, sums);
  }
  for (int m = 0; m < M; ++m) acc[m] = sums[m];
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPINDLE_A8_512 1
// Two panels side by side in 512-bit registers, 16 rows (AVX-512 VNNI): the same packed layout, panel p's 8 rows in
// the lower half and panel p + 1's in the upper, so each vpdpbusd takes a token's 4 activations against 16 rows, half
// the instructions of two 8-row passes. The integer sums are the 8-row path's, as are the float steps per lane. Calls
// of this many tokens or more run it; fewer, which read the weights at memory speed, lost to the 8-row path (SmolLM2's
// 30 layers on 2 Zen 5 cores, bf16: 64 tokens 29.1 -> 20.0 ms, 256 tokens 114 -> 72, but 1 token 2.4 -> 3.0). At 6
// and 7 tokens (a verifying step of 5 or 6 drafts) one pass of the pair path beat the 8-row path's 4 + 2 or 3 (Zen 4:
// 4.8-5.3 against 5.3-5.6 ms, 5.3-5.4 against 5.9-6.2); at 5 they tied (bench/results/a8_linear.md).
constexpr int64_t PAIR_TOKENS = 6;

// Chunk c of two panels' blocks: the first's in the lower half, the second's in the upper.
inline __m512i load_pair(const uint8_t* q0, const uint8_t* q1, int64_t c) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0) + c);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1) + c),
                            1);
}

inline __m512 pair_of(__m256 low, __m256 high) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}

// block_dots over two panels' blocks (q0, q1): acc[m] (lane j < 8: row j of the first panel, else row j - 8 of the
// second) += the 16 rows' dot products x scale x token scale.
template <int M, Format F, bool SIXTEEN>
inline void block_dots_pair(const uint8_t* q0, const uint8_t* q1, const int8_t* x, int64_t inputs,
                            const float* token_scales, int64_t blocks, const int32_t* half_sums,
                            const __m512 scales[2], __m512 acc[M]) {
  __m512i w[BLOCK / CHUNK];  // as block_dots' w, for 16 rows
  if constexpr (F == Format::INT8) {
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < 8; ++k) w[k] = _mm512_xor_si512(load_pair(q0, q1, k), bias);  // as int8_weights
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = load_pair(q0, q1, c);
      w[c] = _mm512_and_si512(raw, nibble);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
  }
  if constexpr (F == Format::INT6) {
    const __m512i top = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i high = load_pair(q0, q1, 4 + h);
      w[4 * h] = _mm512_or_si512(w[4 * h], _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
      w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
      w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(high, top));
      w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(high, 2), top));
    }
  }
  for (int m = 0; m < M; ++m) {
    const int8_t* xm = x + m * inputs;
    const auto broadcast = [&](int k) {
      int32_t four;
      std::memcpy(&four, xm + 4 * k, sizeof(four));
      return _mm512_set1_epi32(four);
    };
    const __m512 token_scale = _mm512_set1_ps(token_scales[m * blocks]);
    if constexpr (F == Format::INT4) {
      __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int k = 0; k < 8; ++k) sums[k % 2] = _mm512_dpbusd_epi32(sums[k % 2], w[k], broadcast(k));
      const __m512 scale = _mm512_mul_ps(scales[0], token_scale);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sums[0], sums[1])), scale, acc[m]);
    } else {
      static_assert(WEIGHT_BIAS<F> != 0, "the pair path reads 6-bit and int8 weights biased");
      __m512i halves[2];
      for (int h = 0; h < 2; ++h) {
        halves[h] = _mm512_set1_epi32(-WEIGHT_BIAS<F> * half_sums[m * inputs / (BLOCK / 2) + h]);
        for (int k = 4 * h; k < 4 * h + 4; ++k) halves[h] = _mm512_dpbusd_epi32(halves[h], w[k], broadcast(k));
      }
      if constexpr (SIXTEEN) {
        for (int h = 0; h < 2; ++h) {
          const __m512 scale = _mm512_mul_ps(scales[h], token_scale);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(halves[h]), scale, acc[m]);
        }
      } else {
        const __m512 scale = _mm512_mul_ps(scales[0], token_scale);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(halves[0], halves[1])), scale, acc[m]);
      }
    }
  }
}

// panel_dots over panels q0 and q1 (scales s0, s1): the 16 rows' products in acc, then each panel's offsets added to
// its half, returned as (first panel's acc, second's).
template <int M, Format F, bool SIXTEEN, typename Scales>
inline void panel_pair_dots(const Activations& a, int64_t m0, int64_t inputs, const uint8_t* q0, const uint8_t* q1,
                            const Scales& s0, const Scales& s1, int64_t group_size, bool prefetch, __m256 low[M],
                            __m256 high[M]) {
  const int64_t blocks = inputs / BLOCK, block_bytes = block_bytes_of(F);
  const int8_t* x = a.values.get() + m0 * inputs;
  const float* token_scales = a.scales.get() + m0 * blocks;
  const int32_t* half_sums = WEIGHT_BIAS<F> != 0 ? a.half_sums.get() + m0 * (inputs / (BLOCK / 2)) : nullptr;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  auto block = [&](int64_t b, const __m512 block_scales[2]) {
    for (int64_t line = 0; prefetch && line < block_bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(q0 + b * block_bytes + line + PREFETCH_DISTANCE), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q1 + b * block_bytes + line + PREFETCH_DISTANCE), _MM_HINT_T0);
    }
    block_dots_pair<M, F, SIXTEEN>(q0 + b * block_bytes, q1 + b * block_bytes, x + b * BLOCK, inputs,
                                   token_scales + b, blocks, half_sums ? half_sums + 2 * b : nullptr, block_scales,
                                   acc);
  };
  const auto scale = [&](int64_t g, int64_t super) { return pair_of(s0.scale(g, super), s1.scale(g, super)); };
  for_each_block<SIXTEEN>(inputs, group_size, _mm512_setzero_ps(), scale, block);
  for (int m = 0; m < M; ++m) {
    low[m] = _mm512_castps512_ps256(acc[m]);
    high[m] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
  }
  if (s0.offsets != nullptr) {
    const int64_t groups = inputs / group_size;
    s0.template add_offsets<M>(a.sums.data() + m0 * groups, groups, group_size, low);
    s1.template add_offsets<M>(a.sums.data() + m0 * groups, groups, group_size, high);
  }
}
#endif

// Each segment's rows against all panels of its weight (packed + weight x weight_bytes). panel_scales(w, p): weight
// w's panel p's scales (GroupScales or CompactScales). Within one OpenMP region, every segment's panels are split
// over the threads in turn (static halves or chunks: see BALANCED_TOKENS; no barrier between segments).
template <typename T, Format F, bool SIXTEEN, typename PanelScales>
void run(const Activations& a, const std::vector<Segment>& segments, int64_t inputs, const uint8_t* packed,
         int64_t weight_bytes, PanelScales panel_scales, int64_t group_size, int64_t outputs, T* out,
         int64_t out_stride) {
  const int64_t panels = (outputs + ROWS - 1) / ROWS, panel_bytes = inputs / BLOCK * block_bytes_of(F);
  // Token m's results of panel p, acc's lanes, written to its row of out.
  const auto store = [&](int64_t m, int64_t p, __m256 acc) {
    T* row = out + m * out_stride + p * ROWS;
    if ((p + 1) * ROWS <= outputs) {
      store8(row, acc);
      return;
    }
    alignas(32) float totals[ROWS];
    _mm256_store_ps(totals, acc);
    for (int64_t j = 0; j < outputs - p * ROWS; ++j) row[j] = from_float<T>(totals[j]);
  };
#pragma omp parallel
  for (const Segment& segment : segments) {
    const int64_t w = segment.weight;
    const uint8_t* weight = packed + w * weight_bytes;
    // The work is split in units of two panels where AVX-512 runs them together, else of one.
#ifdef SPINDLE_A8_512
    const int64_t panels_per_unit = segment.end - segment.begin >= PAIR_TOKENS ? 2 : 1;
#else
    const int64_t panels_per_unit = 1;
#endif
    const int64_t units = (panels + panels_per_unit - 1) / panels_per_unit;
    // Tokens a pass takes (accumulators in registers): AVX-512's 32 registers hold twice AVX2's block;
    // block_dots_chunked keeps fewer values live a token.
    const int64_t token_block = panels_per_unit == 2 ? 2 * TOKEN_BLOCK
                                : CHUNKED<F, SIXTEEN>   ? CHUNKED_TOKEN_BLOCK
                                                        : TOKEN_BLOCK;
    for (int64_t first_token = segment.begin; first_token < segment.end; first_token += TOKEN_PANEL) {
      const int64_t last_token = std::min(first_token + TOKEN_PANEL, segment.end);
      const auto run_unit = [&](int64_t u) {
        const int64_t p = u * panels_per_unit;
        const auto scales = panel_scales(w, p);
        for (int64_t m0 = first_token; m0 < last_token; m0 += token_block) {
          with_tokens(std::min(token_block, last_token - m0), [&](auto block) {
            constexpr int M = decltype(block)::value;
            // The first token block's pass brings the panels in; the later ones read them from cache.
            const bool first = m0 == first_token;
#ifdef SPINDLE_A8_512
            if (panels_per_unit == 2 && p + 1 < panels) {
              __m256 low[M], high[M];
              panel_pair_dots<M, F, SIXTEEN>(a, m0, inputs, weight + p * panel_bytes, weight + (p + 1) * panel_bytes,
                                             scales, panel_scales(w, p + 1), group_size, first, low, high);
              for (int m = 0; m < M; ++m) {
                store(m0 + m, p, low[m]);
                store(m0 + m, p + 1, high[m]);
              }
              return;
            }
#endif
            __m256 acc[M];
            for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
            panel_dots<M, F, SIXTEEN>(a, m0, inputs, weight + p * panel_bytes, scales, group_size, first, acc);
            for (int m = 0; m < M; ++m) store(m0 + m, p, acc[m]);
          });
        }
      };
      if (segment.end - segment.begin >= BALANCED_TOKENS) {
        const int64_t chunk = std::max<int64_t>(1, units / (UNITS_PER_CHUNK * omp_get_num_threads()));
#pragma omp for schedule(dynamic, chunk) nowait
        for (int64_t u = 0; u < units; ++u) run_unit(u);
      } else {
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; ++u) run_unit(u);
      }
    }
  }
}
#endif

// Checks the inputs and groups the kernel runs: in_features a multiple of 32, groups of 16 (int8) or a multiple of 32.
void check_layout(bool int4, int64_t inputs, int64_t group_size) {
  TORCH_CHECK(inputs % BLOCK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK((group_size == 16 && !int4) || (group_size > 0 && group_size % BLOCK == 0 && inputs % group_size == 0),
              "group_size must be a multiple of 32 that divides in_features (or 16 for int8)");
}

// Whether every value of an int8 weight lies in -32..31 (GGUF's Q6_K, Q5_K, Q5_1, Q5_0): then it packs in 6 bits.
bool fits_six_bits(const at::Tensor& qweight) {
  const auto* q = qweight.data_ptr<int8_t>();
  bool fits = true;
#pragma omp parallel for reduction(&& : fits)
  for (int64_t i = 0; i < qweight.numel(); ++i) fits = fits && q[i] >= -32 && q[i] < 32;
  return fits;
}

}  // namespace

bool a8_linear_supported() {
#ifdef SPINDLE_A8
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> a8_pack(
    const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros, int64_t group_size,
    const std::optional<at::Tensor>& super_scales) {
  const auto [int4, inputs, groups] = check_quantized_weight(
      qweight, scales, zeros, group_size, [&](bool int4, int64_t inputs) { check_layout(int4, inputs, group_size); });
  const bool compact = super_scales.has_value(), offsets = zeros.has_value();
  const Format format = int4 ? Format::INT4 : fits_six_bits(qweight) ? Format::INT6 : Format::INT8;
  const int64_t outputs = qweight.size(0), panels = (outputs + ROWS - 1) / ROWS, blocks = inputs / BLOCK;
  const int64_t row_bytes = qweight.size(1), block_bytes = block_bytes_of(format);
  const int64_t supers = inputs / SUPER_BLOCK;
  if (compact) {
    TORCH_CHECK((group_size == 16 || group_size == 32) && inputs % SUPER_BLOCK == 0,
                "super_scales need groups of 16 or 32 and in_features a multiple of 256");
    TORCH_CHECK(super_scales->is_contiguous() && super_scales->scalar_type() == at::kFloat &&
                    super_scales->numel() == outputs * supers * 2,
                "super_scales must be dense float32 [out, in / 256, 2]");
  }
  const auto packed_type = format == Format::INT8 ? at::kChar : at::kByte;
  at::Tensor packed = at::zeros({panels, blocks * block_bytes}, qweight.options().dtype(packed_type));
  at::Tensor panel_scales = at::zeros({panels, groups, ROWS}, scales.options().dtype(compact ? at::kChar : at::kFloat));
  std::optional<at::Tensor> panel_offsets, panel_supers;
  if (offsets) {
    panel_offsets = at::zeros({panels, groups, ROWS}, scales.options().dtype(compact ? at::kByte : at::kFloat));
  }
  const int64_t factors = offsets ? 2 : 1;  // (d, dmin), or d alone
  if (compact) panel_supers = at::zeros({panels, supers, factors, ROWS}, scales.options().dtype(at::kHalf));
  const auto* q = static_cast<const uint8_t*>(qweight.data_ptr());
  auto* to = static_cast<uint8_t*>(packed.data_ptr());
  const float* s = scales.data_ptr<float>();
  const float* z = offsets ? zeros->data_ptr<float>() : nullptr;
  const float* given = compact ? super_scales->data_ptr<float>() : nullptr;  // (d, dmin) [out, supers]
  void* to_scales = panel_scales.data_ptr();  // float32, or int8 sub-scales
  void* to_offsets = offsets ? panel_offsets->data_ptr() : nullptr;  // float32, or uint8 sub-minimums
  c10::Half* to_supers = compact ? panel_supers->data_ptr<c10::Half>() : nullptr;
  int64_t inexact = -1;  // a row whose scales or offsets the super-block factors do not give exactly
#pragma omp parallel for
  for (int64_t n = 0; n < outputs; ++n) {
    const int64_t p = n / ROWS, j = n % ROWS;
    const uint8_t* row = q + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = to + p * blocks * block_bytes + b * block_bytes;
      const int64_t first = b * BLOCK;
      if (format == Format::INT8) {
        for (int64_t k = 0; k < 8; ++k) std::memcpy(block + k * 32 + j * CHUNK, row + first + k * CHUNK, CHUNK);
        continue;
      }
      // int4 and 6 bits: chunk c's low nibbles hold inputs 4c..4c+3, its high ones 16 + 4c.. (nibble(i): input i's)
      const auto value = [&](int64_t i) {  // int4: q; 6 bits: u = q + 32
        return int4 ? (row[i / 2] >> (4 * (i % 2))) & 0xF : static_cast<int8_t>(row[i]) + 32;
      };
      for (int64_t c = 0; c < 4; ++c) {
        for (int64_t t = 0; t < CHUNK; ++t) {
          const int64_t i = first + c * CHUNK + t;
          block[c * 32 + j * CHUNK + t] = static_cast<uint8_t>((value(i) & 0xF) | ((value(i + 16) & 0xF) << 4));
        }
      }
      if (format == Format::INT6) {  // chunk 4 + h: bits 2t, 2t + 1 hold the top 2 bits of chunk 4h + t's inputs
        for (int64_t h = 0; h < 2; ++h) {
          for (int64_t t = 0; t < CHUNK; ++t) {
            int top = 0;
            for (int64_t k = 0; k < 4; ++k) top |= ((value(first + (4 * h + k) * CHUNK + t) >> 4) & 3) << (2 * k);
            block[(4 + h) * 32 + j * CHUNK + t] = static_cast<uint8_t>(top);
          }
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (p * groups + g) * ROWS + j;
      const float scale = s[n * groups + g];
      // The offset w takes past q x scale: int4 stores q - 8, so its offset absorbs the 8.
      const float offset = offsets ? (int4 ? z[n * groups + g] - 8.f * scale : z[n * groups + g]) : 0.f;
      if (!compact) {
        static_cast<float*>(to_scales)[at] = scale;
        if (offsets) static_cast<float*>(to_offsets)[at] = offset;
        continue;
      }
      const int64_t super = g * group_size / SUPER_BLOCK;
      const float d = given[(n * supers + super) * 2], dmin = given[(n * supers + super) * 2 + 1];
      const float sc = d != 0.f ? std::nearbyint(scale / d) : 0.f;
      const float m = dmin != 0.f ? std::nearbyint(-offset / dmin) : 0.f;
      // The offset was rounded once where it was computed (z = 8 scale - dmin m for int4): a few ulps.
      const float slack =
          8.f * std::numeric_limits<float>::epsilon() * std::max(std::abs(offset), 8.f * std::abs(scale));
      // GGUF stores d and dmin as float16: they pack as they are.
      const bool halves = static_cast<float>(c10::Half(d)) == d && static_cast<float>(c10::Half(dmin)) == dmin;
      if (sc < -128.f || sc > 127.f || sc * d != scale || m < 0.f || m > 255.f ||
          std::abs(m * dmin + offset) > slack || !halves) {
#pragma omp critical
        inexact = n;
      }
      static_cast<int8_t*>(to_scales)[at] = static_cast<int8_t>(sc);
      if (offsets) static_cast<uint8_t*>(to_offsets)[at] = static_cast<uint8_t>(m);
      if (g * group_size % SUPER_BLOCK == 0) {
        c10::Half* factor = to_supers + (p * supers + super) * factors * ROWS + j;
        factor[0] = d;
        if (offsets) factor[ROWS] = dmin;
      }
    }
  }
  TORCH_CHECK(inexact < 0, "super_scales do not give row ", inexact,
              "'s scales and offsets as integer multiples of float16 factors");
  // Scales and offsets that float16 holds exactly (GGUF's Q4_0, Q4_1 and Q8_0 store theirs so) pack in float16: a
  // weight then reads 4.625 bits (int4) or 8.5 (int8) instead of 5.25 or 9, the file's own sizes (18, 20 and 34 bytes
  // a block of 32), and a single stream's decode, which streams every weight once a token, reads that much less.
  if (!compact) {
    const at::Tensor half_scales = panel_scales.to(at::kHalf);
    bool exact = half_scales.to(at::kFloat).equal(panel_scales);
    std::optional<at::Tensor> half_offsets;
    if (offsets) {
      half_offsets = panel_offsets->to(at::kHalf);
      exact = exact && half_offsets->to(at::kFloat).equal(*panel_offsets);
    }
    if (exact) return {packed, half_scales, half_offsets, panel_supers};
  }
  return {packed, panel_scales, panel_offsets, panel_supers};
}

namespace {

// a8_linear and a8_grouped: the rows of each segment of x against its weight of `weights` packed by a8_pack, stacked
// ([weights, panels, ...] each) or, for one weight, as a8_pack gave them.
at::Tensor a8_segments(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& supers,
                       int64_t group_size, int64_t outputs, const std::optional<at::Tensor>& out_,
                       const std::vector<Segment>& segments, int64_t weights) {
  TORCH_CHECK(a8_linear_supported(), "a8_linear needs AVX2");
  const bool compact = supers.has_value(), stacked = packed.dim() == 3;
  const int64_t panels = (outputs + ROWS - 1) / ROWS, inputs = x.size(-1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in_features], dense rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(inputs % BLOCK == 0, "in_features must be a multiple of 32");
  // The form from the packed tensor: int8; uint8 of 4 (int4) or 6 bits (a8_pack's) a weight.
  const int64_t panel_bytes = packed.dim() == 2 + stacked ? packed.size(-1) : -1;
  TORCH_CHECK(packed.scalar_type() == at::kChar || packed.scalar_type() == at::kByte,
              "packed must be a8_pack's int8 or uint8 tensor");
  const Format format = packed.scalar_type() == at::kChar ? Format::INT8
                        : panel_bytes == inputs / BLOCK * block_bytes_of(Format::INT6) ? Format::INT6
                                                                                       : Format::INT4;
  check_layout(format == Format::INT4, inputs, group_size);
  TORCH_CHECK(packed.is_contiguous() && (!stacked || packed.size(0) == weights) && packed.size(stacked) == panels &&
                  panel_bytes == inputs / BLOCK * block_bytes_of(format),
              "packed must be a8_pack's tensor for [outputs, in_features]", stacked ? ", one a weight" : "");
  const int64_t groups = inputs / group_size;
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK(scales.is_contiguous() &&
                  (compact ? scale_type == at::kChar : scale_type == at::kFloat || scale_type == at::kHalf) &&
                  scales.numel() == weights * panels * groups * ROWS,
              "scales must be a8_pack's [panels, groups, 8] (float32 or float16, or int8 with super_scales)");
  TORCH_CHECK(format != Format::INT4 || offsets, "an int4 weight needs its offsets");
  TORCH_CHECK(!offsets || (offsets->is_contiguous() && offsets->scalar_type() == (compact ? at::kByte : scale_type) &&
                           offsets->numel() == weights * panels * groups * ROWS),
              "offsets must be None or a8_pack's [panels, groups, 8] (the scales' dtype, or uint8 with super_scales)");
  const int64_t factors = offsets ? 2 : 1;
  TORCH_CHECK(!compact || (inputs % SUPER_BLOCK == 0 && supers->is_contiguous() &&
                           supers->scalar_type() == at::kHalf &&
                           supers->numel() == weights * panels * inputs / SUPER_BLOCK * factors * ROWS),
              "supers must be a8_pack's [panels, in / 256, 2 (1 without offsets), 8] float16");
  at::Tensor out = out_ ? *out_ : at::empty({x.size(0), outputs}, x.options());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == outputs && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "out must be [tokens, out_features] in x's dtype, with dense rows");
#ifdef SPINDLE_A8
  const auto* q = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t panel_groups = groups * ROWS, panel_supers = inputs / SUPER_BLOCK * factors * ROWS;
  const int64_t weight_bytes = panels * panel_bytes;
  auto go = [&](auto* type, auto format_tag, auto sixteen_flag) {
    using T = std::remove_pointer_t<decltype(type)>;
    constexpr Format F = decltype(format_tag)::value;
    constexpr bool SIXTEEN = decltype(sixteen_flag)::value;
    const Activations a = quantize_activations(x.data_ptr<T>(), x.stride(0), x.size(0), inputs, group_size,
                                               offsets.has_value(), WEIGHT_BIAS<F> != 0);
    T* o = out.data_ptr<T>();
    if (compact) {
      const auto* sub_scales = scales.data_ptr<int8_t>();
      const uint8_t* sub_mins = offsets ? offsets->data_ptr<uint8_t>() : nullptr;
      const c10::Half* super_factors = supers->data_ptr<c10::Half>();
      auto panel_scales = [&](int64_t w, int64_t p) {
        const int64_t at = w * panels + p;  // the stack's panels follow each other
        return CompactScales{sub_scales + at * panel_groups, sub_mins ? sub_mins + at * panel_groups : nullptr,
                             super_factors + at * panel_supers, factors};
      };
      run<T, F, SIXTEEN>(a, segments, inputs, q, weight_bytes, panel_scales, group_size, outputs, o, out.stride(0));
    } else {
      auto with_group_scales = [&](const auto* group_scales, const auto* group_offsets) {
        auto panel_scales = [&](int64_t w, int64_t p) {
          const int64_t at = (w * panels + p) * panel_groups;
          return GroupScales<std::remove_const_t<std::remove_pointer_t<decltype(group_scales)>>>{
              group_scales + at, group_offsets ? group_offsets + at : nullptr};
        };
        run<T, F, SIXTEEN>(a, segments, inputs, q, weight_bytes, panel_scales, group_size, outputs, o,
                           out.stride(0));
      };
      if (scale_type == at::kHalf) {
        with_group_scales(scales.data_ptr<c10::Half>(), offsets ? offsets->data_ptr<c10::Half>() : nullptr);
      } else {
        with_group_scales(scales.data_ptr<float>(), offsets ? offsets->data_ptr<float>() : nullptr);
      }
    }
  };
  using Int4 = std::integral_constant<Format, Format::INT4>;
  using Int6 = std::integral_constant<Format, Format::INT6>;
  using Int8 = std::integral_constant<Format, Format::INT8>;
  with_dtype(x, [&](auto* type) {
    const bool sixteen = group_size == 16;
    if (format == Format::INT4) {
      go(type, Int4{}, std::false_type{});
    } else if (format == Format::INT6) {
      sixteen ? go(type, Int6{}, std::true_type{}) : go(type, Int6{}, std::false_type{});
    } else {
      sixteen ? go(type, Int8{}, std::true_type{}) : go(type, Int8{}, std::false_type{});
    }
  });
#endif
  return out;
}

}  // namespace

at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& supers,
                     int64_t group_size, int64_t outputs, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(packed.dim() == 2, "packed must be a8_pack's [panels, bytes] tensor");
  return a8_segments(x, packed, scales, offsets, supers, group_size, outputs, out, {{0, 0, x.size(0)}}, 1);
}

at::Tensor a8_grouped(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& supers,
                      int64_t group_size, int64_t outputs, const std::vector<int64_t>& starts) {
  const int64_t weights = static_cast<int64_t>(starts.size()) - 1;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == weights, "packed must be a stack of ", weights,
              " a8_pack tensors, one a group of rows");
  TORCH_CHECK(starts.front() == 0 && starts.back() == x.size(0) && std::is_sorted(starts.begin(), starts.end()),
              "starts must rise from 0 to the rows of x");
  std::vector<Segment> segments;
  for (int64_t w = 0; w < weights; ++w) {
    if (starts[w + 1] > starts[w]) segments.push_back({w, starts[w], starts[w + 1]});
  }
  return a8_segments(x, packed, scales, offsets, supers, group_size, outputs, std::nullopt, segments, weights);
}
