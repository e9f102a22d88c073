// Grouped int8 and int4 projections with int8 activations on AVX2: x @ W.T, W in spindle.kernels.quant's layout as
// stored (the weight-only kernels' input: GGUF's Q4_K/Q4_0/Q4_1 as int4 per 32, Q6_K/Q8_0/Q5_K as int8 per 16 or
// 32), each call's rows quantized to int8 per block of 32 inputs on the fly (one scale per block, its largest
// magnitude / 127), as llama.cpp quantizes activations for its K-quant dot products.
//
// The weight-only kernels (quant_rows.h) widen each weight to float and run one FMA per weight and token: on AVX2 that
// is the limit, not reading the weights. Here 32 weights and 32 activations of one block meet in vpmaddubsw (unsigned
// by signed bytes, pairs summed into int16) and vpmaddwd (pairs into int32), then one conversion and one FMA scale the
// block's 8 int32 sums by weight scale x activation scale. int4 values 0..15 are unsigned as they are; signed int8
// weights go in as |w| with the activation's sign flipped where w < 0 (vpsignb). A pair sum is at most 2 x 128 x 127
// and fits int16. The activations are permuted within each block as the weights' bytes hold them: for int4 the
// 16 low nibbles' inputs (even ones), then the 16 high ones'.
//
// Offsets (w = q s + z, or (q - 8) s + z for int4) add z x sum(x) per group, the sum of the quantized x: the result is
// the exact product of the quantized activations and the weight (spindle.kernels.quant.a8_linear, the reference).
#include <ATen/ops/empty.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "quant_rows.h"

namespace {

constexpr int64_t BLOCK = 32;       // inputs per activation scale
constexpr int64_t TOKEN_BLOCK = 8;  // tokens run against a weight row together (accumulators in registers)
constexpr int64_t ROW_TILE = 16;    // weight rows a work item runs every token block against (kept in L1)
constexpr int64_t TOKEN_PANEL = 64;  // tokens whose int8 rows stay in L2 while the weights stream past them
static_assert(TOKEN_PANEL % TOKEN_BLOCK == 0, "a block of tokens never crosses a panel");

// Each row of x as int8 blocks of BLOCK inputs with one scale each, the int4 order permuted (nibble_order); and, for
// offsets, the sums of the quantized x over each weight group.
struct Activations {
  std::vector<int8_t> values;   // [tokens][inputs]
  std::vector<float> scales;    // [tokens][inputs / BLOCK]
  std::vector<float> sums;      // [tokens][inputs / group_size], empty without offsets
};

template <typename T>
Activations quantize_activations(const T* x, int64_t stride, int64_t tokens, int64_t inputs, bool nibble_order,
                                 int64_t group_size, bool with_sums) {
  const int64_t blocks = inputs / BLOCK, groups = inputs / group_size;
  Activations a{std::vector<int8_t>(tokens * inputs), std::vector<float>(tokens * blocks),
                std::vector<float>(with_sums ? tokens * groups : 0, 0.f)};
  for (int64_t m = 0; m < tokens; ++m) {
    const T* row = x + m * stride;
    for (int64_t b = 0; b < blocks; ++b) {
      float values[BLOCK], largest = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) {
        values[i] = to_float(row[b * BLOCK + i]);
        largest = std::max(largest, std::abs(values[i]));
      }
      const float scale = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
      a.scales[m * blocks + b] = scale;
      int8_t* q = a.values.data() + m * inputs + b * BLOCK;
      for (int64_t i = 0; i < BLOCK; ++i) {
        // Input i goes where the weight's byte holds it: int4 input 2j is byte j's low nibble, 2j + 1 its high one.
        const int64_t at = nibble_order ? (i % 2) * (BLOCK / 2) + i / 2 : i;
        q[at] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
      }
      if (with_sums) {  // per group, or per half block for groups of 16 (int8 only: its values are in order)
        const int64_t part = std::min(group_size, BLOCK);
        for (int64_t start = 0; start < BLOCK; start += part) {
          int32_t sum = 0;
          for (int64_t i = start; i < start + part; ++i) sum += q[i];
          a.sums[m * groups + (b * BLOCK + start) / group_size] += scale * static_cast<float>(sum);
        }
      }
    }
  }
  return a;
}

#ifdef __AVX2__
using quant_rows::hsum;

// 32 unsigned weights by 32 signed activations: 8 int32 sums, lanes 0-3 over bytes 0-15, lanes 4-7 over 16-31.
inline __m256i dot32(__m256i unsigned_weights, __m256i activations) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_weights, activations), _mm256_set1_epi16(1));
}

