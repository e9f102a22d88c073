// The small per-token ops of a decoder layer on the CPU, each one pass over its tokens: RMSNorm (with the residual
// add fused in), rotary embedding of the query and key heads, and the gated activations (SwiGLU, GeGLU). In eager torch each is a chain of 4 to 10
// ops, each a dispatch plus a full pass over memory; here each token is read once and written once, in float.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

// Below this many tokens a step's ops take microseconds, less than waking the OpenMP threads.
constexpr int64_t PARALLEL_TOKENS = 32;
// Below this many query or key values (tokens x heads x head size) the rotation runs on the calling thread.
constexpr int64_t PARALLEL_ROTATION = 1 << 16;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [num_tokens, width] with a dense last dimension");
}

#ifdef __AVX512F__
// v rounded to T and back: bf16's rounding, none for float.
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return round_bf16(v);
  return v;
}

// One row of rms_norm_impl 16 values at a time (width a multiple of 16), with the same roundings: the sum x + residual
// rounded to T (written to st) when rt is given, the squares summed in 16 lanes and then across them, the normalised
// values rounded to T before the weight. gcc left the scalar loops' bf16 conversions unvectorized: a 2,048-token
// prefill's norm took ~270 us on 2 Zen 4 cores.
template <typename T>
void norm_row16(const T* xt, const T* rt, T* st, const T* w, float eps, int64_t width, float* row, T* ot) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    __m512 v = load16(xt + i);
    if (rt != nullptr) {
      v = round_to<T>(_mm512_add_ps(v, load16(rt + i)));
      store16(st + i, v);
    }
    _mm512_storeu_ps(row + i, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + eps));
  for (int64_t i = 0; i < width; i += 16)
    store16(ot + i, _mm512_mul_ps(load16(w + i), round_to<T>(_mm512_mul_ps(_mm512_loadu_ps(row + i), inv))));
}
#endif

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                   at::Tensor& out, at::Tensor* sum) {
  const int64_t tokens = x.size(0), width = x.size(1);
  const T* w = weight.data_ptr<T>();
  const float feps = static_cast<float>(eps);
#pragma omp parallel if (tokens >= PARALLEL_TOKENS)
  {
    std::vector<float> row(width);  // one per thread
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      const T* xt = x.data_ptr<T>() + t * x.stride(0);
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        if (width % 16 == 0) {
          const T* rt = residual != nullptr ? residual->data_ptr<T>() + t * residual->stride(0) : nullptr;
          T* st = sum != nullptr ? sum->data_ptr<T>() + t * width : nullptr;
          norm_row16(xt, rt, st, w, feps, width, row.data(), out.data_ptr<T>() + t * width);
          continue;
        }
      }
#endif
      if (residual != nullptr) {
        // The sum is rounded to the dtype before the statistics, as the torch reference adds in the dtype.
        const T* rt = residual->data_ptr<T>() + t * residual->stride(0);
        T* st = sum->data_ptr<T>() + t * width;
        for (int64_t i = 0; i < width; ++i) {
          st[i] = from_float<T>(to_float(xt[i]) + to_float(rt[i]));
          row[i] = to_float(st[i]);
        }
      } else {
        for (int64_t i = 0; i < width; ++i) row[i] = to_float(xt[i]);
      }
      float square_sum = 0.f;
      for (int64_t i = 0; i < width; ++i) square_sum += row[i] * row[i];
      const float inv = 1.f / std::sqrt(square_sum / static_cast<float>(width) + feps);
      T* ot = out.data_ptr<T>() + t * width;
      // Normalised, rounded to the dtype, then weighted: Llama's reference order.
      for (int64_t i = 0; i < width; ++i)
        ot[i] = from_float<T>(to_float(w[i]) * to_float(from_float<T>(row[i] * inv)));
    }
  }
}

template <typename T>
void rotate_impl(const int64_t* positions, const at::Tensor& x, const T* cache, int64_t rot_half, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_size = x.size(2);
  const int64_t half = head_size / 2, token_stride = x.stride(0), head_stride = x.stride(1);
  // The pointers once, not a data_ptr call per head, and restrict (out is a new tensor), so that gcc vectorizes the
  // rotation; threads only for a prefill's many heads, as a decode step's rotation takes microseconds
  // (bench/results/decode_attention.md).
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
#pragma omp parallel for if (tokens * heads * head_size >= PARALLEL_ROTATION)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* cos = cache + positions[t] * 2 * rot_half;
    const T* sin = cos + rot_half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* __restrict src = x_data + t * token_stride + h * head_stride;
      T* __restrict dst = out_data + (t * heads + h) * head_size;
      // Each product is rounded to the dtype before the sum, as transformers' and our torch reference's ops do, so
      // that reduced-precision results match them bit for bit.
      int64_t i = 0;
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = load16(src + i), x2 = load16(src + i + half), c = load16(cos + i), s = load16(sin + i);
          store16(dst + i, _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s))));
          store16(dst + i + half, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s))));
        }
#endif
      for (; i < half; ++i) {
        const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
        const float c = to_float(cos[i]), s = to_float(sin[i]);
        dst[i] = from_float<T>(to_float(from_float<T>(x1 * c)) - to_float(from_float<T>(x2 * s)));
        dst[i + half] = from_float<T>(to_float(from_float<T>(x2 * c)) + to_float(from_float<T>(x1 * s)));
      }
    }
  }
}

