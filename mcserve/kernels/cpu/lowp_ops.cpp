// The tensor side of the low-precision products (lowp.h): argument checks, the rows of a
// many-row product in chunks over the threads (row_chunks), the int8 / bfloat16 linears, the
// bfloat16 outer product of the cached readout's X-buffer form, and the bindings. The kernels,
// their run-time dispatch and self-test are lowp.cpp's.
#include "lowp.h"

// torch's pybind11 casters for tensors, without the C++ frontend of torch/extension.h (a third
// of the compile time)
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mcserve_lowp {
namespace {

constexpr int kL = 16;  // outputs per block, as lowp.cpp packs them

void check_f32_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor, got ", t.scalar_type());
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_f32_2d(*bias, "bias");
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bias (", N, ",) expected, got ",
              bias->sizes());
  return bias->data_ptr<float>();
}

// y rows [r0, r0 + rows) from x rows [r0, r0 + rows) by fn(r0, rows), in row_chunks' chunks:
// each thread rounds, multiplies and writes its own rows in its caches with the weights in L2
// (the products' own split of a call's blocks over the threads has every thread read every row)
template <class F>
void by_row_chunks(int64_t B, int64_t N, F fn) {
  const RowChunks rc = row_chunks(B, N);
  if (!rc.threaded) return fn(0, B);
  at::parallel_for(0, rc.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(c * rc.rows, std::min(rc.rows, B - c * rc.rows));
  });
}

int pick(int64_t impl, int best, const char* what) {
  if (impl < 0) return best;
  TORCH_CHECK(impl <= best, what, ": implementation ", impl, " is not available on this CPU "
              "(best: ", best, ")");
  return static_cast<int>(impl);
}

}  // namespace

RowChunks row_chunks(int64_t B, int64_t N) {
  const int64_t R = std::clamp<int64_t>((256 << 10) / (4 * std::max<int64_t>(1, N)) / 32 * 32,
                                        32, 256);
  const int64_t count = (B + R - 1) / R;
  return {R, count, count >= 2 * at::get_num_threads() && !at::in_parallel_region()};
}

void lowp_rows(bool is_int8, const void* P, int64_t N, int64_t KP, const float* x, int64_t B,
               int64_t K, const float* sw, float* y) {
  if (B == 0 || N == 0) return;
  if (is_int8) {
    q8_raw(x, B, K, static_cast<const int8_t*>(P), N, KP, sw, nullptr, y, q8_best());
  } else {
    bf_raw(x, B, K, static_cast<const uint16_t*>(P), N, KP, sw, nullptr, y, bf16_level());
  }
}

// the packed weight (NBk, KP, 16, 2) of N outputs (the scales' length) and K inputs
void check_packed(const torch::Tensor& P, const torch::Tensor& scales, int64_t K,
                  torch::ScalarType t, const char* what) {
  TORCH_CHECK(P.device().is_cpu() && P.scalar_type() == t, what, ": the packed weight must be a ",
              t, " CPU tensor, got ", P.scalar_type());
  check_f32_2d(scales, "scales");
  const int64_t N = scales.numel();
  TORCH_CHECK(P.dim() == 4 && P.size(2) == kL && P.size(3) == 2 && P.size(0) == (N + kL - 1) / kL
                  && P.size(1) == (K + 1) / 2 && P.is_contiguous() && scales.is_contiguous(),
              what, ": a contiguous packed weight (ceil(N/16), ceil(K/2), 16, 2) = (",
              (N + kL - 1) / kL, ", ", (K + 1) / 2, ", 16, 2) for N = ", N,
              " (the scales' length) and K = ", K, " (x's width) expected, got ", P.sizes());
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                        int64_t impl) {
  check_f32_2d(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "q8_linear: contiguous x (B, K) expected");
  const int64_t B = x.size(0), K = x.size(1), N = scales.numel();
  check_packed(qweight, scales, K, torch::kChar, "q8_linear");
  const float* bp = bias_ptr(bias, N);
  const int lvl = pick(impl, q8_best(), "q8_linear");
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  by_row_chunks(B, N, [&](int64_t r0, int64_t rows) {
    q8_raw(xp + r0 * K, rows, K, qweight.data_ptr<int8_t>(), N, qweight.size(1),
           scales.data_ptr<float>(), bp, yp + r0 * N, lvl);
  });
  return y;
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                          int64_t impl) {
  check_f32_2d(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "bf16_linear: contiguous x (B, K) expected");
  const int64_t B = x.size(0), K = x.size(1), N = scales.numel();
  check_packed(weight, scales, K, torch::kBFloat16, "bf16_linear");
  const float* bp = bias_ptr(bias, N);
  const int lvl = pick(impl, bf16_level(), "bf16_linear");
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  by_row_chunks(B, N, [&](int64_t r0, int64_t rows) {
    bf_raw(xp + r0 * K, rows, K, reinterpret_cast<const uint16_t*>(weight.data_ptr()), N,
           weight.size(1), scales.data_ptr<float>(), bp, yp + r0 * N, lvl);
  });
  return y;
}

torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& W,
                         const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& bias) {
  if (W.scalar_type() != torch::kChar && W.scalar_type() != torch::kBFloat16)
    return torch::Tensor();
  TORCH_CHECK(scales.has_value() && scales->defined(),
              "an int8 or bfloat16 packed weight needs its scales");
  if (W.scalar_type() == torch::kChar) return q8_linear(x.contiguous(), W, *scales, bias, -1);
  return bf16_linear(x.contiguous(), W, *scales, bias, -1);
}

// ------------------------------------------------------------------------ bfloat16 outer product
// X (A, T, n, K) = w (A, T, n) ⊗ q (A, T, K) as bfloat16: each float32 product rounded to
// nearest even, as torch's float32 → bfloat16 conversion rounds (vcvtneps2bf16 also takes
// denormal products to zero, a difference below 1.2e-38). The weighted queries of the bfloat16
// cached readout (kernels/mc_chunk.py), where torch's mixed-dtype multiply runs at a third of
// its float32 rate.
namespace {

void outer_rows_scalar(const float* w, int64_t ws, int64_t n, const float* q, int64_t K,
                       uint16_t* X) {
  for (int64_t j = 0; j < n; ++j) {
    const float s = w[j * ws];
    for (int64_t k = 0; k < K; ++k) X[j * K + k] = c10::BFloat16(s * q[k]).x;
  }
}

#ifdef MCSERVE_BF16_DP
__attribute__((target(MC_AVX512 ",avx512bf16"), noinline)) void outer_rows_bf16(
    const float* w, int64_t ws, int64_t n, const float* q, int64_t K, uint16_t* X) {
  const int64_t K16 = K - K % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1u);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 s = _mm512_set1_ps(w[j * ws]);
    uint16_t* x = X + j * K;
    for (int64_t k = 0; k < K16; k += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(s, _mm512_loadu_ps(q + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + k), reinterpret_cast<const __m256i&>(h));
    }
    if (tail) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(s, _mm512_maskz_loadu_ps(tail, q + K16)));
      _mm256_mask_storeu_epi16(x + K16, tail, reinterpret_cast<const __m256i&>(h));
    }
  }
}
#endif

}  // namespace

