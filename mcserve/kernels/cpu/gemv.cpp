// The float32 matrix-vector product of mcserve's CPU decode (gemv): every linear of a decode step
// at one or two rows, and the float32 projections inside the fused blocks (blocks.cpp).
#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>

namespace mcserve_ops {

namespace {

constexpr int64_t kRows = 4;  // weight rows per block: 4 running dot products per input row

}  // namespace

// y (B, O) = x (B, I) · W (O, I)ᵀ + bias for a few rows: the weights are streamed once, in
// blocks of kRows rows that stay in L1 while every input row uses them, each weight row read
// front to back (one sequential stream: tiles that read several weight rows side by side
// measured slower from DRAM).
//
// With AVX2 + FMA (an x86-64-v3, x86-64-v4 or native build on such a CPU) each weight row is
// multiplied with the input rows two at a time, each product in two independent 8-float
// accumulators (explicit intrinsics). gcc's auto-vectorised reduction (`dot` in common.h, the
// fallback for other builds) keeps a single accumulator: one FMA chain, which at 8 floats per FMA
// latency bounds a dot product below what the memory delivers on AVX2 CPUs whose FMA is slow
// relative to their bandwidth. In L2, one thread (a 128 × 768 weight on a Zen 4 EPYC), this path is
// 2.2× (one row) and 4.7× (two rows) the auto-vectorised one of an x86-64-v3 build, and 1.3× and
// 1.5× even the 16-float chain of the AVX-512 build (docs/cpu-kernels.md).

#if defined(__AVX2__) && defined(__FMA__)
#define MCSERVE_AVX2_FMA 1
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[b·ys] = w · x_b for one weight row w and NB input rows x (row stride xs): 2·NB accumulators
template <int NB>
inline void dot_rows(const float* __restrict w, int64_t I, const float* __restrict x, int64_t xs,
                     float* __restrict y, int64_t ys) {
  __m256 a0[NB], a1[NB];
  for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int b = 0; b < NB; ++b) {
      a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * xs + i), a0[b]);
      a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * xs + i + 8), a1[b]);
    }
  }
  if (i + 8 <= I) {
    const __m256 w0 = _mm256_loadu_ps(w + i);
    for (int b = 0; b < NB; ++b) a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * xs + i), a0[b]);
    i += 8;
  }
  for (int b = 0; b < NB; ++b) {
    float s = hsum8(_mm256_add_ps(a0[b], a1[b]));
    for (int64_t j = i; j < I; ++j) s += w[j] * x[b * xs + j];
    y[b * ys] = s;
  }
}
#endif

// rows o0 .. o0 + n of y for every input row
inline void gemv_block(const float* xp, const float* wp, float* yp, int64_t B, int64_t I,
                       int64_t O, int64_t o0, int64_t n) {
#ifdef MCSERVE_AVX2_FMA
  for (int64_t o = o0; o < o0 + n; ++o) {
    int64_t r = 0;
    for (; r + 2 <= B; r += 2) dot_rows<2>(wp + o * I, I, xp + r * I, I, yp + r * O + o, O);
    if (r < B) dot_rows<1>(wp + o * I, I, xp + r * I, I, yp + r * O + o, O);
  }
#else
  for (int64_t r = 0; r < B; ++r) {
    const float* xr = xp + r * I;
    for (int64_t o = o0; o < o0 + n; ++o) yp[r * O + o] = dot(wp + o * I, xr, I);
  }
#endif
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W,
                   const c10::optional<torch::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(W, "weight");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 && x.size(1) == W.size(1),
              "gemv: x (B, I) and weight (O, I) expected, got ", x.sizes(), " and ", W.sizes());
  TORCH_CHECK(x.is_contiguous() && W.is_contiguous(), "gemv: contiguous x and weight expected");
  const int64_t B = x.size(0), I = x.size(1), O = W.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == O && bias->is_contiguous(), "gemv: bias (O,) expected");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({B, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = W.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (O + kRows - 1) / kRows;
  // at least 64 KiB of weights per thread: below that threads cost more than they save
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I * kRows));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o0 = blk * kRows;
      gemv_block(xp, wp, yp, B, I, O, o0, std::min(kRows, O - o0));
    }
  });
  if (bp) y += bias.value();
  return y;
}

}  // namespace mcserve_ops
