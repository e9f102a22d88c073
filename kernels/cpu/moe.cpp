// Fused mixture-of-experts MLPs on the CPU: the tokens' expert assignments grouped by expert (a counting sort), each
// expert's rows through its gate/up projection, SiLU-and-mul, its down projection, and each token's outputs weighted
// by the routing weights and summed in assignment order.
//
// bf16 weights laid out by moe_pack (bf16_linear's tiles) run in two OpenMP regions, before and after the SiLU:
// work items of (expert, panel of its rows, tile of output columns) for each projection, in contiguous shares per
// thread, with the gather and the weighted sum as parallel loops beside them. Every output value is computed by one
// work item in a fixed order, so the result does not depend on the thread count or the schedule. Blocks of 8 to 16
// rows run on AMX where the CPU and the OS allow it and the inputs are a multiple of 32 (tdpbf16ps reads
// bf16_linear's tiles as they are: each tile's [pairs][16 columns][2] rows are AMX's pair-interleaved B layout), else
// on bf16_linear's AVX-512 bf16 micro-kernel. float32 weights laid out by moe_pack (tiles of 16 output columns, each
// [inputs][16]) run the same two regions on a 6-row x 16-column micro-kernel in 8-float vectors (AVX2 + FMA here,
// whatever gcc's vector extension maps to elsewhere). Other dtypes and shapes run ATen's matmul per expert.
//
// Quantized experts laid out by a8_pack (fused_moe_a8, the default where the CPU has AVX2) run the same sort, then
// each projection in one call of a8_linear.cpp's kernel over every expert's rows (a8_grouped): the rows quantized to
// int8 per 32 inputs, each expert's panels shared out over the threads in turn. With their activations kept float
// (spindle.kernels.linear.weight_only), quantized experts (spindle.kernels.quant's layouts, stacked [experts, out,
// in]: int4 per group of 32 inputs; int8 per row or per group of 16 or 32, with or without offsets, as GGUF's Q8_0,
// Q5_0, Q5_1, Q5_K and Q6_K blocks decode) run the same sort and the same kind of work items in float32: the grouped
// rows are turned into float once (for int4 in int4_row's nibble order), with their group sums where the weights have
// offsets, and each work item runs its rows, 8 at a time, against each weight row of its column tile with
// quant_rows.h's micro-kernels, which dequantize in registers (AVX-512 or AVX2+FMA, else plain loops).
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bf16_tiles.h"
#include "common.h"
#include "ops.h"
#include "quant_rows.h"

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

// This thread's share of `items` (within an OpenMP region), [begin, end): a contiguous run of them (items follow the
// expert stack in memory, so that what a thread prefetches is what it reads next) holding about 1 / threads of their
// rows, so that the experts given more rows do not leave the other threads waiting at the barrier after them.
std::pair<size_t, size_t> share_of(const std::vector<Item>& items) {
  const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
  int64_t total = 0;
  for (const Item& item : items) total += item.rows;
  size_t begin = items.size(), end = items.size();
  int64_t before = 0;  // the rows of the items before item i
  for (size_t i = 0; i < items.size(); before += items[i].rows, ++i) {
    const int64_t owner = std::min(threads - 1, before * threads / std::max<int64_t>(total, 1));
    if (owner == thread && begin == items.size()) begin = i;
    if (owner > thread) {
      end = i;
      break;
    }
  }
  return {std::min(begin, end), end};
}

#ifdef SPINDLE_AVX512_BF16
// AMX computes 16 rows whatever the count; fewer than this many stay on the AVX-512 kernel, which also prefetches the
// next tile (at decode batch sizes an expert gets a few rows, and its weights come from memory).
constexpr int64_t AMX_MIN_ROWS = 8;

// Runs a work item: x and out are the grouped rows (row `item.row` first), w the expert's packed [outputs, inputs];
// `next_tile` (or null) is fetched meanwhile.
void run_item(const Item& item, const uint16_t* x, int64_t inputs, const uint32_t* w, const uint32_t* next_tile,
              int64_t outputs, bool amx, float* scratch, c10::BFloat16* out) {
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
    tile_rows<NV>(xr + done * inputs, inputs, item.rows - done, tile, done == 0 ? next_tile : nullptr, pairs, nullptr,
                  o + done * outputs, outputs);
  });
}

