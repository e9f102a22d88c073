// int8 projections with int8 activations (W8A8) on CPUs with AVX-512 VNNI: x @ W.T + b, W int8 with one scale per
// output row, each call's rows quantized to int8 on the fly with one scale per GROUP inputs.
//
// vpdpbusd multiplies 64 unsigned by 64 signed bytes into 16 int32 sums at the rate vdpbf16ps does 32 bf16 pairs:
// twice bf16's multiply-adds. It takes unsigned activations, so a row is stored as q + 128 (q in -127..127); the
// extra 128 * sum(w) over each group is subtracted by starting that group's int32 sums at -128 * sum(w), laid out once
// with the weight (int8_pack). After each group the int32 sums are scaled by the group's activation scale into float
// accumulators, and at the end by the row's weight scale.
//
// The scale per group of 64 inputs is what keeps quality: SmolLM2-135M's perplexity (bench.quality's text) with every
// projection's activations and weights quantized so: one scale per token +4.1%, per group of 192 +1.3%, of 64 +0.6%
// (the int8 weights alone +0.6%).
//
// The weight is laid out in tiles of 48 output columns (the last of 16 or 32), each [in / 4][columns][4]: for every
// four inputs, the tile's columns side by side, as vpdpbusd reads them. Each thread takes an even share of the tiles
// and runs up to 8 rows against one tile in one block; more rows in blocks of 4, whose 12 int32 sums and 12 float
// totals all stay in registers (1.05-1.15x blocks of 8 with the totals in memory, from 64 rows on), fetching the next
// tile meanwhile.
//
// Measured on 2 Zen 4 cores over SmolLM2's four projection shapes (qkv, o, gate_up, down), 30 layers' weights streamed
// as in a step, against our bf16 kernel (bf16_linear.cpp): 512 rows 1.69-1.89x (644-724 against 382-414 GFLOP/s),
// 64 rows 1.57-1.77x, 16 rows 1.35-1.56x, 1-8 rows 1.28-1.81x (half the bytes to read). Blocks of 8 rows with the
// float totals in memory ran at 1.5-1.65x from 64 rows on; before that, float totals in registers beside 4 rows of
// sums ran at 1.2-1.3x: gcc folded each weight load into every row's vpdpbusd, and the loads were the limit.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "common.h"

namespace {

#if defined(SPINDLE_AVX512_BF16) && defined(__AVX512VNNI__)
#define SPINDLE_W8A8 1
#endif

constexpr int64_t GROUP = 64;  // inputs per activation scale: spindle.kernels.quant.ACTIVATION_GROUP_SIZE
constexpr int64_t VECTORS = 3;  // int32 vectors of accumulators per row: a tile's columns / 16
constexpr int64_t TILE = 16 * VECTORS;  // output columns per tile (the last tile may have 16 or 32)
static_assert(VECTORS == 3, "with_vectors (common.h) dispatches tiles of 1 to 3 vectors");

#ifdef SPINDLE_W8A8
constexpr int64_t ROWS = 4;          // rows per block past 8 rows: 12 int32 sums and 12 float totals in registers
constexpr int64_t ROW_PANEL = 256;   // rows run against all of a thread's tiles before the next rows

// One row's GROUP-input groups as q + 128 bytes, and each group's scale (its largest magnitude / 127).
template <typename T>
void quantize_row(const T* x, int64_t inputs, uint8_t* q, float* scales) {
  for (int64_t g = 0; g < inputs / GROUP; ++g) {
    __m512 v[GROUP / 16];
    __m512 largest = _mm512_setzero_ps();
    for (int i = 0; i < GROUP / 16; ++i) {
      v[i] = load16(x + g * GROUP + 16 * i);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(v[i]));
    }
    const float top = _mm512_reduce_max_ps(largest);
    scales[g] = top / 127.f;
    const __m512 inverse = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    for (int i = 0; i < GROUP / 16; ++i) {
      // Rounds to nearest even (the default MXCSR mode), as torch.round does.
      const __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse)), _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * GROUP + 16 * i), _mm512_cvtusepi32_epi8(r));
    }
  }
}

// Rows [0, M) of the quantized x against one tile of NV vectors: out[m][0, 16 NV) = x[m] . tile + bias.
template <int M, int NV, typename T>
inline void block(const uint8_t* xq, int64_t inputs, const float* x_scales, const int32_t* tile, const int32_t* sums,
                  const float* w_scales, const float* bias, T* out, int64_t out_stride, const int32_t* next_tile) {
  constexpr int W = 16 * NV;
  const int64_t groups = inputs / GROUP;
  __m512 total[M][NV];  // in registers up to 4 rows; past that gcc keeps them on the stack, touched once per group
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) total[m][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[M][NV];
    for (int v = 0; v < NV; ++v) {
      const __m512i start = _mm512_loadu_si512(sums + g * W + 16 * v);
      for (int m = 0; m < M; ++m) acc[m][v] = start;
    }
    const int32_t* quads = tile + g * (GROUP / 4) * W;
#pragma GCC unroll 16
    for (int p = 0; p < GROUP / 4; ++p) {
      __m512i w[NV];
      for (int v = 0; v < NV; ++v) {
        w[v] = _mm512_loadu_si512(quads + p * W + 16 * v);
        asm("" : "+v"(w[v]));  // keeps the weights in registers: gcc would fold the load into every row's vpdpbusd
        if (next_tile != nullptr)
          _mm_prefetch(reinterpret_cast<const char*>(next_tile + (g * (GROUP / 4) + p) * W + 16 * v), _MM_HINT_T1);
      }
      for (int m = 0; m < M; ++m) {
        int32_t four;
        std::memcpy(&four, xq + m * inputs + g * GROUP + 4 * p, sizeof(four));
        const __m512i xv = _mm512_set1_epi32(four);
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], xv, w[v]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 scale = _mm512_set1_ps(x_scales[m * groups + g]);
      for (int v = 0; v < NV; ++v)
        total[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][v]), scale, total[m][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 w_scale = _mm512_loadu_ps(w_scales + 16 * v);
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store16(out + m * out_stride + 16 * v, _mm512_fmadd_ps(total[m][v], w_scale, b));
  }
}

