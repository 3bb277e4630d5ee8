// The MLPs of the CPU models in one call (lowp.h): a dense gated MLP (gated_mlp) and the routed
// experts of a sparse MoE layer (moe_experts).
//
// gated_mlp: a prefill's SwiGLU through separate ops writes the (T, 2I) gate/up projection, reads
// it for the activation and writes (T, I) again, all in memory at thousands of rows (at 8192 rows
// and I = 688 the projection alone is 45 MB, past glibc's mmap threshold, so each call also
// faults its pages in afresh). Here rows go through in chunks, each chunk's gate and up sums,
// activation and down projection in one thread's caches; on AMX tiles the activation is applied
// as the sums leave the tiles (amx.cpp: amx_bf16_gated). A row's result does not depend on the
// chunking or the other rows (each product is lowp.cpp's, row-invariant).
//
// moe_experts: at one token a MoE layer runs top_k experts of two small products each
// (Granite-4.0-H: 6 experts, 512 × 1536 and 768 × 512 weights): the products take about 18 us
// together, the Python around each expert (slicing, the wrappers' checks, a tensor per result,
// the activation) more than twice that. Here the routing's pairs are grouped by expert with a
// counting sort, each expert's rows gathered, multiplied (lowp.cpp's kernels, one parallel region
// per product), the activation applied and the weighted rows added into the output in (expert,
// pair) order, the order of models/moe.py's loop (its index_add over the pairs sorted by expert).
// float32 experts (the stacked parameters themselves) take gemv.cpp's product for an expert's one
// or two rows and ATen's linear beyond, as that loop did.
#include "lowp.h"
#include "ops.h"
#include "vmath.h"

#include <ATen/Parallel.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mcserve_lowp {
namespace {

inline float activate(float v, int64_t act) {
  switch (act) {
    case 1: return v > 0.f ? v * v : 0.f;
    case 2: return v > 0.f ? v : 0.f;
    default: return v / (1.f + std::exp(-v));
  }
}

// y (c, N) = x (c, K) · W (N, K)ᵀ for a float32 weight: gemv.cpp at one or two rows, else ATen
void f32_rows(const torch::Tensor& W, float* x, int64_t c, int64_t K, float* y) {
  auto xt = torch::from_blob(x, {c, K}, torch::kFloat32);
  auto yt = torch::from_blob(y, {c, W.size(0)}, torch::kFloat32);
  yt.copy_(c <= 2 ? mcserve_ops::gemv(xt, W, c10::nullopt) : at::linear(xt, W));
}

void check_f32_stack(const torch::Tensor& W, int64_t E, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(W.device().is_cpu() && W.scalar_type() == torch::kFloat32 && W.is_contiguous()
                  && W.dim() == 3 && W.size(0) == E && W.size(1) == N && W.size(2) == K,
              "moe_experts: float32 ", what, " (", E, ", ", N, ", ", K, ") expected, got ",
              W.sizes());
}

void check_stacked(const torch::Tensor& P, const torch::Tensor& s, int64_t E, int64_t N,
                   int64_t K, torch::ScalarType t, const char* what) {
  TORCH_CHECK(P.device().is_cpu() && P.scalar_type() == t && P.is_contiguous(), "moe_experts: ",
              what, " must be a contiguous ", t, " CPU tensor, got ", P.scalar_type());
  TORCH_CHECK(P.dim() == 5 && P.size(0) == E && P.size(1) == (N + 15) / 16
                  && P.size(2) == (K + 1) / 2 && P.size(3) == 16 && P.size(4) == 2,
              "moe_experts: ", what, " (", E, ", ", (N + 15) / 16, ", ", (K + 1) / 2,
              ", 16, 2) expected, got ", P.sizes());
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == torch::kFloat32 && s.is_contiguous()
                  && s.dim() == 2 && s.size(0) == E && s.size(1) == N,
              "moe_experts: the scales of ", what, " (", E, ", ", N, ") float32 expected, got ",
              s.sizes());
}