// Runs this thread's share of a projection's work items (within an OpenMP region, share_of) on bf16 tiles, each item's
// first row block fetching the next item's tile, then waits for the other threads. `w` is the packed stack, `in` and
// `out` the grouped rows.
void run_bf16_items(const std::vector<Item>& items, const c10::BFloat16* in, int64_t inputs, const at::Tensor& w,
                    int64_t outputs, c10::BFloat16* out) {
#ifdef SPINDLE_AMX_BF16
  const bool amx = amx_permitted() && inputs % 32 == 0;
#else
  const bool amx = false;
#endif
  const auto* x = reinterpret_cast<const uint16_t*>(in);
  const auto* stack = reinterpret_cast<const uint32_t*>(w.data_ptr<c10::BFloat16>());
  const int64_t expert_size = outputs * inputs / 2;  // uint32 pairs per expert
  float scratch[16 * TILE];
#ifdef SPINDLE_AMX_BF16
  if (amx) configure_amx();
#endif
  auto tile_of = [&](const Item& item) { return stack + item.expert * expert_size + item.column * inputs / 2; };
  const auto [begin, end] = share_of(items);
  for (size_t i = begin; i < end; ++i) {
    const uint32_t* next = i + 1 < end ? tile_of(items[i + 1]) : nullptr;
    run_item(items[i], x, inputs, stack + items[i].expert * expert_size, next, outputs, amx, scratch, out);
  }
#ifdef SPINDLE_AMX_BF16
  if (amx) _tile_release();
#endif
#pragma omp barrier
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

// Within an OpenMP region (or alone), this thread's share of the grouped rows: row s of `grouped` is its token's row
// of x (`row_bytes` each).
void gather_rows(const char* x, int64_t row_bytes, const Routing& routing, char* grouped) {
  const int64_t rows = static_cast<int64_t>(routing.slot_token.size());
#pragma omp for schedule(static)
  for (int64_t s = 0; s < rows; ++s) {
    std::memcpy(grouped + s * row_bytes, x + routing.slot_token[s] * row_bytes, row_bytes);
  }
}

// Within an OpenMP region, this thread's share of the tokens: each token's outputs, its assignments' grouped rows of
// `down` (`hidden` wide) times their routing weights, summed in float32 in assignment order.
template <typename D, typename T>
void weighted_sums(const D* down, const float* weight, const Routing& routing, int64_t tokens, int64_t top_k,
                   int64_t hidden, T* out) {
  std::vector<float> sum(hidden);
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t k = 0; k < top_k; ++k) {
      const D* row = down + routing.slot_of[t * top_k + k] * hidden;
      const float w = weight[t * top_k + k];
      for (int64_t c = 0; c < hidden; ++c) sum[c] += w * to_float(row[c]);
    }
    for (int64_t c = 0; c < hidden; ++c) out[t * hidden + c] = from_float<T>(sum[c]);
  }
}

// float32 experts: tiles of FLOAT_TILE output columns, each [inputs][FLOAT_TILE], read by a micro-kernel of up to
// FLOAT_ROWS grouped rows: 12 accumulator vectors, 2 weight vectors and a broadcast input, of AVX2's 16 registers. A
// work item runs its rows against FLOAT_DEPTH inputs of its tile at a time (16 KB of weights, which stay in L1 for all
// its row blocks: a whole down-projection tile of 512 inputs and the rows beside it would not), the partial sums
// carried in its output rows.
constexpr int64_t FLOAT_TILE = 16;
constexpr int FLOAT_ROWS = 6;
constexpr int64_t FLOAT_DEPTH = 256;

