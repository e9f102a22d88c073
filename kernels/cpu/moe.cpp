// Fused mixture-of-experts MLPs on the CPU: the tokens' expert assignments grouped by expert (a counting sort), each
// expert's rows through its gate/up projection, SiLU-and-mul, its down projection, and each token's outputs weighted
// by the routing weights and summed in assignment order.
//
// bf16 weights laid out by moe_pack (bf16_linear's tiles) run in two OpenMP regions, before and after the SiLU:
// work items of (expert, panel of its rows, tile of output columns) for each projection, handed out dynamically,
// with the gather and the weighted sum as parallel loops beside them. Every output value is computed by one work item in a fixed order,
// so the result does not depend on the thread count or the schedule. Blocks of 8 to 16 rows run on AMX where the CPU
// and the OS allow it and the inputs are a multiple of 32 (tdpbf16ps reads bf16_linear's tiles as they are: each
// tile's [pairs][16 columns][2] rows are AMX's pair-interleaved B layout), else on bf16_linear's AVX-512 bf16
// micro-kernel. Other dtypes and CPUs run ATen's matmul per expert.
//
// Quantized experts (spindle.kernels.quant's int8 per row or int4 per group, stacked [experts, out, in]) run the same
// sort and the same kind of work items in float32: the grouped rows are turned into float once (in int4_row's nibble
// order, with their group sums), and each work item runs its rows, 8 at a time, against each weight row of its column
// tile with quant_rows.h's micro-kernels, which dequantize in registers (AVX-512 or AVX2+FMA, else plain loops).
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include <optional>
#include <vector>

#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bf16_tiles.h"
#include "common.h"
#include "quant_rows.h"

at::Tensor bf16_pack(const at::Tensor& weight);
at::Tensor silu_and_mul(const at::Tensor& x);

namespace {

#if defined(SPINDLE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPINDLE_AMX_BF16 1

// Linux hands the AMX tile registers only to a process that asks for them (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a kernel without AMX support refuses, and the op then stays on AVX-512.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Palette 1: tiles 0-2 accumulate 16 rows x 16 float columns each, tile 3 holds 16 rows of 32 inputs, tiles 4-6 hold
// 16 input pairs of one 16-column vector of a weight tile.
void configure_amx() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 7; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// Rows [0, rows) of x (rows <= 16) against one weight tile of NV vectors (pairs % 16 == 0): out[m][0, 16 NV) in
// bf16. The tile loads 16 rows of x whatever `rows` is: x must have 16 readable rows (the rows past `rows` only reach
// accumulator rows that are not stored). `scratch` holds 16 x 48 floats.
template <int NV>
void amx_block(const uint16_t* x, int64_t x_stride, int64_t rows, const uint32_t* tile, int64_t pairs, float* scratch,
               c10::BFloat16* out, int64_t out_stride) {
  constexpr int64_t width = 16 * NV, tile_stride = 4 * width;  // a pair's row of the tile: width uint32 values
  _tile_zero(0);
  if constexpr (NV > 1) _tile_zero(1);
  if constexpr (NV > 2) _tile_zero(2);
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(3, x + 2 * p, 2 * x_stride);
    _tile_loadd(4, tile + p * width, tile_stride);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (NV > 1) {
      _tile_loadd(5, tile + p * width + 16, tile_stride);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (NV > 2) {
      _tile_loadd(6, tile + p * width + 32, tile_stride);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, scratch, 4 * width);
  if constexpr (NV > 1) _tile_stored(1, scratch + 16, 4 * width);
  if constexpr (NV > 2) _tile_stored(2, scratch + 32, 4 * width);
  for (int m = 0; m < rows; ++m)
    for (int v = 0; v < NV; ++v) store16(out + m * out_stride + 16 * v, _mm512_loadu_ps(scratch + m * width + 16 * v));
}
#endif

constexpr int64_t PANEL = 64;  // rows of one expert per work item

// One work item: rows [row, row + rows) of the grouped x against one tile of output columns of an expert's weight.
struct Item {
  int64_t expert, row, rows, column;
};

// The work items of one projection of `outputs` columns: per expert with rows, its panels x the weight's tiles of
// `tile` columns.
std::vector<Item> items_of(const std::vector<int64_t>& starts, int64_t outputs, int64_t tile) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < starts.size(); ++e)
    for (int64_t row = starts[e]; row < starts[e + 1]; row += PANEL)
      for (int64_t column = 0; column < outputs; column += tile)
        items.push_back({static_cast<int64_t>(e), row, std::min(PANEL, starts[e + 1] - row), column});
  return items;
}

