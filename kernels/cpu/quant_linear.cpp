// Weight-only int8 and int4 projections for a few tokens at a time (decode steps, speculative drafts): the weights
// stream from memory once per call and are turned into float in registers for every token.
//
// A decode step of a small model is bound by reading its weights. torch's CPU int8 kernel
// (aten::_weight_int8pack_mm) reads them at ~7.5 GB/s on two EPYC cores; ours at ~17 (SmolLM2's 30 layers of
// projections, one token: 14.2 against 6.1 ms). The layout is spindle.kernels.quant's, as stored: one int8 value a
// byte and a float32 scale per row or per group of inputs (GGUF's Q8_0 blocks of 32, Q6_K's of 16), with an offset
// per group where the weight has them (Q5_K); int4 two values a byte with a scale and an offset per group. On AVX-512
// the int4 path uses torch's kernel (an int4 kernel of ours ran no faster there); torch's has no fast AVX2 path, where
// ours is 11x faster (spindle.kernels.linear has the numbers).
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "quant_rows.h"

namespace {

using namespace quant_rows;

constexpr int64_t MAX_TOKENS = 8;  // calls with more tokens run the dense weights (spindle.kernels.linear)

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
  std::vector<float> rows(x.size(0) * inputs), xsums(x.size(0) * groups);
  with_dtype(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    for (int64_t m = 0; m < x.size(0); ++m) {
      int4_input_row(x.data_ptr<T>() + m * x.stride(0), inputs, group_size, rows.data() + m * inputs,
                     xsums.data() + m * groups);
    }
    with_tokens(x.size(0), [&](auto tokens) {
      int4_rows<T, decltype(tokens)::value>(rows, xsums, inputs, qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                            zeros.data_ptr<float>(), group_size, outputs, out.data_ptr<T>());
    });
  });
  return out;
}

void dequantize_rows(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                     int64_t group_size, const at::Tensor& ids, const at::Tensor& out) {
  const auto [int4, inputs, groups] = check_quantized_weight(qweight, scales, zeros, group_size, [](bool, int64_t) {});
  const int64_t rows = qweight.size(0);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be dense int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) && out.size(1) == inputs &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be dense float32 or bfloat16 [T, in_features]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "row ", id[t], " out of range for ", rows, " rows");
  }
  const auto* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* s = scales.data_ptr<float>();
  const float* z = zeros ? zeros->data_ptr<float>() : nullptr;
  with_dtype(out, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* o = out.data_ptr<T>();
#pragma omp parallel for if (ids.size(0) >= 64)
    for (int64_t t = 0; t < ids.size(0); ++t) {
      const int64_t n = id[t];
      for (int64_t k = 0; k < inputs; ++k) {
        const int64_t g = n * groups + k / group_size;
        // int4: input 2i in the low nibble, 2i + 1 in the high one, centred on 8 (spindle.kernels.quant's layout)
        const float value = int4 ? static_cast<float>(((q[n * inputs / 2 + k / 2] >> (4 * (k % 2))) & 0xF) - 8)
                                 : static_cast<float>(static_cast<int8_t>(q[n * inputs + k]));
        float scaled = value * s[g];
        asm("" : "+x"(scaled));  // rounded before the offset is added, as torch's ops do (no fused multiply-add)
        o[t * inputs + k] = from_float<T>(scaled + (z ? z[g] : 0.f));
      }
    }
  });
}
