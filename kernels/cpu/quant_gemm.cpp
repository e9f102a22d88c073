// Weight-only int8 and int4 projections for many tokens at a time (prefills, large decode batches), from the quantized
// weight alone: no dense copy of the matrix is kept anywhere.
//
// The output columns are cut into panels of PANEL columns, spread over the OpenMP threads. For each panel a thread
// dequantizes the panel's weights (all inputs) into a thread-local float32 scratch, each column's inputs adjacent
// (PANEL x in floats: 72 KB for 576 inputs, 192 KB for 1536, within a Zen 3 core's 512 KB L2), then runs every block
// of ROWS rows of x against it, COLUMNS columns at a time: ROWS x COLUMNS vector accumulators of 8 floats summed over
// the inputs in registers, and reduced once at the end. Dequantization costs once per weight per call, which blocks of
// many rows repay; few-token calls run quant_linear.cpp's kernels instead (spindle.kernels.linear picks by the
// measured crossover). The multiplication is written with gcc's vector extensions (common.h's f8), which are AVX2 + FMA
// on x86 (AVX-512 CPUs run it as 8-lane vectors too) and NEON on Arm; the dequantization has an AVX2 loop and a
// generic one. bench/results/quant_linear.md has the numbers.
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t PANEL = 32;   // output columns dequantized per work item
constexpr int ROWS = 4;         // rows of x per block
constexpr int COLUMNS = 3;      // columns per block: ROWS x COLUMNS accumulators + COLUMNS weights + 1 input, of 16

typedef float f8u __attribute__((vector_size(32), aligned(4)));  // f8 at any float address

// One column of the weight, n, as float: dst[k] = q[k] * scale[g] + offset[g] (g = k / group_size), where the offset
// is the group's zero (int8 with offsets), 0 (int8 without), or zero - 8 scale (int4, whose q is stored 0..15).
// group_size is a multiple of 8 (16 for int4), so each step of 8 (16) inputs has one scale.
void dequantize_int8(const int8_t* q, const float* scales, const float* zeros, int64_t group_size, int64_t inputs,
                     float* dst) {
  for (int64_t k = 0; k < inputs; k += 8) {
    const int64_t g = k / group_size;
    const float offset = zeros ? zeros[g] : 0.f;
#ifdef __AVX2__
    // gcc turns the generic widening below into byte extracts.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(w, _mm256_set1_ps(scales[g]), _mm256_set1_ps(offset)));
#else
    for (int64_t i = 0; i < 8; ++i) dst[k + i] = static_cast<float>(q[k + i]) * scales[g] + offset;
#endif
  }
}

void dequantize_int4(const uint8_t* q, const float* scales, const float* zeros, int64_t group_size, int64_t inputs,
                     float* dst) {
  for (int64_t k = 0; k < inputs; k += 16) {
    const int64_t g = k / group_size;
    const float scale = scales[g], offset = zeros[g] - 8.f * scales[g];
#ifdef __AVX2__
    // The 8 bytes' low nibbles are inputs k, k + 2, ..., the high ones k + 1, k + 3, ...: interleaved into order.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m128i values = _mm_unpacklo_epi8(low, high);
    const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
    _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(values)), s, o));
    _mm256_storeu_ps(dst + k + 8,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(values, 8))), s, o));
#else
    for (int64_t i = 0; i < 8; ++i) {
      dst[k + 2 * i] = static_cast<float>(q[k / 2 + i] & 15) * scale + offset;
      dst[k + 2 * i + 1] = static_cast<float>(q[k / 2 + i] >> 4) * scale + offset;
    }
#endif
  }
}

