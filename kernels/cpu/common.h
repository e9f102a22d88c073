// What the CPU kernels share: the model dtypes they are built for, 8-lane vector types, loads of those dtypes as
// float (and 16-lane ones with AVX-512), the merge of partial softmax states, the split of a projection's tiles over
// the threads, the dispatch of a small token count or tile width to a compile-time constant, and the check of a
// quantized weight in spindle.kernels.quant's layout.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// AVX-512 with its bf16 instructions (Zen 4, Sapphire Rapids): the attention kernels have bf16 walks of their own.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SPINDLE_AVX512_BF16 1
#endif

// The model dtypes (float32, bfloat16, float16): the kernels are instantiated for these alone, with scalar_t the
// element type, as AT_DISPATCH_FLOATING_TYPES_AND2 would (which adds double, which no model runs in).
#define DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                            \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)              \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Eight floats or 32-bit integers, in whatever vector registers the machine has (gcc's vector extension: AVX2 here,
// NEON on Arm), for loops gcc does not vectorize well on its own.
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Eight floats stored at p (an AVX2 __m256 converts to f8 as it is).
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Eight values of a model dtype at p as floats (an f8 converts to an AVX2 __m256 as it is).
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

// NaN tests on the bits: the kernels build with -ffast-math, under which the compiler may assume no float is a NaN.
// A float is a NaN when its bits without the sign exceed infinity's.
constexpr uint32_t INFINITY_BITS = 0x7F800000u, NO_SIGN = 0x7FFFFFFFu;

inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & NO_SIGN) > INFINITY_BITS;
}

// float to the dtype, rounding to nearest even as c10's conversion does (NaN to its quiet NaN), but in integer ops
// that gcc vectorizes: c10's own conversion tests isnan in a branch, which kept every loop storing bf16 scalar
// (SwiGLU over a [64, 3072] bf16 batch: 157 us, 53 with this; 27 in float32).
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & NO_SIGN) > INFINITY_BITS;  // an integer test, as is_nan's
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Eight floats stored as bf16, rounded as from_float rounds each value (NaN included), in vector ops: a from_float
// loop per 8 outputs was a call of its own in a8_linear (bench/results/a8_linear.md, stop 64).
#ifdef __AVX2__
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(NO_SIGN))),
                                         _mm256_set1_epi32(static_cast<int>(INFINITY_BITS)));
  const __m256i halves = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// Sixteen values of a model dtype as float in an AVX-512 register, and back.
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Rounded to nearest even, as c10::BFloat16's conversion (and so torch) rounds.
inline void store16(c10::BFloat16* p, __m512 v) {
#ifdef __AVX512BF16__
  const __m256i out = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m256i out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
}
// v rounded to bf16 and back, as from_float<c10::BFloat16> then to_float round one value.
inline __m512 round_bf16(__m512 v) {
#ifdef __AVX512BF16__
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}
#endif

// Calls fn with a null pointer of x's element type (float or bfloat16), to pick the template instance.
template <typename F>
void with_dtype(const at::Tensor& x, F&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    fn(static_cast<c10::BFloat16*>(nullptr));
  }
}

// Calls fn(std::integral_constant<int, tokens>{}) for 1 to 7 tokens, and with 8 for any more: the token count as a
// compile-time constant, so that per-token accumulators live in registers.
template <typename F>
void with_tokens(int64_t tokens, F&& fn) {
  switch (tokens) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// Calls fn(std::integral_constant<int, vectors>{}) for 1, 2 or 3 vectors of 16 output columns (3 for any more): a
// projection tile's width as a compile-time constant, so that its accumulators live in registers.
template <typename F>
void with_vectors(int64_t vectors, F&& fn) {
  switch (vectors) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    default: fn(std::integral_constant<int, 3>{}); break;
  }
}

// Within an OpenMP parallel region, the projection tiles this thread computes: an even share of the output's tiles
// of `tile` columns (the last one narrower), run against rows [0, rows) in panels of `panel` rows, each panel
// against all of the share before the next. Calls fn(first_row, panel_rows, column, width, has_next) per tile,
// has_next false for the share's last tile (a kernel may fetch the next one, which follows in memory, meanwhile).
template <typename F>
void for_thread_tiles(int64_t rows, int64_t outputs, int64_t tile, int64_t panel, F&& fn) {
  const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
  const int64_t tiles = (outputs + tile - 1) / tile;
  const int64_t first = tiles * thread / threads, last = tiles * (thread + 1) / threads;
  for (int64_t r0 = 0; r0 < rows; r0 += panel)
    for (int64_t t = first; t < last; ++t) {
      const int64_t column = t * tile;
      fn(r0, std::min(panel, rows - r0), column, std::min(tile, outputs - column), t + 1 < last);
    }
}

// Merges the partial softmax states of one output row, computed over disjoint key ranges (flash-decoding): part p has
// its running max at max[p * stride], its sum of exponentials at sum[p * stride] and its unnormalised output at
// acc[p * acc_stride], head_size floats. A part that saw no key has a max far below the others and weighs nothing.
// Writes the normalised row to dst; `merged` is head_size floats of scratch.
template <typename T>
void merge_partials(int64_t num_parts, const float* max, const float* sum, int64_t stride, const float* acc,
                    int64_t acc_stride, int64_t head_size, float* merged, T* dst) {
  float global_max = max[0];
  for (int64_t p = 1; p < num_parts; ++p) global_max = std::max(global_max, max[p * stride]);
  std::fill_n(merged, head_size, 0.f);
  float total = 0.f;
  for (int64_t p = 0; p < num_parts; ++p) {
    const float weight = std::exp(max[p * stride] - global_max);
    total += weight * sum[p * stride];
    for (int64_t d = 0; d < head_size; ++d) merged[d] += weight * acc[p * acc_stride + d];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<T>(merged[d] * inv);
}

// Checks an int8 or int4 weight in spindle.kernels.quant's layout (dense int8 [out, in] or uint8 [out, in / 2], float32
// scales and offsets [out, in / group_size], offsets required for int4); returns (int4, inputs, groups).
// check_groups(int4, inputs) runs a kernel's own rule for the group size before the general one, so that its
// message says what that kernel takes.
template <typename GroupRule>
std::tuple<bool, int64_t, int64_t> check_quantized_weight(const at::Tensor& qweight, const at::Tensor& scales,
                                                          const std::optional<at::Tensor>& zeros, int64_t group_size,
                                                          GroupRule&& check_groups) {
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qweight.scalar_type() == at::kChar, "qweight must be int8, or uint8 holding int4");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be dense [out, in] (int4: [out, in / 2])");
  const int64_t outputs = qweight.size(0), inputs = int4 ? 2 * qweight.size(1) : qweight.size(1);
  check_groups(int4, inputs);
  TORCH_CHECK(group_size > 0 && inputs % group_size == 0, "group_size must divide in_features");
  const int64_t groups = inputs / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == outputs * groups,
              "scales must be dense float32 [out, in / group_size]");
  TORCH_CHECK(!int4 || zeros, "an int4 weight needs its offsets");
  TORCH_CHECK(!zeros || (zeros->is_contiguous() && zeros->scalar_type() == at::kFloat &&
                         zeros->numel() == outputs * groups),
              "zeros must be None or dense float32 [out, in / group_size]");
  return {int4, inputs, groups};
}