// One weight row's dot products with M tokens (rows of a, starting at token m0), without offsets: totals[m].
// INT4: q holds inputs / 2 bytes (values 0..15, w = (q - 8) s + z); else inputs int8 values. SIXTEEN: a scale per 16
// inputs (GGUF's Q6_K), which splits each block's sums in halves; else group_size is a multiple of 32.
template <int M, bool INT4, bool SIXTEEN>
inline void row_dots(const Activations& a, int64_t m0, int64_t inputs, const uint8_t* q, const float* scales,
                     int64_t group_size, float* totals) {
  const int64_t blocks = inputs / BLOCK;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i weights, signs;
    if constexpr (INT4) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * BLOCK / 2));
      const __m128i nibble = _mm_set1_epi8(0x0F);
      weights = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
    } else {
      signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * BLOCK));
      weights = _mm256_abs_epi8(signs);
    }
    __m256 scale;
    if constexpr (SIXTEEN) {
      scale = _mm256_set_m128(_mm_set1_ps(scales[2 * b + 1]), _mm_set1_ps(scales[2 * b]));
    } else {
      scale = _mm256_set1_ps(scales[b * BLOCK / group_size]);
    }
    for (int m = 0; m < M; ++m) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.values.data() + (m0 + m) * inputs + b * BLOCK));
      if constexpr (!INT4) x = _mm256_sign_epi8(x, signs);
      const __m256 block_scale = _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[(m0 + m) * blocks + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(weights, x)), block_scale, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) totals[m] = hsum(acc[m]);
}

template <typename T, bool INT4, bool SIXTEEN>
void run(const Activations& a, int64_t tokens, int64_t inputs, const uint8_t* qweight, const float* scales,
         const float* zeros, int64_t group_size, int64_t outputs, T* out) {
  const int64_t groups = inputs / group_size, row_bytes = INT4 ? inputs / 2 : inputs;
#pragma omp parallel
  for (int64_t panel = 0; panel < tokens; panel += TOKEN_PANEL) {
#pragma omp for schedule(static) nowait
    for (int64_t first = 0; first < outputs; first += ROW_TILE) {
      const int64_t last = std::min(first + ROW_TILE, outputs);
      for (int64_t m0 = panel; m0 < std::min(panel + TOKEN_PANEL, tokens); m0 += TOKEN_BLOCK) {
        with_tokens(std::min(TOKEN_BLOCK, tokens - m0), [&](auto block) {
          constexpr int M = decltype(block)::value;
          for (int64_t n = first; n < last; ++n) {
            float totals[M];
            row_dots<M, INT4, SIXTEEN>(a, m0, inputs, qweight + n * row_bytes, scales + n * groups, group_size, totals);
            float offsets[M] = {};  // the offsets' share: sum_g (z_g - 8 s_g for int4) * sum of the group's inputs
            if (zeros != nullptr) {
              for (int64_t g = 0; g < groups; ++g) {
                const float z = INT4 ? zeros[n * groups + g] - 8.f * scales[n * groups + g] : zeros[n * groups + g];
                for (int m = 0; m < M; ++m) offsets[m] += z * a.sums[(m0 + m) * groups + g];
              }
            }
            for (int m = 0; m < M; ++m) out[(m0 + m) * outputs + n] = from_float<T>(totals[m] + offsets[m]);
          }
        });
      }
    }
  }
}
#endif

}  // namespace

bool a8_linear_supported() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& zeros, int64_t group_size) {
  TORCH_CHECK(a8_linear_supported(), "a8_linear needs AVX2");
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qweight.scalar_type() == at::kChar, "qweight must be int8, or uint8 holding int4");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be dense [out, in] (int4: [out, in / 2])");
  const int64_t outputs = qweight.size(0), inputs = int4 ? 2 * qweight.size(1) : qweight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == inputs, "x must be [tokens, in_features], dense rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(inputs % BLOCK == 0, "in_features must be a multiple of 32");
  const bool sixteen = group_size == 16;
  TORCH_CHECK((sixteen && !int4) || (group_size > 0 && group_size % BLOCK == 0 && inputs % group_size == 0),
              "group_size must be a multiple of 32 that divides in_features (or 16 for int8)");
  const int64_t groups = inputs / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == outputs * groups,
              "scales must be dense float32 [out, in / group_size]");
  TORCH_CHECK(!int4 || zeros, "an int4 weight needs its offsets");
  TORCH_CHECK(!zeros || (zeros->is_contiguous() && zeros->scalar_type() == at::kFloat &&
                         zeros->numel() == outputs * groups),
              "zeros must be None or dense float32 [out, in / group_size]");
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
#ifdef __AVX2__
  const float* zero_data = zeros ? zeros->data_ptr<float>() : nullptr;
  const auto* q = static_cast<const uint8_t*>(qweight.data_ptr());
  auto go = [&](auto* type, auto int4_flag, auto sixteen_flag) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Activations a = quantize_activations(x.data_ptr<T>(), x.stride(0), x.size(0), inputs, int4, group_size,
                                               zeros.has_value());
    run<T, decltype(int4_flag)::value, decltype(sixteen_flag)::value>(
        a, x.size(0), inputs, q, scales.data_ptr<float>(), zero_data, group_size, outputs, out.data_ptr<T>());
  };
  with_dtype(x, [&](auto* type) {
    if (int4) {
      go(type, std::true_type{}, std::false_type{});
    } else if (sixteen) {
      go(type, std::false_type{}, std::true_type{});
    } else {
      go(type, std::false_type{}, std::false_type{});
    }
  });
#endif
  return out;
}