// o[0:n] = act(g) · u, 16 at a time (vmath.h vact, the tail through a padded copy)
void act_mul(const float* g, const float* u, float* o, int64_t n, int act) {
  using mcserve_ops::load16;
  using mcserve_ops::store16;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(o + i, mcserve_ops::vact(load16(g + i), act) * load16(u + i));
  if (i < n) {
    alignas(64) float gt[16] = {}, ut[16] = {}, ot[16];
    std::memcpy(gt, g + i, sizeof(float) * (n - i));
    std::memcpy(ut, u + i, sizeof(float) * (n - i));
    store16(ot, mcserve_ops::vact(load16(gt), act) * load16(ut));
    std::memcpy(o + i, ot, sizeof(float) * (n - i));
  }
}

}  // namespace

torch::Tensor gated_mlp(const torch::Tensor& x, const torch::Tensor& gate,
                        const torch::Tensor& s_gate, const torch::Tensor& up,
                        const torch::Tensor& s_up, const torch::Tensor& down,
                        const torch::Tensor& s_down, int64_t act) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2
                  && x.is_contiguous(), "gated_mlp: x must be contiguous float32 (T, D)");
  TORCH_CHECK(act >= 0 && act <= 2, "gated_mlp: act must be 0 (silu), 1 (relu2) or 2 (relu)");
  const auto t = gate.scalar_type();
  TORCH_CHECK(t == torch::kChar || t == torch::kBFloat16,
              "gated_mlp: packed int8 or bfloat16 weights expected, got ", t);
  const int64_t T = x.size(0), D = x.size(1), I = s_gate.numel();
  check_packed(gate, s_gate, D, t, "gated_mlp (gate)");
  TORCH_CHECK(s_up.numel() == I, "gated_mlp: gate and up must have the same outputs");
  check_packed(up, s_up, D, t, "gated_mlp (up)");
  TORCH_CHECK(s_down.numel() == D, "gated_mlp: down must have D = ", D, " outputs");
  check_packed(down, s_down, I, t, "gated_mlp (down)");
  auto out = torch::empty({T, D}, x.options());
  if (T == 0) return out;
  const bool is_int8 = t == torch::kChar;
  const bool amx = !is_int8 && bf16_level() >= 4 && I > 0;
  const int64_t KP = gate.size(1), KPd = down.size(1), Kx = (2 * KP + 31) / 32 * 32;
  const RowChunks rc = row_chunks(T, I);  // rows per chunk: the chunk's (rows, I) sums
  const int64_t R = rc.rows, chunks = rc.count;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const void *gp = gate.data_ptr(), *upp = up.data_ptr(), *dp = down.data_ptr();
  const float *sg = s_gate.data_ptr<float>(), *su = s_up.data_ptr<float>(),
              *sd = s_down.data_ptr<float>();
  auto run = [&](int64_t c0, int64_t c1) {
    std::vector<float> h(static_cast<size_t>(R * I)), hu(amx ? 0 : static_cast<size_t>(R * I));
    std::vector<uint16_t> xb(amx ? static_cast<size_t>(R * Kx) : 0);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r0 = c * R, rows = std::min(R, T - r0);
      if (amx) {  // x rounded to bfloat16, rows zero-padded to Kx and to whole tiles of 16
        const int64_t padded = (rows + 15) / 16 * 16;
        for (int64_t r = 0; r < padded; ++r) {
          uint16_t* dst = xb.data() + r * Kx;
          const int64_t done = r < rows ? D : 0;
          if (r < rows) mcserve_ops::to_bf16(xp + (r0 + r) * D, dst, D);
          std::memset(dst + done, 0, sizeof(uint16_t) * (Kx - done));
        }
        amx_bf16_gated(static_cast<const uint16_t*>(gp), static_cast<const uint16_t*>(upp), I,
                       KP, xb.data(), Kx, rows, sg, su, static_cast<int>(act), h.data());
      } else {
        lowp_rows(is_int8, gp, I, KP, xp + r0 * D, rows, D, sg, h.data());
        lowp_rows(is_int8, upp, I, KP, xp + r0 * D, rows, D, su, hu.data());
        act_mul(h.data(), hu.data(), h.data(), rows * I, static_cast<int>(act));
      }
      lowp_rows(is_int8, dp, D, KPd, h.data(), rows, I, sd, op + r0 * D);
    }
  };
  // enough chunks: one thread per chunk, everything in its caches; else the products parallel
  if (rc.threaded) {
    at::parallel_for(0, chunks, 1, run);
  } else {
    run(0, chunks);
  }
  return out;
}

torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& w,
                          const torch::Tensor& w_in, const c10::optional<torch::Tensor>& s_in,
                          const torch::Tensor& down, const c10::optional<torch::Tensor>& s_down,
                          bool gated, int64_t act) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2
                  && x.is_contiguous(), "moe_experts: x must be contiguous float32 (T, D)");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(idx.scalar_type() == torch::kLong && idx.dim() == 2 && idx.size(0) == T
                  && idx.is_contiguous(), "moe_experts: idx must be contiguous int64 (T, k)");
  const int64_t k = idx.size(1);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.size(0) == T
                  && w.size(1) == k && w.is_contiguous(),
              "moe_experts: w must be contiguous float32 (T, k) like idx");
  TORCH_CHECK(act >= 0 && act <= 2, "moe_experts: act must be 0 (silu), 1 (relu2) or 2 (relu)");
  const bool f32 = w_in.scalar_type() == torch::kFloat32;
  const bool is_int8 = w_in.scalar_type() == torch::kChar;
  const auto t = is_int8 ? torch::kChar : torch::kBFloat16;
  int64_t E = -1, N1 = -1;
  if (f32) {
    TORCH_CHECK(w_in.dim() == 3, "moe_experts: float32 w_in (E, N1, D) expected");
    E = w_in.size(0), N1 = w_in.size(1);
  } else {
    TORCH_CHECK(s_in.has_value() && s_in->dim() == 2 && s_down.has_value(),
                "moe_experts: packed weights need their scales s_in (E, N1) and s_down (E, D)");
    E = s_in->size(0), N1 = s_in->size(1);
  }
  const int64_t I = gated ? N1 / 2 : N1;
  TORCH_CHECK(E > 0 && N1 > 0 && (!gated || N1 % 2 == 0),
              "moe_experts: N1 must be 2I (gated) or I");
  if (f32) {
    check_f32_stack(w_in, E, N1, D, "w_in");
    check_f32_stack(down, E, D, I, "down");
  } else {
    check_stacked(w_in, *s_in, E, N1, D, t, "w_in");
    check_stacked(down, *s_down, E, D, I, t, "down");
  }
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "moe_experts: expert index ", ip[p], " out of [0, ", E,
                ")");
    ++start[ip[p] + 1];
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, start[e + 1]);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> pairs(T * k), fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) pairs[fill[ip[p]]++] = p;  // stable: pair order kept

  auto out = torch::zeros({T, D}, x.options());
  if (T == 0) return out;
  std::vector<float> xs(most * D), h(most * N1), a(most * I), y(most * D);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t in_stride = w_in.stride(0) * w_in.element_size();
  const int64_t down_stride = down.stride(0) * down.element_size();
  const auto* in_base = static_cast<const char*>(w_in.data_ptr());
  const auto* down_base = static_cast<const char*>(down.data_ptr());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = start[e + 1] - start[e];
    if (c == 0) continue;
    const int64_t* pe = pairs.data() + start[e];
    for (int64_t j = 0; j < c; ++j)
      std::memcpy(xs.data() + j * D, xp + (pe[j] / k) * D, sizeof(float) * D);
    if (f32) {
      f32_rows(w_in[e], xs.data(), c, D, h.data());
    } else {
      lowp_rows(is_int8, in_base + e * in_stride, N1, w_in.size(2), xs.data(), c, D,
                s_in->data_ptr<float>() + e * N1, h.data());
    }
    for (int64_t j = 0; j < c; ++j) {
      const float* hj = h.data() + j * N1;
      float* aj = a.data() + j * I;
      if (gated) {
        for (int64_t i = 0; i < I; ++i) aj[i] = activate(hj[i], act) * hj[I + i];
      } else {
        for (int64_t i = 0; i < I; ++i) aj[i] = activate(hj[i], act);
      }
    }
    if (f32) {
      f32_rows(down[e], a.data(), c, I, y.data());
    } else {
      lowp_rows(is_int8, down_base + e * down_stride, D, down.size(2), a.data(), c, I,
                s_down->data_ptr<float>() + e * D, y.data());
    }
    for (int64_t j = 0; j < c; ++j) {
      const float g = wp[pe[j]];
      float* o = op + (pe[j] / k) * D;
      const float* yj = y.data() + j * D;
      for (int64_t d = 0; d < D; ++d) o[d] += g * yj[d];
    }
  }
  return out;
}

}  // namespace mcserve_lowp