// x * sigmoid(g) = x / (1 + e^-g), with e^-g = 2^n * 2^r (n = round(-g log2 e), |r| <= 1/2, 2^r by a degree-6
// Taylor polynomial), in plain float and integer ops that gcc vectorizes on any ISA: SiLU (x = g) within 4e-6 of it
// relatively over |g| < 80 (the float product -g log2 e carries most of that); after the rounding to bf16, equal to
// torch's on the SwiGLU test's 98,304 random values. Measured in SmolLM2's bf16 prefill on 2 Zen 4 cores, the 30
// layers' SwiGLU of a 1,024-token prompt took 17-18 ms against 22-24 with libm's expf (glibc's vector variant), 36-40
// against 44-50 at 2,048 tokens. The exponent is clamped to +-126, so that e^-g stays finite: past g = -87 the result
// is x / 2^126 rather than x / inf (both round to about 0), and x = -inf, whose torch result is -inf * 0 = NaN, is
// found by its bits, as -ffast-math may fold float tests for infinities.
inline float times_sigmoid(float x, float g) {
  const float y = std::min(std::max(g * -1.44269504f, -126.f), 126.f);
  const int32_t n = static_cast<int32_t>(y + 126.5f) - 126;  // round half up: y + 126.5 > 0 truncates as floor
  const float r = y - static_cast<float>(n);
  float p = 1.5403530e-4f;  // ln(2)^k / k!, k = 6 down to 0
  p = p * r + 1.3333558e-3f;
  p = p * r + 9.6181291e-3f;
  p = p * r + 5.5504109e-2f;
  p = p * r + 0.24022651f;
  p = p * r + 0.69314718f;
  p = p * r + 1.f;
  const uint32_t scale_bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  uint32_t x_bits;
  std::memcpy(&x_bits, &x, sizeof(x_bits));
  const float result = x / (1.f + p * scale);
  return x_bits == 0xff800000u ? std::numeric_limits<float>::quiet_NaN() : result;
}

inline float silu(float g) { return times_sigmoid(g, g); }

// gelu_pytorch_tanh(g) = g (1 + tanh(u)) / 2 = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): the sigmoid form
// has no 1 + tanh(u) to cancel at large negative g, where torch's float op loses every digit (-2.98e-7 at g = -5,
// against -2.3e-7). The rounding of u in float leaves it within 3e-5 of float64's over |g| < 80.
inline float gelu_tanh(float g) { return times_sigmoid(g, 1.5957691f * g * (1.f + 0.044715f * g * g)); }

template <typename T, float (*Activation)(float)>
void act_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t tokens = x.size(0), d = x.size(1) / 2;
#pragma omp parallel for if (tokens >= PARALLEL_TOKENS)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* __restrict gate = x.data_ptr<T>() + t * x.stride(0);
    const T* __restrict up = gate + d;
    T* __restrict ot = out.data_ptr<T>() + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      // The activation rounded to the dtype before the product, as the torch reference's two ops round.
      ot[i] = from_float<T>(to_float(from_float<T>(Activation(to_float(gate[i])))) * to_float(up[i]));
    }
  }
}

template <float (*Activation)(float)>
at::Tensor act_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's width must be even (gate and up halves)");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DISPATCH_MODEL_TYPES(x.scalar_type(), "act_and_mul", [&] {
    act_and_mul_impl<scalar_t, Activation>(x, out);
  });
  return out;
}

}  // namespace

// x [num_tokens, hidden] (rows may be strided), weight [hidden]: the normalised rows, weighted.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a dense [hidden] of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, nullptr, weight, eps, out, nullptr);
  });
  return out;
}

// As rms_norm, of x + residual; returns (normalised, x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x's shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a dense [hidden] of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  DISPATCH_MODEL_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, &residual, weight, eps, out, &sum);
  });
  return {out, sum};
}

// positions [num_tokens] int64; query [num_tokens, heads, head_size] and key [num_tokens, kv_heads, head_size] (views
// with a dense last dimension); cos_sin_cache [max_position, head_size] (cos then sin halves). Neox layout.
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "positions: int64 [num_tokens]");
  for (const at::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == positions.size(0), "query and key must be ",
                "[num_tokens, heads, head_size] with a dense last dimension");
    TORCH_CHECK(x->size(2) == cos_sin_cache.size(1) && x->scalar_type() == cos_sin_cache.scalar_type(),
                "the cache's width and dtype must match the heads'");
  }
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) % 2 == 0, "cos_sin_cache: dense, even width");
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the rotary cache");
  auto q_out = at::empty(query.sizes(), query.options());
  auto k_out = at::empty(key.sizes(), key.options());
  DISPATCH_MODEL_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* cache = cos_sin_cache.data_ptr<scalar_t>();
    rotate_impl<scalar_t>(pos, query, cache, cos_sin_cache.size(1) / 2, q_out);
    rotate_impl<scalar_t>(pos, key, cache, cos_sin_cache.size(1) / 2, k_out);
  });
  return {q_out, k_out};
}

// x [num_tokens, 2 * d] (gate, then up): silu(gate) * up, [num_tokens, d].
at::Tensor silu_and_mul(const at::Tensor& x) { return act_and_mul<silu>(x); }

// x [num_tokens, 2 * d] (gate, then up): gelu_pytorch_tanh(gate) * up, [num_tokens, d].
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return act_and_mul<gelu_tanh>(x); }