#ifdef SPINDLE_AVX512_BF16
// AMX computes 16 rows whatever the count; fewer than this many stay on the AVX-512 kernel, which also prefetches the
// next tile (at decode batch sizes an expert gets a few rows, and its weights come from memory).
constexpr int64_t AMX_MIN_ROWS = 8;

// Runs a work item: x and out are the grouped rows (row `item.row` first), w the expert's packed [outputs, inputs].
void run_item(const Item& item, const uint16_t* x, int64_t inputs, const uint32_t* w, int64_t outputs, bool amx,
              float* scratch, c10::BFloat16* out) {
  const int64_t pairs = inputs / 2, width = std::min(TILE, outputs - item.column);
  const uint32_t* tile = w + item.column * pairs;
  const uint16_t* xr = x + item.row * inputs;
  c10::BFloat16* o = out + item.row * outputs + item.column;
  with_vectors(width / 16, [&](auto vectors) {
    constexpr int NV = decltype(vectors)::value;
    int64_t done = 0;
#ifdef SPINDLE_AMX_BF16
    if (amx)
      for (; item.rows - done >= AMX_MIN_ROWS; done += 16)
        amx_block<NV>(xr + done * inputs, inputs, std::min<int64_t>(16, item.rows - done), tile, pairs, scratch,
                      o + done * outputs, outputs);
#endif
    tile_rows<NV>(xr + done * inputs, inputs, item.rows - done, tile, nullptr, pairs, nullptr, o + done * outputs,
                  outputs);
  });
}

// The tiled path: x bf16 [tokens, hidden], `slot_token[s]` the token of the s-th grouped row, `slot_of[a]` the grouped
// row of assignment a. Returns the per-token weighted sums, bf16 [tokens, hidden].
at::Tensor tiled_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const float* weight,
                     const std::vector<int64_t>& starts, const std::vector<int64_t>& slot_token,
                     const std::vector<int64_t>& slot_of, int64_t top_k, int64_t intermediate) {
  const int64_t tokens = x.size(0), hidden = x.size(1), assignments = tokens * top_k;
  const at::Tensor xc = x.contiguous();
  const auto options = x.options();
  // AMX reads x in blocks of 16 rows: the last block of the last expert reads up to 15 rows past the grouped ones.
  at::Tensor grouped = at::empty({assignments + 15, hidden}, options);
  at::Tensor gate_up = at::empty({assignments + 15, 2 * intermediate}, options);
  // The SiLU runs over the padding rows too: zeros, not leftover bits, which may be denormals (slow to compute on).
  gate_up.narrow(0, assignments, 15).zero_();
  at::Tensor down = at::empty({assignments, hidden}, options), out = at::empty({tokens, hidden}, options);
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  auto* g = reinterpret_cast<uint16_t*>(grouped.data_ptr<c10::BFloat16>());
  c10::BFloat16* d = down.data_ptr<c10::BFloat16>();
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const auto* w13s = reinterpret_cast<const uint32_t*>(w13.data_ptr<c10::BFloat16>());
  const auto* w2s = reinterpret_cast<const uint32_t*>(w2.data_ptr<c10::BFloat16>());
  const std::vector<Item> up_items = items_of(starts, 2 * intermediate, TILE),
                          down_items = items_of(starts, hidden, TILE);
  const int64_t w13_size = intermediate * hidden, w2_size = hidden * intermediate / 2;  // uint32 pairs per expert
#ifdef SPINDLE_AMX_BF16
  const bool amx_up = amx_permitted() && hidden % 32 == 0, amx_down = amx_permitted() && intermediate % 32 == 0;
#else
  const bool amx_up = false, amx_down = false;
#endif

  // Runs a projection's work items on this thread's share, dynamically: experts' row counts differ.
  const auto run_items = [&](const std::vector<Item>& items, const uint16_t* in, int64_t inputs, const uint32_t* w,
                             int64_t w_size, int64_t outputs, bool amx, c10::BFloat16* result) {
    float scratch[16 * TILE];
#ifdef SPINDLE_AMX_BF16
    if (amx) configure_amx();
#endif
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i)
      run_item(items[i], in, inputs, w + items[i].expert * w_size, outputs, amx, scratch, result);
#ifdef SPINDLE_AMX_BF16
    if (amx) _tile_release();
#endif
  };

