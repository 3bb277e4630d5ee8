// Single-token (decode) CPU kernels for mcserve, built on first use by
// torch.utils.cpp_extension (see __init__.py) into one extension, whose module this file
// defines. Every op has a torch twin with the same signature in twins.py;
// tests/test_cpu_kernels.py compares them.
//
// Why C++: a decode step on CPU is dominated by (a) matrix-vector products, where torch's GEMM
// streams the weights at a third of this machine's bandwidth, and (b) hundreds of tiny tensor
// ops of a few microseconds of dispatch each. Each op here is one pass over its data.
//
// The float32 ops are declared in ops.h and defined by kind: gemv.cpp (matrix-vector product),
// scan.cpp (gated linear attention: one token, a span), steps.cpp (delta rule, RWKV-7,
// vector-gated steps), readout.cpp (paged pools: readouts, attention, MC routing), blocks.cpp
// (whole blocks, conv, RMSNorm), with the helpers they share in common.h; the low-precision
// products are lowp.cpp's, the sampling ops sampling.cpp's. This file holds the module's
// bindings, Mamba2Stack (every Mamba2 layer in one call, built from Python tuples) and
// zeros_hugepage.
// torch's pybind11 casters for tensors, without the C++ frontend of torch/extension.h (a third
// of the compile time)
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include "lowp.h"
#include "ops.h"
#include "sampling.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace mcserve_ops {

// Every layer of a Mamba2 model for one decode token per row: mamba2_block_decode_ layer after
// layer, in one call (the per-layer Python around the block call was a sixth of a one-stream
// step). Built once from each layer's argument tuple (Mamba2Block._fused_args: the weights and
// shapes, S and the conv tail left out); decode_ takes each layer's S and conv tail.
struct Mamba2Stack {
  struct Layer {
    torch::Tensor norm_w, W_in, conv_w, dt_bias, A_log, Dskip, W_out;
    c10::optional<torch::Tensor> s_in, b_in, conv_b, gnorm_w, s_out, b_out;
    double eps, dt_min, dt_max, gnorm_eps;
    bool norm_before_gate;
    int64_t H, P, N, G;
  };
  std::vector<Layer> layers;

  explicit Mamba2Stack(const std::vector<py::tuple>& args) {
    for (const auto& a : args) {
      TORCH_CHECK(a.size() == 22, "Mamba2Stack: 22 arguments per layer expected, got ",
                  a.size());
      auto opt = [&](int i) -> c10::optional<torch::Tensor> {
        if (a[i].is_none()) return c10::nullopt;
        return a[i].cast<torch::Tensor>();
      };
      Layer l;
      l.norm_w = a[0].cast<torch::Tensor>();
      l.eps = a[1].cast<double>();
      l.W_in = a[2].cast<torch::Tensor>();
      l.s_in = opt(3);
      l.b_in = opt(4);
      l.conv_w = a[5].cast<torch::Tensor>();
      l.conv_b = opt(6);
      l.dt_bias = a[7].cast<torch::Tensor>();
      l.A_log = a[8].cast<torch::Tensor>();
      l.dt_min = a[9].cast<double>();
      l.dt_max = a[10].cast<double>();
      l.Dskip = a[11].cast<torch::Tensor>();
      l.gnorm_w = opt(12);
      l.gnorm_eps = a[13].cast<double>();
      l.norm_before_gate = a[14].cast<bool>();
      l.W_out = a[15].cast<torch::Tensor>();
      l.s_out = opt(16);
      l.b_out = opt(17);
      l.H = a[18].cast<int64_t>();
      l.P = a[19].cast<int64_t>();
      l.N = a[20].cast<int64_t>();
      l.G = a[21].cast<int64_t>();
      layers.push_back(std::move(l));
    }
  }

  torch::Tensor decode_(torch::Tensor x, const std::vector<torch::Tensor>& S,
                        const std::vector<torch::Tensor>& conv) const {
    TORCH_CHECK(S.size() == layers.size() && conv.size() == layers.size(),
                "Mamba2Stack.decode_: one S and one conv tail per layer expected");
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      x = mamba2_block_decode_(x, l.norm_w, l.eps, l.W_in, l.s_in, l.b_in, l.conv_w, l.conv_b,
                               l.dt_bias, l.A_log, l.dt_min, l.dt_max, l.Dskip, l.gnorm_w,
                               l.gnorm_eps, l.norm_before_gate, l.W_out, l.s_out, l.b_out, l.H,
                               l.P, l.N, l.G, S[i], conv[i]);
    }
    return x;
  }
};

