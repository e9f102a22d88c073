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

#include "bf16_tiles.h"
#include "common.h"

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