// Rows [0, M) of x (`x_stride` apart) against `depth` inputs of a packed tile, added to out[m][0, FLOAT_TILE) when
// `accumulate`, else stored there; each value summed over the inputs in order. `prefetch`, when not null, is fetched
// meanwhile (the weights that come next in memory): at decode sizes a tile serves a block or two of rows, and the
// first would otherwise wait on memory.
template <int M>
void float_block(const float* x, int64_t x_stride, int64_t depth, const float* tile, const float* prefetch,
                 bool accumulate, float* out, int64_t out_stride) {
  f8 acc[M][2] = {};
  if (accumulate)
    for (int m = 0; m < M; ++m) {
      acc[m][0] = load8(out + m * out_stride);
      acc[m][1] = load8(out + m * out_stride + 8);
    }
  for (int64_t k = 0; k < depth; ++k) {
    if (prefetch != nullptr) __builtin_prefetch(prefetch + k * FLOAT_TILE);
    const f8 w0 = load8(tile + k * FLOAT_TILE), w1 = load8(tile + k * FLOAT_TILE + 8);
    for (int m = 0; m < M; ++m) {
      const float a = x[m * x_stride + k];
      acc[m][0] += a * w0;
      acc[m][1] += a * w1;
    }
  }
  for (int m = 0; m < M; ++m) {
    store8(out + m * out_stride, acc[m][0]);
    store8(out + m * out_stride + 8, acc[m][1]);
  }
}

// Runs this thread's share of a projection's work items (within an OpenMP region, share_of) on float32 tiles, then
// waits for the other threads; under a dynamic schedule neighbouring items went to different cores, whose prefetches
// then fed each other's caches (bench/results/moe.md, stop 54). `w` is the packed stack, `in` and `out` the grouped
// rows.
void run_float_items(const std::vector<Item>& items, const float* in, int64_t inputs, const at::Tensor& w,
                     int64_t outputs, float* out) {
  const float* stack = w.data_ptr<float>();
  const auto [begin, end] = share_of(items);
  for (size_t i = begin; i < end; ++i) {
    const Item& item = items[i];
    // Tile column / FLOAT_TILE of the expert starts column * inputs floats in.
    const float* tile = stack + (item.expert * outputs + item.column) * inputs;
    for (int64_t k = 0; k < inputs; k += FLOAT_DEPTH) {
      const int64_t depth = std::min(FLOAT_DEPTH, inputs - k);
      const float* part = tile + k * FLOAT_TILE;
      for (int64_t r = 0; r < item.rows; r += FLOAT_ROWS) {
        const int64_t row = item.row + r;
        // The first row block fetches the weights that follow; the later ones would only evict this part from L1.
        const float* prefetch = r == 0 ? part + depth * FLOAT_TILE : nullptr;
        with_tokens(std::min<int64_t>(FLOAT_ROWS, item.rows - r), [&](auto tokens) {
          constexpr int M = std::min<int>(decltype(tokens)::value, FLOAT_ROWS);  // with_tokens' 7 and 8 never come
          float_block<M>(in + row * inputs + k, inputs, depth, part, prefetch, k > 0, out + row * outputs + item.column,
                         outputs);
        });
      }
    }
  }
#pragma omp barrier
}