#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < assignments; ++s)
      std::memcpy(g + s * hidden, xs + slot_token[s] * hidden, hidden * sizeof(uint16_t));
    run_items(up_items, g, hidden, w13s, w13_size, 2 * intermediate, amx_up, gate_up.data_ptr<c10::BFloat16>());
  }
  // elementwise.cpp's vectorised SiLU, rounded as torch's ops round; its padding rows are the down projection's.
  const at::Tensor act = silu_and_mul(gate_up);
  const auto* a = reinterpret_cast<const uint16_t*>(act.data_ptr<c10::BFloat16>());
#pragma omp parallel
  {
    run_items(down_items, a, intermediate, w2s, w2_size, hidden, amx_down, d);
    std::vector<float> sum(hidden);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t slot = slot_of[t * top_k + k];
        const float w = weight[t * top_k + k];
        for (int64_t c = 0; c < hidden; ++c) sum[c] += w * to_float(d[slot * hidden + c]);
      }
      for (int64_t c = 0; c < hidden; ++c) o[t * hidden + c] = from_float<c10::BFloat16>(sum[c]);
    }
  }
  return out;
}
#endif

// The assignments grouped by expert: expert e's grouped rows are [starts[e], starts[e + 1]), `slot_token[s]` is the
// token of grouped row s, `slot_of[a]` the grouped row of assignment a (token a / top_k, its (a % top_k)-th expert).
struct Routing {
  std::vector<int64_t> starts, slot_token, slot_of;
};

// A counting sort of the assignments by expert, stable: each expert's rows in token order.
Routing sort_by_expert(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       int64_t num_experts) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int64 [tokens, top_k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be [tokens, top_k]");
  const int64_t top_k = topk_ids.size(1), assignments = topk_ids.numel();
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  Routing routing{std::vector<int64_t>(num_experts + 1, 0), std::vector<int64_t>(assignments),
                  std::vector<int64_t>(assignments)};
  std::vector<int64_t>& starts = routing.starts;
  for (int64_t a = 0; a < assignments; ++a) {
    TORCH_CHECK(id[a] >= 0 && id[a] < num_experts, "expert id ", id[a], " out of range");
    ++starts[id[a] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t a = 0; a < assignments; ++a) {
    const int64_t slot = next[id[a]]++;
    routing.slot_token[slot] = a / top_k;
    routing.slot_of[a] = slot;
  }
  return routing;
}

// Weight rows (output columns) per quantized work item: 32 KiB of int8 weights at 1024 inputs, re-read from L2 for
// each QUANT_ROWS of the item's rows.
constexpr int64_t QUANT_TILE = 32;
constexpr int64_t QUANT_ROWS = 8;  // grouped rows per micro-kernel call (quant_rows.h's M)

// One projection's quantized [experts, outputs, inputs] stack, as spindle.kernels.quant lays it out.
struct QuantStack {
  const void* q;        // int8 [experts, outputs, inputs] or uint8 [experts, outputs, inputs / 2]
  const float* scales;  // [experts, outputs, groups]
  const float* zeros;   // [experts, outputs, groups] for int4, else null
  int64_t bits, group_size, outputs, inputs;

  QuantStack(const at::Tensor& qweight, const at::Tensor& scales_, const std::optional<at::Tensor>& zeros_,
             int64_t group, int64_t experts, int64_t outputs_, int64_t inputs_)
      : bits(qweight.scalar_type() == at::kChar ? 8 : 4), group_size(group), outputs(outputs_), inputs(inputs_) {
    TORCH_CHECK(qweight.scalar_type() == at::kChar || qweight.scalar_type() == at::kByte,
                "quantized experts are int8 or uint8 (int4 pairs)");
    TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == experts &&
                    qweight.size(1) == outputs && qweight.size(2) * (bits == 8 ? 1 : 2) == inputs,
                "qweight must be dense [", experts, ", ", outputs, ", ", inputs, bits == 8 ? "" : " / 2", "]");
    TORCH_CHECK(group % (2 * quant_rows::LANES) == 0 && inputs % group == 0, "group_size ", group,
                " must be a multiple of 32 that divides ", inputs, " inputs");
    const int64_t numel = experts * outputs * (inputs / group);
    TORCH_CHECK(scales_.is_contiguous() && scales_.scalar_type() == at::kFloat && scales_.numel() == numel,
                "scales must be dense float32 [experts, out, in / group_size]");
    TORCH_CHECK(zeros_.has_value() == (bits == 4), "int4 experts have zeros, int8 ones none");
    if (zeros_) {
      TORCH_CHECK(zeros_->is_contiguous() && zeros_->scalar_type() == at::kFloat && zeros_->numel() == numel,
                  "zeros must be dense float32 [experts, out, in / group_size]");
    }
    q = qweight.data_ptr();
    scales = scales_.data_ptr<float>();
    zeros = zeros_ ? zeros_->data_ptr<float>() : nullptr;
  }

  // Grouped row `src` (inputs values) in float as the micro-kernel reads it: `row`, and for int4 its group sums.
  template <typename T>
  void input_row(const T* src, float* row, float* xsums) const {
    if (bits == 4) {
      quant_rows::int4_input_row(src, inputs, group_size, row, xsums);
    } else {
      for (int64_t k = 0; k < inputs; ++k) row[k] = to_float(src[k]);
    }
  }

  // A work item: its grouped rows of x (float, from input_row; row `item.row` first) against its expert's weight rows
  // [column, column + QUANT_TILE), into the float rows of out (`outputs` wide).
  void run(const Item& item, const float* x, const float* xsums, float* out) const {
    const int64_t groups = inputs / group_size, width = std::min(QUANT_TILE, outputs - item.column);
    const int64_t first = item.expert * outputs + item.column;  // the tile's first weight row in the stack
    for (int64_t r = 0; r < item.rows; r += QUANT_ROWS) {
      const int64_t row = item.row + r;
      with_tokens(std::min(QUANT_ROWS, item.rows - r), [&](auto tokens) {
        constexpr int M = decltype(tokens)::value;
        for (int64_t n = 0; n < width; ++n) {
          float totals[M];
          const int64_t w = first + n;
          if (bits == 8) {
            // Experts are quantized at load, symmetric: no offsets, so no group sums either.
            quant_rows::int8_row<M>(x + row * inputs, nullptr, inputs, static_cast<const int8_t*>(q) + w * inputs,
                                    scales + w * groups, nullptr, group_size, totals);
          } else {
            quant_rows::int4_row<M>(x + row * inputs, xsums + row * groups, inputs,
                                    static_cast<const uint8_t*>(q) + w * inputs / 2, scales + w * groups,
                                    zeros + w * groups, group_size, totals);
          }
          for (int m = 0; m < M; ++m) out[(row + m) * outputs + item.column + n] = totals[m];
        }
      });
    }
  }

  // Runs this thread's share of a projection's work items (within an OpenMP region), dynamically: experts' row counts
  // differ.
  void run_items(const std::vector<Item>& items, const float* x, const float* xsums, float* out) const {
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) run(items[i], x, xsums, out);
  }
};