torch::Tensor outer_bf16_(torch::Tensor X, const torch::Tensor& w, const torch::Tensor& q,
                          int64_t impl) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 3 &&
                  q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && q.dim() == 3,
              "outer_bf16_: w (A, T, n) and q (A, T, K) must be float32 CPU tensors");
  const int64_t A = w.size(0), T = w.size(1), n = w.size(2), K = q.size(2);
  TORCH_CHECK(q.size(0) == A && q.size(1) == T && q.stride(2) == 1,
              "outer_bf16_: q must be (A, T, K) with unit stride over K, got ", q.sizes(), " ",
              q.strides(), " for w ", w.sizes());
  TORCH_CHECK(X.device().is_cpu() && X.scalar_type() == torch::kBFloat16 && X.is_contiguous() &&
                  X.dim() == 4 && X.size(0) == A && X.size(1) == T && X.size(2) == n &&
                  X.size(3) == K,
              "outer_bf16_: X must be a contiguous bfloat16 (A, T, n, K) = (", A, ", ", T, ", ",
              n, ", ", K, "), got ", X.scalar_type(), " ", X.sizes());
  const int level = pick(impl, bf16_level(), "outer_bf16_");
  (void)level;  // without the BF16 build every level runs the scalar loop
  const float* wp = w.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  uint16_t* xp = reinterpret_cast<uint16_t*>(X.data_ptr<at::BFloat16>());
  const int64_t ws0 = w.stride(0), ws1 = w.stride(1), ws2 = w.stride(2);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, 2 * n * K));
  at::parallel_for(0, A * T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t a = r / T, t = r % T;
      const float* wr = wp + a * ws0 + t * ws1;
      const float* qr = qp + a * qs0 + t * qs1;
      uint16_t* xr = xp + r * n * K;
#ifdef MCSERVE_BF16_DP
      if (level >= 3) {
        outer_rows_bf16(wr, ws2, n, qr, K, xr);
        continue;
      }
#endif
      outer_rows_scalar(wr, ws2, n, qr, K, xr);
    }
  });
  return X;
}

void bind(pybind11::module& m) {
  m.def("q8_linear", &q8_linear, "x · (packed int8 weight · per-row scales)ᵀ + bias",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("impl") = -1);
  m.def("bf16_linear", &bf16_linear,
        "x · (packed bfloat16 weight · per-row scales)ᵀ + bias, float32 sums",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("scales"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("impl") = -1);
  m.def("outer_bf16_", &outer_bf16_,
        "X (A, T, n, K) bfloat16 = w (A, T, n) (x) q (A, T, K), products rounded to nearest even",
        pybind11::arg("X"), pybind11::arg("w"), pybind11::arg("q"),
        pybind11::arg("impl") = -1);
  m.def("readout_bf16_amx_", &readout_bf16_amx_,
        "o (A, T, V) += sum_j q . bf16(w[:, :, j]) bf16(S_j) on AMX tiles, float32 sums",
        pybind11::arg("o"), pybind11::arg("w"), pybind11::arg("q"), pybind11::arg("S"));
  m.def("readout_picks_bf16_amx", &readout_picks_bf16_amx,
        "y (B, L, H, V) = sum_j bf16(w_j q) S[idx_j] on AMX tiles, picks grouped by checkpoint",
        pybind11::arg("S"), pybind11::arg("q"), pybind11::arg("idx"), pybind11::arg("w"),
        pybind11::arg("out") = pybind11::none());
  m.def("key_pairs_bf16_", &key_pairs_bf16_,
        "checkpoints src (B, n, H, K, V) into dst (B, H, N, K/2, V, 2) bfloat16 at offset",
        pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("offset"));
  m.def("ckpt_pairs_bf16_", &ckpt_pairs_bf16_,
        "checkpoints src (B, n, H, K, V) into dst (B, H, K*V/16, P, 16, 2) bfloat16 at offset",
        pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("offset"));
  m.def("packed_rows", &packed_rows,
        "rows idx of a packed int8 / bfloat16 weight as float32 times their scales",
        pybind11::arg("P"), pybind11::arg("scales"), pybind11::arg("idx"), pybind11::arg("K"));
  m.def("lowp_set_cap", [](int64_t level) { set_cap(static_cast<int>(level)); },
        "highest implementation level the low-precision kernels may pick (0..4)");
  m.def("lowp_info", &info,
        "what the CPU reports, the implementations chosen and why any was dropped");
}

}  // namespace mcserve_lowp