// Rows [0, M) of x against columns [0, C) of the panel: out[m][c] = x[m] . w[c] + bias[c].
template <typename T, int M, int C>
inline void block(const float* x, int64_t inputs, const float* w, const float* bias, T* out, int64_t outputs) {
  f8 acc[M][C] = {};
  for (int64_t k = 0; k < inputs; k += 8) {
    f8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = *reinterpret_cast<const f8u*>(w + c * inputs + k);
    for (int m = 0; m < M; ++m) {
      const f8 xv = *reinterpret_cast<const f8u*>(x + m * inputs + k);
      for (int c = 0; c < C; ++c) acc[m][c] += xv * wv[c];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) {
      float total = bias ? bias[c] : 0.f;
      for (int i = 0; i < 8; ++i) total += acc[m][c][i];
      out[m * outputs + c] = from_float<T>(total);
    }
}

template <typename T, int M>
void rows_block(const float* x, int64_t inputs, const float* panel, int64_t width, const float* bias, T* out,
                int64_t outputs) {
  static_assert(COLUMNS == 3, "with_vectors (common.h) dispatches blocks of 1 to 3 columns");
  for (int64_t c = 0; c < width; c += COLUMNS) {
    with_vectors(std::min<int64_t>(COLUMNS, width - c), [&](auto columns) {
      block<T, M, decltype(columns)::value>(x, inputs, panel + c * inputs, bias ? bias + c : nullptr, out + c, outputs);
    });
  }
}

template <typename T>
void run(const float* x, int64_t rows, int64_t inputs, const at::Tensor& qweight, const float* scales,
         const float* zeros, int64_t group_size, const float* bias, int64_t outputs, T* out) {
  const int64_t groups = inputs / group_size, panels = (outputs + PANEL - 1) / PANEL;
  const bool int4 = qweight.scalar_type() == at::kByte;
#pragma omp parallel
  {
    std::vector<float> panel(PANEL * inputs);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t first = p * PANEL, width = std::min(PANEL, outputs - first);
      for (int64_t n = first; n < first + width; ++n) {
        const float* z = zeros ? zeros + n * groups : nullptr;
        float* dst = panel.data() + (n - first) * inputs;
        if (int4) {
          dequantize_int4(qweight.data_ptr<uint8_t>() + n * inputs / 2, scales + n * groups, z, group_size, inputs, dst);
        } else {
          dequantize_int8(qweight.data_ptr<int8_t>() + n * inputs, scales + n * groups, z, group_size, inputs, dst);
        }
      }
      const float* b = bias ? bias + first : nullptr;
      int64_t m = 0;
      for (; m + ROWS <= rows; m += ROWS)
        rows_block<T, ROWS>(x + m * inputs, inputs, panel.data(), width, b, out + m * outputs + first, outputs);
      static_assert(ROWS == 4, "the rows left over are 1 to 3");
      const float* xm = x + m * inputs;
      T* om = out + m * outputs + first;
      if (rows - m == 3) rows_block<T, 3>(xm, inputs, panel.data(), width, b, om, outputs);
      if (rows - m == 2) rows_block<T, 2>(xm, inputs, panel.data(), width, b, om, outputs);
      if (rows - m == 1) rows_block<T, 1>(xm, inputs, panel.data(), width, b, om, outputs);
    }
  }
}

}  // namespace

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  (qweight.scalar_type() == at::kChar || qweight.scalar_type() == at::kByte),
              "qweight must be dense int8 [out, in] or uint8 [out, in / 2] (int4)");
  const bool int4 = qweight.scalar_type() == at::kByte;
  const int64_t outputs = qweight.size(0), inputs = qweight.size(1) * (int4 ? 2 : 1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == inputs, "x must be [tokens, ", inputs,
              "], dense rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  TORCH_CHECK(group_size > 0 && group_size % (int4 ? 16 : 8) == 0 && inputs % group_size == 0,
              "group_size must be a multiple of ", int4 ? 16 : 8, " that divides in_features");
  const int64_t groups = inputs / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == outputs * groups,
              "scales must be dense float32 [out, in / group_size]");
  TORCH_CHECK(!int4 || zeros.has_value(), "int4 weights need their zeros");
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kFloat && zeros->numel() == outputs * groups,
                "zeros must be dense float32 [out, in / group_size]");
  }
  std::vector<float> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == outputs, "bias must have ", outputs, " values");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + outputs);
  }
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, outputs}, x.options());
  const float* z = zeros.has_value() ? zeros->data_ptr<float>() : nullptr;
  const float* b = bias_f.empty() ? nullptr : bias_f.data();
  DISPATCH_MODEL_TYPES(x.scalar_type(), "quant_gemm", [&] {
    using T = scalar_t;
    const T* src = x.data_ptr<T>();
    std::vector<float> converted;  // float32 rows of x: x itself where it is float32 and contiguous
    const float* xf = reinterpret_cast<const float*>(src);
    if (!std::is_same_v<T, float> || x.stride(0) != inputs) {
      converted.resize(rows * inputs);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < inputs; ++k) converted[m * inputs + k] = to_float(src[m * x.stride(0) + k]);
      xf = converted.data();
    }
    run<T>(xf, rows, inputs, qweight, scales.data_ptr<float>(), z, group_size, b, outputs, out.data_ptr<T>());
  });
  return out;
}