// The quantized path: x [tokens, hidden] float32 or bf16; the gate/up, the SiLU and the down projection in float32.
template <typename T>
at::Tensor quantized_moe(const at::Tensor& x, const QuantStack& w13, const QuantStack& w2, const float* weight,
                         const Routing& routing, int64_t top_k) {
  const int64_t tokens = x.size(0), hidden = x.size(1), assignments = tokens * top_k;
  const int64_t intermediate = w2.inputs;
  const at::Tensor xc = x.contiguous();
  const auto floats = x.options().dtype(at::kFloat);
  // Group sums for int4 (one per group of each row); an int8 stack reads none.
  const auto group_sums = [&](const QuantStack& w) {
    return at::empty({w.bits == 4 ? assignments * (w.inputs / w.group_size) : 0}, floats);
  };
  at::Tensor grouped = at::empty({assignments, hidden}, floats), grouped_sums = group_sums(w13);
  at::Tensor gate_up = at::empty({assignments, 2 * intermediate}, floats);
  at::Tensor down = at::empty({assignments, hidden}, floats), out = at::empty({tokens, hidden}, x.options());
  float* g = grouped.data_ptr<float>();
  float* gs = grouped_sums.data_ptr<float>();
  const T* xs = xc.data_ptr<T>();
  const std::vector<Item> up_items = items_of(routing.starts, 2 * intermediate, QUANT_TILE),
                          down_items = items_of(routing.starts, hidden, QUANT_TILE);
  const int64_t up_groups = hidden / w13.group_size, down_groups = intermediate / w2.group_size;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < assignments; ++s)
      w13.input_row(xs + routing.slot_token[s] * hidden, g + s * hidden, gs + s * up_groups);
    w13.run_items(up_items, g, gs, gate_up.data_ptr<float>());
  }
  // elementwise.cpp's vectorised SiLU; int4 rows are then permuted to the nibble order (in a copy: the SiLU's output
  // is read while it is written), int8 ones read as they are.
  at::Tensor act = silu_and_mul(gate_up), act_sums = group_sums(w2);
  const at::Tensor act_rows = w2.bits == 4 ? at::empty(act.sizes(), floats) : act;
  const float* a = act.data_ptr<float>();
  float* ar = act_rows.data_ptr<float>();
  float* as = act_sums.data_ptr<float>();
  float* d = down.data_ptr<float>();
  T* o = out.data_ptr<T>();
