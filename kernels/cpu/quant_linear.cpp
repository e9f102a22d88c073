// Weight-only int8 and int4 projections for a few tokens at a time (decode steps, speculative drafts): the weights
// stream from memory once per call and are turned into float in registers for every token.
//
// A decode step of a small model is bound by reading its weights. torch's CPU int8 kernel
// (aten::_weight_int8pack_mm) reads them at ~7.5 GB/s on two EPYC cores; ours at ~17 (SmolLM2's 30 layers of
// projections, one token: 14.2 against 6.1 ms). The layout is spindle.kernels.quant's, as stored: one int8 value a
// byte and a float32 scale per row or per group of inputs (GGUF's Q8_0 blocks of 32, Q6_K's of 16), with an offset
// per group where the weight has them (Q5_K); int4 two values a byte with a scale and an offset per group. On AVX-512 the int4 path uses torch's kernel (an int4 kernel of ours ran no faster
// there); torch's has no fast AVX2 path, where ours is 11x faster (spindle.kernels.linear has the numbers).
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t LANES = 16;     // floats in one AVX-512 register: the width the inner loops are written for
constexpr int64_t MAX_TOKENS = 8;  // calls with more tokens run the dense weights (spindle.kernels.linear)

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

template <typename T, int M>
void int8_rows(const std::vector<float>& x, const std::vector<float>& xsums, int64_t inputs, const int8_t* qweight,
               const float* scales, const float* zeros, int64_t group_size, int64_t outputs, T* out) {
  const int64_t groups = inputs / group_size;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < outputs; ++n) {
    float totals[M];
    int8_row<M>(x.data(), xsums.data(), inputs, qweight + n * inputs, scales + n * groups,
                zeros == nullptr ? nullptr : zeros + n * groups, group_size, totals);
    for (int m = 0; m < M; ++m) out[m * outputs + n] = static_cast<T>(totals[m]);
  }
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

template <typename T, int M>
void int4_rows(const std::vector<float>& x, const std::vector<float>& xsums, int64_t inputs, const uint8_t* qweight,
               const float* scales, const float* zeros, int64_t group_size, int64_t outputs, T* out) {
  const int64_t groups = inputs / group_size;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < outputs; ++n) {
    float totals[M];
    int4_row<M>(x.data(), xsums.data(), inputs, qweight + n * inputs / 2, scales + n * groups, zeros + n * groups,
                group_size, totals);
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
                       const std::optional<at::Tensor>& zeros, int64_t group_size) {
  const int64_t outputs = qweight.size(0), inputs = qweight.size(1);
  check_input(x, inputs);
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kChar, "qweight must be dense int8");
  TORCH_CHECK(group_size > 0 && group_size % LANES == 0 && inputs % group_size == 0,
              "group_size must be a multiple of 16 that divides in_features");
  const int64_t groups = inputs / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == outputs * groups,
              "scales must be dense float32 [out, in / group_size]");
  TORCH_CHECK(!zeros || (zeros->is_contiguous() && zeros->scalar_type() == at::kFloat &&
                         zeros->numel() == outputs * groups),
              "zeros must be None or dense float32 [out, in / group_size]");
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  std::vector<float> rows(x.size(0) * inputs), xsums(zeros ? x.size(0) * groups : 0, 0.f);
  with_dtype(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    for (int64_t m = 0; m < x.size(0); ++m)
      for (int64_t k = 0; k < inputs; ++k) rows[m * inputs + k] = to_float(x.data_ptr<T>()[m * x.stride(0) + k]);
    if (zeros) {
      for (int64_t m = 0; m < x.size(0); ++m)
        for (int64_t k = 0; k < inputs; ++k) xsums[m * groups + k / group_size] += rows[m * inputs + k];
    }
    with_tokens(x.size(0), [&](auto tokens) {
      int8_rows<T, decltype(tokens)::value>(rows, xsums, inputs, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                            zeros ? zeros->data_ptr<float>() : nullptr, group_size, outputs,
                                            out.data_ptr<T>());
    });
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size) {
  const int64_t outputs = qweight.size(0), inputs = 2 * qweight.size(1);
  check_input(x, inputs);
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kByte, "qweight must be dense uint8");
  TORCH_CHECK(group_size % (2 * LANES) == 0 && inputs % group_size == 0,
              "group_size must be a multiple of 32 that divides in_features");
  const int64_t groups = inputs / group_size;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == outputs * groups,
                "scales and zeros must be dense float32 [out, in / group_size]");
  }
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  std::vector<float> rows(x.size(0) * inputs), xsums(x.size(0) * groups, 0.f);
  with_dtype(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    for (int64_t m = 0; m < x.size(0); ++m) {
      const T* xm = x.data_ptr<T>() + m * x.stride(0);
      for (int64_t k = 0; k < inputs; k += 2 * LANES) {
        for (int64_t i = 0; i < LANES; ++i) {
          rows[m * inputs + k + i] = to_float(xm[k + 2 * i]);
          rows[m * inputs + k + LANES + i] = to_float(xm[k + 2 * i + 1]);
        }
      }
      for (int64_t k = 0; k < inputs; ++k) xsums[m * groups + k / group_size] += to_float(xm[k]);
    }
    with_tokens(x.size(0), [&](auto tokens) {
      int4_rows<T, decltype(tokens)::value>(rows, xsums, inputs, qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                            zeros.data_ptr<float>(), group_size, outputs, out.data_ptr<T>());
    });
  });
  return out;
}
