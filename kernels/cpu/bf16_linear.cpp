// Dense bf16 projections (x @ W.T + b) on CPUs with AVX-512 bf16, in place of oneDNN's packed matmul.
//
// The weight is laid out once (bf16_pack) in tiles of TILE output columns, each tile [in / 2][TILE][2]: for every pair
// of inputs, the tile's columns side by side, the pair's two weights adjacent, as vdpbf16ps takes them. The kernel
// splits the tiles evenly over the OpenMP threads; each thread runs blocks of up to 8 rows of x against one tile at a
// time, 8 x 3 float accumulators in registers, each step one 32-bit broadcast of a row's input pair and three
// vdpbf16ps, and fetches the next tile while it computes the current one's first rows.
//
// Measured on 2 Zen 4 cores, SmolLM2's projections, weights read from memory as in a model's step (each call a
// different layer's weight), us a call, oneDNN's packed matmul (torch.ops.mkldnn._linear_pointwise) / this kernel:
// 64 rows qkv 274 / 223, o_proj 173 / 125, gate_up 714 / 666, down 462 / 339; 32 rows 228 / 126, 138 / 77, 454 / 372,
// 265 / 198; 16 rows 137 / 71, 80 / 39, 305 / 208, 140 / 117; 512 rows 1,677 / 1,637, 990 / 891, 5,632 / 5,221,
// 2,697 / 2,413. oneDNN splits the 576 output columns of o_proj and down_proj into 9 blocks of 64 over two threads
// (one thread does 5), and costs ~60 us a call of its own at one row.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "common.h"

namespace {

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

}  // namespace

bool bf16_linear_supported() {
#ifdef SPINDLE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be [out, in] bf16");
  const int64_t outputs = weight.size(0), inputs = weight.size(1);
  TORCH_CHECK(outputs % 16 == 0 && inputs % 2 == 0, "bf16_pack needs out % 16 == 0 and in % 2 == 0, got [", outputs,
              ", ", inputs, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({outputs * inputs}, weight.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<c10::BFloat16>());  // [out][in / 2] pairs
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<c10::BFloat16>());
  const int64_t pairs = inputs / 2;
  // Tiles of 48 columns, the last one of 16 or 32: tile t starts at column 48 t, at pair offset 48 t * pairs.
  for (int64_t first = 0; first < outputs; first += 48) {
    const int64_t width = std::min<int64_t>(48, outputs - first);
    uint32_t* tile = dst + first * pairs;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t c = 0; c < width; ++c) tile[p * width + c] = src[(first + c) * pairs + p];
  }
  return packed;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t outputs,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_supported(), "bf16_linear needs a CPU with AVX-512 bf16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [tokens, in] bf16, rows dense");
  const int64_t rows = x.size(0), inputs = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.numel() == outputs * inputs && outputs % 16 == 0,
              "packed is not a bf16_pack of a [", outputs, ", ", inputs, "] weight");
  at::Tensor out = at::empty({rows, outputs}, x.options());
#ifdef SPINDLE_AVX512_BF16
  std::vector<float> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == outputs, "bias must have ", outputs, " values");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + outputs);
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t pairs = inputs / 2, x_stride = x.stride(0);
#pragma omp parallel
  for_thread_tiles(rows, outputs, TILE, ROW_PANEL, [&](int64_t r0, int64_t panel, int64_t column, int64_t width,
                                                       bool has_next) {
    const uint32_t* tile = w + column * pairs;
    const uint32_t* next = has_next ? tile + width * pairs : nullptr;
    const float* b = bias_f.empty() ? nullptr : bias_f.data() + column;
    with_vectors(width / 16, [&](auto vectors) {
      tile_rows<decltype(vectors)::value>(xs + r0 * x_stride, x_stride, panel, tile, next, pairs, b,
                                          o + r0 * outputs + column, outputs);
    });
  });
#endif
  return out;
}