// The packed paths (bf16 tiles, float32 tiles): the assignments' rows of x gathered by expert, their gate/up
// projection, elementwise.cpp's vectorised SiLU-and-mul (rounded as torch's ops round), the down projection, and each
// token's outputs weighted and summed in float32 in assignment order. Every output value is computed by one work item
// in a fixed order, so the result does not depend on the thread count or the schedule. `run_items(items, in, inputs,
// w, outputs, out)` runs this thread's share of a projection's work items of `tile` columns; it may read `padding`
// rows past the grouped ones (zeros after the SiLU: leftover bits may be denormals, slow to compute on).
template <typename T, typename RunItems>
at::Tensor grouped_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const float* weight,
                       const Routing& routing, int64_t top_k, int64_t intermediate, int64_t tile, int64_t padding,
                       const RunItems& run_items) {
  const int64_t tokens = x.size(0), hidden = x.size(1), assignments = tokens * top_k;
  const at::Tensor xc = x.contiguous();
  const auto options = x.options();
  at::Tensor grouped = at::empty({assignments + padding, hidden}, options);
  at::Tensor gate_up = at::empty({assignments + padding, 2 * intermediate}, options);
  gate_up.narrow(0, assignments, padding).zero_();
  at::Tensor down = at::empty({assignments, hidden}, options), out = at::empty({tokens, hidden}, options);
  const T* xs = xc.data_ptr<T>();
  T* g = grouped.data_ptr<T>();
  T* d = down.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const std::vector<Item> up_items = items_of(routing.starts, 2 * intermediate, tile),
                          down_items = items_of(routing.starts, hidden, tile);
#pragma omp parallel
  {
    gather_rows(reinterpret_cast<const char*>(xs), hidden * sizeof(T), routing, reinterpret_cast<char*>(g));
    run_items(up_items, g, hidden, w13, 2 * intermediate, gate_up.data_ptr<T>());
  }
  const at::Tensor act = silu_and_mul(gate_up);  // its padding rows are the down projection's
#pragma omp parallel
  {
    run_items(down_items, act.data_ptr<T>(), intermediate, w2, hidden, d);
    weighted_sums(d, weight, routing, tokens, top_k, hidden, o);
  }
  return out;
}

// Weight rows (output columns) per quantized work item: 32 KiB of int8 weights at 1024 inputs, re-read from L2 for
// each QUANT_ROWS of the item's rows.
constexpr int64_t QUANT_TILE = 32;
constexpr int64_t QUANT_ROWS = 8;  // grouped rows per micro-kernel call (quant_rows.h's M)

// One projection's quantized [experts, outputs, inputs] stack, as spindle.kernels.quant lays it out.
struct QuantStack {
  const void* q;        // int8 [experts, outputs, inputs] or uint8 [experts, outputs, inputs / 2]
  const float* scales;  // [experts, outputs, groups]
  const float* zeros;   // [experts, outputs, groups] for int4 and int8 with offsets, else null
  int64_t bits, group_size, outputs, inputs;

  QuantStack(const at::Tensor& qweight, const at::Tensor& scales_, const std::optional<at::Tensor>& zeros_,
             int64_t group, int64_t experts, int64_t outputs_, int64_t inputs_)
      : bits(qweight.scalar_type() == at::kChar ? 8 : 4), group_size(group), outputs(outputs_), inputs(inputs_) {
    TORCH_CHECK(qweight.scalar_type() == at::kChar || qweight.scalar_type() == at::kByte,
                "quantized experts are int8 or uint8 (int4 pairs)");
    TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == experts &&
                    qweight.size(1) == outputs && qweight.size(2) * (bits == 8 ? 1 : 2) == inputs,
                "qweight must be dense [", experts, ", ", outputs, ", ", inputs, bits == 8 ? "" : " / 2", "]");
    // The micro-kernels step 16 inputs under one scale for int8, 32 (a byte's two nibbles x 16) for int4.
    const int64_t step = bits == 8 ? quant_rows::LANES : 2 * quant_rows::LANES;
    TORCH_CHECK(group > 0 && group % step == 0 && inputs % group == 0, "group_size ", group, " of int", bits,
                " experts must be a multiple of ", step, " that divides ", inputs, " inputs");
    const int64_t numel = experts * outputs * (inputs / group);
    TORCH_CHECK(scales_.is_contiguous() && scales_.scalar_type() == at::kFloat && scales_.numel() == numel,
                "scales must be dense float32 [experts, out, in / group_size]");
    TORCH_CHECK(zeros_.has_value() || bits == 8, "int4 experts need zeros");
    if (zeros_) {
      TORCH_CHECK(zeros_->is_contiguous() && zeros_->scalar_type() == at::kFloat && zeros_->numel() == numel,
                  "zeros must be dense float32 [experts, out, in / group_size]");
    }
    q = qweight.data_ptr();
    scales = scales_.data_ptr<float>();
    zeros = zeros_ ? zeros_->data_ptr<float>() : nullptr;
  }

  // Whether the micro-kernel reads the rows' group sums: the offsets' share of each dot product (int4, int8 with
  // offsets).
  bool sums() const { return zeros != nullptr; }

  // Grouped row `src` (inputs values) in float as the micro-kernel reads it: `row`, and its group sums where sums().
  template <typename T>
  void input_row(const T* src, float* row, float* xsums) const {
    if (bits == 4) {
      quant_rows::int4_input_row(src, inputs, group_size, row, xsums);
      return;
    }
    for (int64_t k = 0; k < inputs; ++k) row[k] = to_float(src[k]);
    if (sums()) quant_rows::group_sums(row, inputs, group_size, xsums);
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
            quant_rows::int8_row<M>(x + row * inputs, sums() ? xsums + row * groups : nullptr, inputs,
                                    static_cast<const int8_t*>(q) + w * inputs, scales + w * groups,
                                    sums() ? zeros + w * groups : nullptr, group_size, totals);
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

  // Runs this thread's share of a projection's work items (within an OpenMP region, share_of), then waits for the
  // other threads.
  void run_items(const std::vector<Item>& items, const float* x, const float* xsums, float* out) const {
    const auto [begin, end] = share_of(items);
    for (size_t i = begin; i < end; ++i) run(items[i], x, xsums, out);
#pragma omp barrier
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
  // Group sums (one per group of each row) for a stack with offsets; one without reads none.
  const auto group_sums = [&](const QuantStack& w) {
    return at::empty({w.sums() ? assignments * (w.inputs / w.group_size) : 0}, floats);
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
  // is read while it is written), int8 ones read as they are (with their group sums where the weights have offsets).
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
    } else if (w2.sums()) {
#pragma omp for schedule(static)
      for (int64_t s = 0; s < assignments; ++s)
        quant_rows::group_sums(a + s * intermediate, intermediate, w2.group_size, as + s * down_groups);
    }
    w2.run_items(down_items, ar, as, d);
    weighted_sums(d, weight, routing, tokens, top_k, hidden, o);
  }
  return out;
}

}  // namespace

