// The weight-only int8 and int4 micro-kernels of quant_linear.cpp, shared with moe.cpp's quantized experts: one output
// row (one weight row) against M input rows, the weights turned into float in registers. The layout is
// spindle.kernels.quant's: int8 one value a byte with a float32 scale per row or per group of inputs; int4 two values
// a byte, input 2i in the low nibble, with a scale and an offset per group.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "common.h"

namespace quant_rows {

constexpr int64_t LANES = 16;     // floats in one AVX-512 register: the width the inner loops are written for

#ifdef __AVX2__
inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif

// One output row of the int8 kernel for M tokens. Per group g of the row, w = q s_g (+ z_g where the weight has
// offsets, GGUF's Q5_K and Q5_1), so the row's dot product with a token is sum_g (s_g sum_k q_k x_k + z_g xsum_g): the
// group sums of x (xsums, per token) are computed once per call. group_size is a multiple of 16 (GGUF's Q6_K groups
// are 16 inputs), so that each step of 16 inputs has one scale.
template <int M>
inline void int8_row(const float* x, const float* xsums, int64_t inputs, const int8_t* q, const float* scales,
                     const float* zeros, int64_t group_size, float* totals) {
  const int64_t groups = inputs / group_size;
  float offsets[M] = {};
  if (zeros != nullptr) {
    for (int64_t g = 0; g < groups; ++g)
      for (int m = 0; m < M; ++m) offsets[m] += zeros[g] * xsums[m * groups + g];
  }
#ifdef __AVX512F__
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = _mm512_set1_ps(scales[g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += LANES) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * inputs + k), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) totals[m] = offsets[m] + _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__)
  // gcc leaves the generic loop below scalar (the int8 -> float widening): 46 ms for one token on a Zen 3, 12.5 here.
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 scale = _mm256_set1_ps(scales[g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
      const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * inputs + k), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) totals[m] = offsets[m] + hsum(acc[m]);
#else
  float acc[M][LANES] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = scales[g];
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += LANES) {
      for (int m = 0; m < M; ++m) {
        for (int64_t i = 0; i < LANES; ++i) acc[m][i] += static_cast<float>(q[k + i]) * scale * x[m * inputs + k + i];
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    totals[m] = offsets[m];
    for (int64_t i = 0; i < LANES; ++i) totals[m] += acc[m][i];
  }
#endif
}

// One output row of the int4 kernel for M tokens. Per group g of the row, w = (q - 8) s + z, so the row's dot product
// with a token is sum_g (s_g sum_k q_k x_k + (z_g - 8 s_g) xsum_g): the group sums of x (xsums, per token) are
// computed once per call, and the inner loop multiplies the scaled 4-bit values with x. x is permuted within each
// 32 inputs to the nibble order (the 16 low nibbles' inputs, then the 16 high ones'), so that the loop reads both
// with unit stride.
template <int M>
inline void int4_row(const float* x, const float* xsums, int64_t inputs, const uint8_t* q, const float* scales,
                     const float* zeros, int64_t group_size, float* totals) {
  const int64_t groups = inputs / group_size;
  float offsets[M] = {};
#ifdef __AVX2__
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 scale = _mm256_set1_ps(scales[g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 2 * LANES) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
      const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
      for (int part = 0; part < 4; ++part) {
        const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[part])), scale);
        for (int m = 0; m < M; ++m) {
          acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * inputs + k + 8 * part), acc[m]);
        }
      }
    }
    const float offset = zeros[g] - 8.f * scales[g];
    for (int m = 0; m < M; ++m) offsets[m] += offset * xsums[m * groups + g];
  }
  for (int m = 0; m < M; ++m) totals[m] = offsets[m] + hsum(acc[m]);
#else
  float acc[M][LANES] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = scales[g];
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 2 * LANES) {
      float low[LANES], high[LANES];
      for (int64_t i = 0; i < LANES; ++i) {
        low[i] = static_cast<float>(q[k / 2 + i] & 15) * scale;
        high[i] = static_cast<float>(q[k / 2 + i] >> 4) * scale;
      }
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * inputs + k;
        for (int64_t i = 0; i < LANES; ++i) acc[m][i] += low[i] * xm[i] + high[i] * xm[LANES + i];
      }
    }
    const float offset = zeros[g] - 8.f * scale;
    for (int m = 0; m < M; ++m) offsets[m] += offset * xsums[m * groups + g];
  }
  for (int m = 0; m < M; ++m) {
    totals[m] = offsets[m];
    for (int64_t i = 0; i < LANES; ++i) totals[m] += acc[m][i];
  }
#endif
}

// The sums of one input row x over each group of group_size inputs, in order: the `xsums` that int4_row and int8_row
// (for a weight with offsets) read.
template <typename T>
inline void group_sums(const T* x, int64_t inputs, int64_t group_size, float* xsums) {
  for (int64_t g = 0; g < inputs / group_size; ++g) {
    float sum = 0.f;
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += to_float(x[k]);
    xsums[g] = sum;
  }
}

// One input row as int4_row reads it: `row` x in float, permuted within each 32 inputs to the nibble order (the 16
// low nibbles' inputs, then the 16 high ones'), and `xsums` the sums of x over each group of group_size inputs.
template <typename T>
inline void int4_input_row(const T* x, int64_t inputs, int64_t group_size, float* row, float* xsums) {
  for (int64_t k = 0; k < inputs; k += 2 * LANES) {
    for (int64_t i = 0; i < LANES; ++i) {
      row[k + i] = to_float(x[k + 2 * i]);
      row[k + LANES + i] = to_float(x[k + 2 * i + 1]);
    }
  }
  group_sums(x, inputs, group_size, xsums);
}

}  // namespace quant_rows