#pragma omp parallel
  {
    if (w2.bits == 4) {
#pragma omp for schedule(static)
      for (int64_t s = 0; s < assignments; ++s)
        w2.input_row(a + s * intermediate, ar + s * intermediate, as + s * down_groups);
    }
    w2.run_items(down_items, ar, as, d);
    std::vector<float> sum(hidden);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const float* row = d + routing.slot_of[t * top_k + k] * hidden;
        const float w = weight[t * top_k + k];
        for (int64_t c = 0; c < hidden; ++c) sum[c] += w * row[c];
      }
      for (int64_t c = 0; c < hidden; ++c) o[t * hidden + c] = from_float<T>(sum[c]);
    }
  }
  return out;
}

}  // namespace

at::Tensor moe_pack(const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 3, "weights must be [experts, out, in]");
  std::vector<at::Tensor> packed;
  packed.reserve(weights.size(0));
  for (int64_t e = 0; e < weights.size(0); ++e) packed.push_back(bf16_pack(weights[e]));
  return at::stack(packed);
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, int64_t num_experts, int64_t intermediate, bool tiled) {
  TORCH_CHECK(w13.size(0) == num_experts && w2.size(0) == num_experts, "w13 and w2 must hold ", num_experts,
              " experts");
  const Routing routing = sort_by_expert(x, topk_weights, topk_ids, num_experts);
  const std::vector<int64_t>&starts = routing.starts, &slot_token = routing.slot_token, &slot_of = routing.slot_of;
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1), assignments = tokens * top_k;
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
#ifdef SPINDLE_AVX512_BF16
  if (tiled) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the tiled experts take bf16 x");
    return tiled_moe(x, w13, w2, weights.data_ptr<float>(), starts, slot_token, slot_of, top_k, intermediate);
  }
#else
  TORCH_CHECK(!tiled, "tiled experts need a CPU with AVX-512 bf16");
#endif

  // Other dtypes and CPUs: ATen's matmul per expert, the outputs weighted into one float32 row per assignment.
  const auto index = topk_ids.options();
  at::Tensor order = at::empty({assignments}, index), order_tokens = at::empty({assignments}, index);
  int64_t* o = order.data_ptr<int64_t>();
  for (int64_t a = 0; a < assignments; ++a) o[slot_of[a]] = a;
  std::copy(slot_token.begin(), slot_token.end(), order_tokens.data_ptr<int64_t>());
  const at::Tensor flat_weights = weights.reshape({assignments});
  at::Tensor rows = at::empty({assignments, hidden}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count == 0) continue;
    const at::Tensor mine = order.narrow(0, starts[e], count);
    const at::Tensor xe = x.index_select(0, order_tokens.narrow(0, starts[e], count));
    const at::Tensor down = silu_and_mul(xe.mm(w13[e].t())).mm(w2[e].t());
    rows.index_copy_(0, mine, down.to(at::kFloat).mul_(flat_weights.index_select(0, mine).unsqueeze(1)));
  }
  return rows.view({tokens, top_k, hidden}).sum(1).to(x.scalar_type());
}

at::Tensor fused_moe_quantized(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scales,
                               const std::optional<at::Tensor>& w13_zeros, int64_t w13_group_size,
                               const at::Tensor& w2, const at::Tensor& w2_scales,
                               const std::optional<at::Tensor>& w2_zeros, int64_t w2_group_size,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [tokens, hidden]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 and w2 must be [experts, out, in (/ 2)]");
  const int64_t experts = w13.size(0), hidden = x.size(1), intermediate = w13.size(1) / 2;
  const QuantStack up(w13, w13_scales, w13_zeros, w13_group_size, experts, 2 * intermediate, hidden);
  const QuantStack down(w2, w2_scales, w2_zeros, w2_group_size, experts, hidden, intermediate);
  const Routing routing = sort_by_expert(x, topk_weights, topk_ids, experts);
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  if (x.scalar_type() == at::kFloat)
    return quantized_moe<float>(x, up, down, weights.data_ptr<float>(), routing, topk_ids.size(1));
  return quantized_moe<c10::BFloat16>(x, up, down, weights.data_ptr<float>(), routing, topk_ids.size(1));
}