// A zero-filled CPU tensor whose memory is 2 MiB-aligned and advised for transparent huge pages
// (Linux MADV_HUGEPAGE; elsewhere a plain aligned allocation). Decode reads the block pool in
// 16 KiB pieces scattered over hundreds of MiB: with 4 KiB pages nearly every piece misses the
// TLB (bench/cpu_kernels.py: the grm readout at 32K, 1.04x the 4 KiB-page pool: a small gain).
torch::Tensor zeros_hugepage(std::vector<int64_t> shape, torch::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, "zeros_hugepage: negative dimension");
    numel *= d;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  constexpr size_t kAlign = size_t(2) << 20;
  const size_t len = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kAlign, len) == 0 && p, "zeros_hugepage: out of memory (",
              len, " bytes)");
#ifdef MADV_HUGEPAGE
  madvise(p, len, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
#endif
  std::memset(p, 0, bytes);
  return torch::from_blob(p, shape, [](void* q) { std::free(q); },
                          torch::TensorOptions().dtype(dtype).device(torch::kCPU));
}

}  // namespace mcserve_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace mcserve_ops;
  m.def("gemv", &gemv, "y = x Wᵀ + bias for a few rows");
  m.def("linear_step_", &linear_step_, "one token of gated linear attention, in place");
  m.def("linear_scan", &linear_scan, "a span of gated linear attention, token by token: "
        "(o, final state, the state every `every` tokens)");
  m.def("delta_step_", &delta_step_, "one token of the (gated) delta rule, in place");
  m.def("rwkv7_step_", &rwkv7_step_, "one token of RWKV-7's generalised delta rule, in place");
  m.def("gla_vec_step_", &gla_vec_step_, "one token of vector-gated linear attention, in place");
  m.def("readout_paged", &readout_paged, "weighted readout of pool blocks");
  m.def("paged_attention_decode", &paged_attention_decode,
        "one decode query per row against its keys and values in a paged pool");
  m.def("topk_later", &topk_later, "indices of each row's k largest, ties to the later");
  m.def("select_softmax", &select_softmax,
        "each row's k best visible scores (ties to the later) and their softmax with r_on");
  m.def("dense_softmax_", &dense_softmax_,
        "each row's softmax over its visible scores and r_on, in place; returns r_on's weights");
  m.def("readout_picks", &readout_picks,
        "each token's picked checkpoints read out over a prefill span, grouped by checkpoint");
  m.def("conv_span", &conv_span, "depthwise causal conv of a span after its tail (then SiLU)");
  m.def("conv_step_", &conv_step_, "one token of a depthwise causal conv, tail in place");
  m.def("rms_norm", &rms_norm, "grouped RMSNorm, optionally gated by silu(z)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up in one pass, contiguous");
  m.def("l2norm_", &l2norm_, "each group of columns divided by its L2 norm, in place");
  m.def("mc_scores_", &mc_scores_, "MC routing scores of one token; seg_ksum += k in place");
  m.def("mc_step_readout_", &mc_step_readout_, "online step + weighted readout of pool blocks");
  m.def("native_block_decode_", &native_block_decode_, "one token through a native MC block");
  m.def("mamba2_block_decode_", &mamba2_block_decode_, "one token through a Mamba2 block");
  py::class_<Mamba2Stack>(m, "Mamba2Stack")
      .def(py::init<const std::vector<py::tuple>&>())
      .def("decode_", &Mamba2Stack::decode_, "one token through every layer, states in place");
  m.def("zeros_hugepage", &zeros_hugepage, "zeros on 2 MiB-aligned, huge-page-advised memory");
  m.def("gated_mlp", &mcserve_lowp::gated_mlp,
        "down(act(gate x) * up x) for packed int8 / bfloat16 weights, rows in chunks");
  m.def("moe_experts", &mcserve_lowp::moe_experts,
        "a MoE layer's routed experts (packed int8 / bfloat16) on its tokens, weighted and summed");
  mcserve_lowp::bind(m);
  mcserve_sampling::bind(m);
}
