// Weight-only int8 projections for a few tokens at a time (decode steps, speculative drafts): the weights stream from
// memory once per call and are turned into float in registers, 16 at a time, for every token.
//
// A decode step of a small model is bound by reading its weights. torch's CPU int8 kernel
// (aten::_weight_int8pack_mm) reads them at ~7.5 GB/s on two EPYC cores; this one at ~17 (SmolLM2's 30 layers of
// projections, one token: 14.2 against 6.1 ms). The layout is spindle.kernels.quant's, as stored: one int8 value a
// byte and a float32 scale per row or per group of inputs (GGUF's Q8_0 blocks of 32). (A kernel of the same build for int4 ran no faster than torch's int4 one, whose
// unpacking, not memory, bounds it on this CPU: the int4 path uses torch's.)
#include <ATen/ATen.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t LANES = 16;     // floats in one AVX-512 register: the width the inner loops are written for
constexpr int64_t MAX_TOKENS = 8;  // calls with more tokens run the dense weights (spindle.kernels.linear)

// One output row of the int8 kernel for M tokens: sum(q scale x) into totals[m]; scales holds the row's one scale per
// group_size inputs (a multiple of 32, so that each step of 32 inputs has one scale).
template <int M>
inline void int8_row(const float* x, int64_t inputs, const int8_t* q, const float* scales, int64_t group_size,
                     float* totals) {
#ifdef __AVX512F__
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < inputs; k += 2 * LANES) {
    const __m512 scale = _mm512_set1_ps(scales[k / group_size]);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + half * LANES));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
      for (int m = 0; m < M; ++m) {
        acc[m][half] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * inputs + k + half * LANES), acc[m][half]);
      }
    }
  }
  for (int m = 0; m < M; ++m) totals[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#else
  float acc[M][LANES] = {};
  for (int64_t k = 0; k < inputs; k += LANES) {
    const float scale = scales[k / group_size];
    for (int m = 0; m < M; ++m) {
      for (int64_t i = 0; i < LANES; ++i) acc[m][i] += static_cast<float>(q[k + i]) * scale * x[m * inputs + k + i];
    }
  }
  for (int m = 0; m < M; ++m) {
    totals[m] = 0.f;
    for (int64_t i = 0; i < LANES; ++i) totals[m] += acc[m][i];
  }
#endif
}

template <typename T, int M>
void int8_rows(const std::vector<float>& x, int64_t inputs, const int8_t* qweight, const float* scales,
               int64_t group_size, int64_t outputs, T* out) {
  const int64_t groups = inputs / group_size;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < outputs; ++n) {
    float totals[M];
    int8_row<M>(x.data(), inputs, qweight + n * inputs, scales + n * groups, group_size, totals);
    for (int m = 0; m < M; ++m) out[m * outputs + n] = static_cast<T>(totals[m]);
  }
}

// Calls fn with a null pointer of x's element type (float or bfloat16), to pick the template instance.
template <typename F>
void with_dtype(const at::Tensor& x, F&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    fn(static_cast<c10::BFloat16*>(nullptr));
  }
}

void check_input(const at::Tensor& x, int64_t inputs) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == inputs, "x must be [tokens, in_features], dense rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_TOKENS, "the quantized CPU kernels take 1 to 8 tokens");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t group_size) {
  const int64_t outputs = qweight.size(0), inputs = qweight.size(1);
  check_input(x, inputs);
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kChar, "qweight must be dense int8");
  TORCH_CHECK(group_size % (2 * LANES) == 0 && inputs % group_size == 0,
              "group_size must be a multiple of 32 that divides in_features");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == outputs * (inputs / group_size),
              "scales must be dense float32 [out, in / group_size]");
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  std::vector<float> rows(x.size(0) * inputs);
  with_dtype(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    for (int64_t m = 0; m < x.size(0); ++m)
      for (int64_t k = 0; k < inputs; ++k) rows[m * inputs + k] = to_float(x.data_ptr<T>()[m * x.stride(0) + k]);
    with_tokens(x.size(0), [&](auto tokens) {
      int8_rows<T, decltype(tokens)::value>(rows, inputs, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                            group_size, outputs, out.data_ptr<T>());
    });
  });
  return out;
}
