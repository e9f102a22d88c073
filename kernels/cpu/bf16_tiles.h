// bf16_linear's tile kernel (the layout and the micro-kernel that bf16_linear.cpp describes), shared with the fused
// MoE op (moe.cpp), which runs it over each expert's rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

#ifdef SPINDLE_AVX512_BF16
constexpr int64_t VECTORS = 3;          // float vectors of accumulators per row: a tile's columns / 16
constexpr int64_t TILE = 16 * VECTORS;  // output columns per tile (the last tile may have 16 or 32)
static_assert(VECTORS == 3, "with_vectors (common.h) dispatches tiles of 1 to 3 vectors");
constexpr int64_t ROWS = 8;             // rows of x per block: ROWS x VECTORS accumulators, of 32 registers
constexpr int64_t ROW_PANEL = 256;      // rows run against all of a thread's tiles before the next rows

// Rows [0, M) of x (M <= ROWS) against one tile of NV vectors: out[m][0, 16 NV) = x[m] . tile + bias.
template <int M, int NV>
inline void block(const uint16_t* x, int64_t x_stride, const uint32_t* tile, const uint32_t* next_tile, int64_t pairs,
                  const float* bias, c10::BFloat16* out, int64_t out_stride) {
  __m512 acc[M][NV];
  for (int v = 0; v < NV; ++v) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) acc[m][v] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(tile + (p * NV + v) * 16);
    if (next_tile != nullptr)
      for (int v = 0; v < NV; ++v) _mm_prefetch(reinterpret_cast<const char*>(next_tile + (p * NV + v) * 16), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + 16 * v), (__m256i)_mm512_cvtneps_pbh(acc[m][v]));
}

// Rows [0, rows) against one tile of NV vectors, in blocks of ROWS (with_tokens' largest count) and a last of the rest.
template <int NV>
void tile_rows(const uint16_t* x, int64_t x_stride, int64_t rows, const uint32_t* tile, const uint32_t* next_tile,
               int64_t pairs, const float* bias, c10::BFloat16* out, int64_t out_stride) {
  static_assert(ROWS == 8);
  for (int64_t m = 0; m < rows; m += ROWS)
    with_tokens(std::min(ROWS, rows - m), [&](auto size) {
      block<decltype(size)::value, NV>(x + m * x_stride, x_stride, tile, m == 0 ? next_tile : nullptr, pairs, bias,
                                       out + m * out_stride, out_stride);
    });
}
#endif

