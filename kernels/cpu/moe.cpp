// Fused mixture-of-experts MLPs on the CPU: the tokens' expert assignments grouped by expert (a counting sort), then
// per expert one GEMM per projection over its rows (gate/up fused, SiLU-and-mul, down), the outputs weighted by the
// routing weights into one float32 row per assignment, and each token's rows summed in assignment order (the result
// does not depend on the thread count). The loop over the experts runs here, not in Python: per expert a handful of
// ATen calls of a few microseconds each. bf16 weights laid out by moe_pack run bf16_linear's AVX-512 bf16 tiles,
// which split each expert's output columns over the threads; others run ATen's matmul (MKL or oneDNN).
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include <optional>
#include <vector>

#include "common.h"

at::Tensor bf16_pack(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t outputs,
                       const std::optional<at::Tensor>& bias);
at::Tensor silu_and_mul(const at::Tensor& x);

at::Tensor moe_pack(const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 3, "weights must be [experts, out, in]");
  std::vector<at::Tensor> packed;
  packed.reserve(weights.size(0));
  for (int64_t e = 0; e < weights.size(0); ++e) packed.push_back(bf16_pack(weights[e]));
  return at::stack(packed);
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids, int64_t num_experts, int64_t intermediate, bool tiled) {
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int64 [tokens, top_k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be [tokens, top_k]");
  TORCH_CHECK(w13.size(0) == num_experts && w2.size(0) == num_experts, "w13 and w2 must hold ", num_experts,
              " experts");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1), assignments = tokens * top_k;
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Counting sort of the assignments by expert, stable: each expert's rows in token order.
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t a = 0; a < assignments; ++a) {
    TORCH_CHECK(id[a] >= 0 && id[a] < num_experts, "expert id ", id[a], " out of range");
    ++starts[id[a] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  at::Tensor order = at::empty({assignments}, ids.options());
  at::Tensor order_tokens = at::empty({assignments}, ids.options());
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    int64_t* o = order.data_ptr<int64_t>();
    int64_t* t = order_tokens.data_ptr<int64_t>();
    for (int64_t a = 0; a < assignments; ++a) {
      const int64_t slot = next[id[a]]++;
      o[slot] = a;
      t[slot] = a / top_k;
    }
  }

  const at::Tensor weights = topk_weights.to(at::kFloat).reshape({assignments});
  at::Tensor rows = at::empty({assignments, hidden}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count == 0) continue;
    const at::Tensor mine = order.narrow(0, starts[e], count);
    const at::Tensor xe = x.index_select(0, order_tokens.narrow(0, starts[e], count));
    const at::Tensor gate_up = tiled ? bf16_linear(xe, w13[e], 2 * intermediate, std::nullopt) : xe.mm(w13[e].t());
    const at::Tensor act = silu_and_mul(gate_up);
    const at::Tensor down = tiled ? bf16_linear(act, w2[e], hidden, std::nullopt) : act.mm(w2[e].t());
    rows.index_copy_(0, mine, down.to(at::kFloat).mul_(weights.index_select(0, mine).unsqueeze(1)));
  }
  return rows.view({tokens, top_k, hidden}).sum(1).to(x.scalar_type());
}