at::Tensor moe_pack(const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 3, "weights must be [experts, out, in]");
  if (weights.scalar_type() == at::kFloat) {
    const int64_t experts = weights.size(0), outputs = weights.size(1), inputs = weights.size(2);
    TORCH_CHECK(outputs % FLOAT_TILE == 0, "float32 experts pack in tiles of ", FLOAT_TILE, " outputs, not ", outputs);
    return weights.reshape({experts, outputs / FLOAT_TILE, FLOAT_TILE, inputs})
        .transpose(2, 3)
        .contiguous()
        .view({experts, outputs * inputs});
  }
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
  if (tiled) {
    TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
                "the tiled experts take x of their dtype");
    if (x.scalar_type() == at::kFloat)
      return grouped_moe<float>(x, w13, w2, weights.data_ptr<float>(), routing, top_k, intermediate, FLOAT_TILE, 0,
                                run_float_items);
#ifdef SPINDLE_AVX512_BF16
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "the tiled experts are bf16 or float32");
    // AMX reads x in blocks of 16 rows: the last block of the last expert reads up to 15 rows past the grouped ones.
    return grouped_moe<c10::BFloat16>(x, w13, w2, weights.data_ptr<float>(), routing, top_k, intermediate, TILE, 15,
                                      run_bf16_items);
#else
    TORCH_CHECK(false, "tiled bf16 experts need a CPU with AVX-512 bf16");
#endif
  }

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

