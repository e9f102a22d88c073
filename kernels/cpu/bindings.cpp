// The Python module of the CPU kernels: one entry per kernel, each defined in its own file.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>
#include <vector>

#include "decode_stack.h"
#include "ops.h"

// Every kernel runs without the GIL (its arguments are converted before and its result after): it touches no Python
// object, and a long call (a big prefill's attention or projections) must not stall the process's other threads, such
// as the backend's I/O thread, whose heartbeats tell the frontend that the backend lives.
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // window 0: the whole context; softcap 0: none.
  m.def("decode_attention", &decode_attention, ReleaseGil(), "One query token per sequence over its paged context.",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.);
  m.def("prefill_attention", &prefill_attention, ReleaseGil(),
        "Causal attention of prefill chunks over their paged context.", py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.);
  m.def("reshape_and_cache", &reshape_and_cache, ReleaseGil(), "Copy each new token's K/V heads into its cache slot.");
  m.def("rotary_embedding_and_cache", &rotary_embedding_and_cache, ReleaseGil(),
        "Rotate the query and key heads, write the keys and values to their cache slots; returns the query.");
  m.def("argmax_rows", &argmax_rows, ReleaseGil(),
        "Index of each float32 row's largest value, the first of equals or NaNs.");
  m.def("rms_norm", &rms_norm, ReleaseGil(), "RMSNorm of each row, weighted.");
  m.def("add_rms_norm", &add_rms_norm, ReleaseGil(), "RMSNorm of x + residual; returns (normalised, sum).");
  m.def("rotary_embedding", &rotary_embedding, ReleaseGil(), "Neox rotary embedding of query and key heads.");
  m.def("silu_and_mul", &silu_and_mul, ReleaseGil(), "silu(gate) * up of a fused gate/up row.");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, ReleaseGil(), "gelu_pytorch_tanh(gate) * up of a fused gate/up row.");
  m.def("bf16_linear_supported", &bf16_linear_supported, ReleaseGil(), "Whether bf16_linear runs here (AVX-512 bf16).");
  m.def("bf16_pack", &bf16_pack, ReleaseGil(), "A bf16 [out, in] weight in bf16_linear's tiles.");
  m.def("bf16_linear", &bf16_linear, ReleaseGil(), "x @ W.T + b of a bf16 weight in bf16_pack's tiles.");
  m.def("int8_linear", &int8_linear, ReleaseGil(),
        "x @ W.T for 1-8 tokens, W int8 with a scale (and an offset) per row or group.");
  m.def("int4_linear", &int4_linear, ReleaseGil(),
        "x @ W.T for 1-8 tokens, W int4 with a scale and an offset per group.");
  m.def("dequantize_rows", &dequantize_rows, ReleaseGil(), "Rows ids of an int8 or int4 weight, dequantized into out.");
  m.def("a8_linear_supported", &a8_linear_supported, ReleaseGil(), "Whether a8_linear runs here (AVX2).");
  m.def("a8_pack", &a8_pack, ReleaseGil(), "An int8, 6-bit or int4 weight laid out for a8_linear, 8 rows interleaved.");
  m.def("a8_linear", &a8_linear, ReleaseGil(),
        "x @ W.T, W int8, 6-bit or int4 per group, x quantized to int8 per 32 inputs on the fly.");
  m.def("quant_gemm", &quant_gemm, ReleaseGil(),
        "x @ W.T + b for any number of tokens, W int8 or int4 dequantized a panel of columns at a time.");
  m.def("w8a8_supported", &w8a8_supported, ReleaseGil(), "Whether w8a8_linear runs here (AVX-512 VNNI and bf16).");
  m.def("int8_pack", &int8_pack, ReleaseGil(), "An int8 [out, in] weight in w8a8_linear's tiles, and its group sums.");
  m.def("w8a8_linear", &w8a8_linear, ReleaseGil(),
        "x @ W.T + b, W int8 per row, x quantized to int8 per group on the fly.");
  m.def("lora_add_", &lora_add_, ReleaseGil(),
        "y += (x @ A[s].T) @ B.T[s] in place for each (start, end, slot) run of tokens.");
  m.def("moe_pack", &moe_pack, ReleaseGil(),
        "Each expert's [out, in] matrix in the fused MoE op's tiles (bf16_pack's for bf16), stacked.");
  m.def("moe_route", &moe_route, ReleaseGil(),
        "Each token's top-k experts by the router's logits (in x's dtype) and their softmax weights.");
  m.def("fused_moe", &fused_moe, ReleaseGil(), "The routed experts' SwiGLU MLPs, weighted and summed per token.");
  m.def("fused_moe_quantized", &fused_moe_quantized, ReleaseGil(),
        "fused_moe of int8 (per row or group, with or without offsets) or int4 experts, dequantized in registers.");
  m.def("fused_moe_a8", &fused_moe_a8, ReleaseGil(),
        "fused_moe of experts packed by a8_pack and stacked, the activations quantized to int8 as a8_linear's.");
  py::class_<StackProjection>(m, "StackProjection", "A projection as DecodeStack runs it.")
      .def_static("a8", &StackProjection::a8, "a8_linear's parts (a8_pack's tensors, group size, outputs) and bias.")
      .def_static("bf16", &StackProjection::bf16, "bf16_linear's tiles, output rows and bias.")
      .def_static("dense", &StackProjection::dense,
                  "A dense weight (oneDNN's packed layout where onednn, else [out, in]), output rows and bias.");
  py::class_<DecodeStack>(m, "DecodeStack", "A decode step's Llama-family layers in one call.")
      .def(py::init<int64_t, int64_t, int64_t, double, double, const at::Tensor&>())
      .def("add_attention", &DecodeStack::add_attention)
      .def("add_dense_mlp", &DecodeStack::add_dense_mlp)
      .def("add_moe_mlp", &DecodeStack::add_moe_mlp)
      .def("add_moe_a8_mlp", &DecodeStack::add_moe_a8_mlp)
      .def("run", &DecodeStack::run, ReleaseGil());
}