// Rows [0, rows) against one tile of NV vectors: up to 8 rows in one block (the tile read once), more in blocks of
// ROWS and a last of the rest. The first block fetches next_tile (the thread's next, or null) meanwhile.
template <int NV, typename T>
void tile_rows(const uint8_t* xq, int64_t inputs, const float* x_scales, int64_t rows, const int32_t* tile,
               const int32_t* next_tile, const int32_t* sums, const float* w_scales, const float* bias, T* out,
               int64_t out_stride) {
  const int64_t groups = inputs / GROUP, step = rows <= 8 ? 8 : ROWS;
  for (int64_t m = 0; m < rows; m += step)
    with_tokens(std::min(step, rows - m), [&](auto size) {
      block<decltype(size)::value, NV>(xq + m * inputs, inputs, x_scales + m * groups, tile, sums, w_scales, bias,
                                       out + m * out_stride, out_stride, m == 0 ? next_tile : nullptr);
    });
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sums, const at::Tensor& scales,
         const float* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), inputs = x.size(1), outputs = out.size(1), groups = inputs / GROUP;
  at::Tensor xq = at::empty({rows, inputs}, x.options().dtype(at::kByte));
  at::Tensor x_scales = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const T* xs = x.data_ptr<T>();
  const int64_t x_stride = x.stride(0);
  uint8_t* q = xq.data_ptr<uint8_t>();
  float* xsc = x_scales.data_ptr<float>();
  const int32_t* w = reinterpret_cast<const int32_t*>(tiles.data_ptr<int8_t>());
  const int32_t* s = sums.data_ptr<int32_t>();
  const float* ws = scales.data_ptr<float>();
  T* o = out.data_ptr<T>();
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    for (int64_t r = rows * thread / threads; r < rows * (thread + 1) / threads; ++r)
      quantize_row(xs + r * x_stride, inputs, q + r * inputs, xsc + r * groups);
#pragma omp barrier
    for_thread_tiles(rows, outputs, TILE, ROW_PANEL, [&](int64_t r0, int64_t panel, int64_t column, int64_t width,
                                                         bool has_next) {
      const int32_t* tile = w + column * inputs / 4;
      const int32_t* next = has_next ? tile + width * inputs / 4 : nullptr;
      const float* b = bias == nullptr ? nullptr : bias + column;
      with_vectors(width / 16, [&](auto vectors) {
        tile_rows<decltype(vectors)::value>(q + r0 * inputs, inputs, xsc + r0 * groups, panel, tile, next,
                                            s + column * groups, ws + column, b, o + r0 * outputs + column, outputs);
      });
    });
  }
}
#endif

}  // namespace

bool w8a8_supported() {
#ifdef SPINDLE_W8A8
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "qweight must be [out, in] int8");
  const int64_t outputs = qweight.size(0), inputs = qweight.size(1), groups = inputs / GROUP;
  TORCH_CHECK(outputs % 16 == 0 && inputs % GROUP == 0, "int8_pack needs out % 16 == 0 and in % ", GROUP,
              " == 0, got [", outputs, ", ", inputs, "]");
  const at::Tensor src_tensor = qweight.contiguous();
  const int8_t* src = src_tensor.data_ptr<int8_t>();
  at::Tensor tiles = at::empty({outputs * inputs}, qweight.options());
  at::Tensor sums = at::empty({outputs * groups}, qweight.options().dtype(at::kInt));
  int8_t* dst = tiles.data_ptr<int8_t>();
  int32_t* sum = sums.data_ptr<int32_t>();
  // Tile t starts at column 48 t: its weights at byte 48 t * in, its group sums at 48 t * groups, [groups][columns].
  for (int64_t first = 0; first < outputs; first += TILE) {
    const int64_t width = std::min<int64_t>(TILE, outputs - first);
    int8_t* tile = dst + first * inputs;
    int32_t* tile_sums = sum + first * groups;
    for (int64_t c = 0; c < width; ++c) {
      const int8_t* row = src + (first + c) * inputs;
      for (int64_t k = 0; k < inputs; ++k) tile[((k / 4) * width + c) * 4 + k % 4] = row[k];
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) total += row[k];
        tile_sums[g * width + c] = -128 * total;
      }
    }
  }
  return {tiles, sums};
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sums, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w8a8_supported(), "w8a8_linear needs a CPU with AVX-512 VNNI and bf16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [tokens, in] float32 or bf16, rows dense");
  const int64_t inputs = x.size(1), outputs = scales.numel();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales must be float32, one per row");
  TORCH_CHECK(tiles.scalar_type() == at::kChar && tiles.numel() == outputs * inputs && inputs % GROUP == 0 &&
                  sums.numel() == outputs * (inputs / GROUP) && outputs % 16 == 0,
              "tiles and sums are not an int8_pack of a [", outputs, ", ", inputs, "] weight");
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
#ifdef SPINDLE_W8A8
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == outputs, "bias must have ", outputs, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run<float>(x, tiles, sums, scales, bp, out);
  else
    run<c10::BFloat16>(x, tiles, sums, scales, bp, out);
#endif
  return out;
}