at::Tensor fused_moe_a8(const at::Tensor& x, const std::vector<std::optional<at::Tensor>>& w13, int64_t w13_group_size,
                        const std::vector<std::optional<at::Tensor>>& w2, int64_t w2_group_size,
                        int64_t intermediate, const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [tokens, hidden]");
  TORCH_CHECK(w13.size() == 4 && w2.size() == 4 && w13[0] && w13[1] && w2[0] && w2[1],
              "w13 and w2 are each a8_pack's (packed, scales, offsets, supers), stacked by expert");
  const int64_t experts = w13[0]->size(0), tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  TORCH_CHECK(w2[0]->size(0) == experts, "w13 and w2 must hold as many experts");
  const Routing routing = sort_by_expert(x, topk_weights, topk_ids, experts);
  const int64_t assignments = tokens * top_k;
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous(), xc = x.contiguous();
  at::Tensor grouped = at::empty({assignments, hidden}, x.options()), out = at::empty({tokens, hidden}, x.options());
  // A decode step's few rows are gathered, and summed below, without waking the other threads.
#pragma omp parallel if (assignments >= 64)
  gather_rows(static_cast<const char*>(xc.data_ptr()), hidden * x.element_size(), routing,
              static_cast<char*>(grouped.data_ptr()));
  const at::Tensor gate_up =
      a8_grouped(grouped, *w13[0], *w13[1], w13[2], w13[3], w13_group_size, 2 * intermediate, routing.starts);
  const at::Tensor down =
      a8_grouped(silu_and_mul(gate_up), *w2[0], *w2[1], w2[2], w2[3], w2_group_size, hidden, routing.starts);
  with_dtype(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
#pragma omp parallel if (tokens >= 32)
    weighted_sums(down.data_ptr<T>(), weights.data_ptr<float>(), routing, tokens, top_k, hidden, out.data_ptr<T>());
  });
  return out;
}

namespace {

// moe_route's work: token t's logits against each expert's router row (summed in float32, rounded to T), their top k,
// and its softmax weights, into weights[t] and ids[t].
template <typename T>
void route_rows(const T* x, const T* router, int64_t tokens, int64_t hidden, int64_t experts, int64_t top_k,
                bool renormalize, float* weights, int64_t* ids) {
#pragma omp parallel for if (tokens >= 256)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> logits(experts);
    for (int64_t e = 0; e < experts; ++e) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t h = 0; h < hidden; ++h) sum += to_float(x[t * hidden + h]) * to_float(router[e * hidden + h]);
      logits[e] = to_float(from_float<T>(sum));  // the logits in the model dtype, as F.linear gives them
    }
    // The top k, largest first, a NaN above every number, ordered among equal values exactly as torch.topk orders
    // them on the CPU (its TopKImpl.h: the same queue, comparison and standard algorithms; not stable).
    std::vector<std::pair<float, int64_t>> queue(experts);
    for (int64_t e = 0; e < experts; ++e) queue[e] = {logits[e], e};
    const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return (is_nan(a.first) && !is_nan(b.first)) || a.first > b.first;
    };
    if (top_k * 64 <= experts) {
      std::partial_sort(queue.begin(), queue.begin() + top_k, queue.end(), larger);
    } else {
      std::nth_element(queue.begin(), queue.begin() + top_k - 1, queue.end(), larger);
      std::sort(queue.begin(), queue.begin() + top_k - 1, larger);
    }
    // The softmax of the top k logits where renormalised (the top k of the softmax, scaled to sum to 1), else of all.
    const float top = queue[0].first;
    float total = 0.f;
    if (renormalize)
      for (int64_t k = 0; k < top_k; ++k) total += std::exp(queue[k].first - top);
    else
      for (int64_t e = 0; e < experts; ++e) total += std::exp(logits[e] - top);
    for (int64_t k = 0; k < top_k; ++k) {
      weights[t * top_k + k] = std::exp(queue[k].first - top) / total;
      ids[t * top_k + k] = queue[k].second;
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool renormalize) {
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1),
              "x must be [tokens, hidden] and the router [experts, hidden]");
  TORCH_CHECK(x.scalar_type() == router.scalar_type(), "x and the router must share a dtype");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "], got ", top_k);
  at::Tensor weights = at::empty({tokens, top_k}, x.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, x.options().dtype(at::kLong));
  const at::Tensor xc = x.contiguous(), rc = router.contiguous();
  DISPATCH_MODEL_TYPES(x.scalar_type(), "moe_route", [&] {
    route_rows<scalar_t>(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(), tokens, hidden, experts, top_k,
                         renormalize, weights.data_ptr<float>(), ids.data_ptr<int64_t>());
  });
  return {weights, ids};
}
