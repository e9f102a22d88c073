// The Python module of the CPU kernels: one entry per kernel, each defined in its own file.
#include <torch/extension.h>

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "One query token per sequence over its paged context.");
  m.def("prefill_attention", &prefill_attention, "Causal attention of prefill chunks over their paged context.");
}
