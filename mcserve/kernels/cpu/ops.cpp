// Single-token (decode) CPU kernels for mcserve, built on first use by
// torch.utils.cpp_extension (see __init__.py). Every op has a torch twin with the same
// signature in twins.py; tests/test_cpu_kernels.py compares them.
//
// Why C++: a decode step on CPU is dominated by (a) matrix-vector products, where torch's GEMM
// streams the weights at a third of this machine's bandwidth, and (b) hundreds of tiny tensor
// ops of a few microseconds of dispatch each. Each op here is one pass over its data.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "lowp.h"
#include "sampling.h"

#include <sys/mman.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // weight rows per block: 4 running dot products per input row

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ",
              t.scalar_type());
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

}  // namespace

// y (B, O) = x (B, I) · W (O, I)ᵀ + bias for a few rows: the weights are streamed once, in
// blocks of kRows rows that stay in L1 while every input row uses them, each weight row read
// front to back (one sequential stream: tiles that read several weight rows side by side
// measured slower from DRAM).
//
// With AVX2 + FMA (an x86-64-v3, x86-64-v4 or native build on such a CPU) each weight row is
// multiplied with the input rows two at a time, each product in two independent 8-float
// accumulators (explicit intrinsics). gcc's auto-vectorised reduction (`dot`, the fallback for
// other builds) keeps a single accumulator: one FMA chain, which at 8 floats per FMA latency
// bounds a dot product below what the memory delivers on AVX2 CPUs whose FMA is slow relative
// to their bandwidth. In L2, one thread (a 128 × 768 weight on a Zen 4 EPYC), this path is
// 2.2× (one row) and 4.7× (two rows) the auto-vectorised one of an x86-64-v3 build, and 1.3× and
// 1.5× even the 16-float chain of the AVX-512 build (docs/cpu-kernels.md).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

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

// One token of gated linear attention, in place: S ← a·S + (b·k) vᵀ, returns o = Sᵀ q.
// S (B, H, K, V) with (K, V) contiguous (rows may be a strided view of a slot pool);
// q, k (B, H, K) and v (B, H, V) any strides (broadcast views are fine); log_a, b (B, H) or
// undefined (no decay / no write gate). One pass over S.
torch::Tensor linear_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                           const c10::optional<torch::Tensor>& b) {
  check_f32(S, "S");
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(S.dim() == 4, "linear_step_: S (B, H, K, V) expected, got ", S.sizes());
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), V = S.size(3);
  TORCH_CHECK(S.stride(3) == 1 && S.stride(2) == V, "linear_step_: S needs contiguous (K, V)");
  TORCH_CHECK(q.sizes() == torch::IntArrayRef({B, H, K}) &&
                  k.sizes() == torch::IntArrayRef({B, H, K}) &&
                  v.sizes() == torch::IntArrayRef({B, H, V}),
              "linear_step_: q, k (B, H, K) and v (B, H, V) expected");
  const bool has_a = log_a.has_value() && log_a->defined();
  const bool has_b = b.has_value() && b->defined();
  if (has_a) {
    check_f32(*log_a, "log_a");
    TORCH_CHECK(log_a->sizes() == torch::IntArrayRef({B, H}), "log_a (B, H) expected");
  }
  if (has_b) {
    check_f32(*b, "b");
    TORCH_CHECK(b->sizes() == torch::IntArrayRef({B, H}), "b (B, H) expected");
  }
  auto o = torch::empty({B, H, V}, S.options());
  float* Sp = S.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* ap = has_a ? log_a->data_ptr<float>() : nullptr;
  const float* bp = has_b ? b->data_ptr<float>() : nullptr;
  const int64_t sS0 = S.stride(0), sS1 = S.stride(1);
  const int64_t q0 = q.stride(0), q1 = q.stride(1), q2 = q.stride(2);
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t a0 = has_a ? log_a->stride(0) : 0, a1 = has_a ? log_a->stride(1) : 0;
  const int64_t g0 = has_b ? b->stride(0) : 0, g1 = has_b ? b->stride(1) : 0;
  float* op = o.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * V));
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> vv(V);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      float* s = Sp + bi * sS0 + h * sS1;
      const float a = has_a ? std::exp(ap[bi * a0 + h * a1]) : 1.f;
      const float w = has_b ? bp[bi * g0 + h * g1] : 1.f;
      const float* qr = qp + bi * q0 + h * q1;
      const float* kr = kp + bi * k0 + h * k1;
      const float* vr = vp + bi * v0 + h * v1;
      for (int64_t j = 0; j < V; ++j) vv[j] = vr[j * v2];
      float* out = op + i * V;
      for (int64_t j = 0; j < V; ++j) out[j] = 0.f;
      const float* vvp = vv.data();
      for (int64_t r = 0; r < K; ++r) {
        const float kw = kr[r * k2] * w, qv = qr[r * q2];
        float* row = s + r * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          const float x = a * row[j] + kw * vvp[j];
          row[j] = x;
          out[j] += qv * x;
        }
      }
    }
  });
  return o;
}

// A span of T tokens of gated linear attention, token after token (the arithmetic of
// linear_step_): from S0 (B, H, K, V) (not modified); q, k (B, T, H, K), v (B, T, H, V), log_a
// and b (B, T, H) or absent, any strides. Returns o (B, T, H, V) and the final state. Each
// (row, head) keeps its state in this thread's cache for the whole span, which beats the
// chunked form's products at any length on the CPU.
std::vector<torch::Tensor> linear_scan(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v,
                                       const c10::optional<torch::Tensor>& log_a,
                                       const c10::optional<torch::Tensor>& b,
                                       const torch::Tensor& S0) {
  check_f32(S0, "initial_state");
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(S0.dim() == 4, "linear_scan: initial_state (B, H, K, V) expected, got ",
              S0.sizes());
  const int64_t B = S0.size(0), H = S0.size(1), K = S0.size(2), V = S0.size(3);
  TORCH_CHECK(q.dim() == 4, "linear_scan: q (B, T, H, K) expected, got ", q.sizes());
  const int64_t T = q.size(1);
  TORCH_CHECK(q.sizes() == torch::IntArrayRef({B, T, H, K}) &&
                  k.sizes() == torch::IntArrayRef({B, T, H, K}) &&
                  v.sizes() == torch::IntArrayRef({B, T, H, V}),
              "linear_scan: q, k (B, T, H, K) and v (B, T, H, V) expected");
  const bool has_a = log_a.has_value() && log_a->defined();
  const bool has_b = b.has_value() && b->defined();
  if (has_a) {
    check_f32(*log_a, "log_a");
    TORCH_CHECK(log_a->sizes() == torch::IntArrayRef({B, T, H}), "log_a (B, T, H) expected");
  }
  if (has_b) {
    check_f32(*b, "b");
    TORCH_CHECK(b->sizes() == torch::IntArrayRef({B, T, H}), "b (B, T, H) expected");
  }
  auto S = torch::empty({B, H, K, V}, S0.options());
  auto o = torch::empty({B, T, H, V}, S0.options());
  float* Sp = S.data_ptr<float>();
  const float* S0p = S0.data_ptr<float>();
  const auto s0s = S0.strides();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* ap = has_a ? log_a->data_ptr<float>() : nullptr;
  const float* bp = has_b ? b->data_ptr<float>() : nullptr;
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const int64_t a0 = has_a ? log_a->stride(0) : 0, a1 = has_a ? log_a->stride(1) : 0,
                a2 = has_a ? log_a->stride(2) : 0;
  const int64_t g0 = has_b ? b->stride(0) : 0, g1 = has_b ? b->stride(1) : 0,
                g2 = has_b ? b->stride(2) : 0;
  float* op = o.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> vv(V);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      float* s = Sp + i * K * V;
      const float* init = S0p + bi * s0s[0] + h * s0s[1];
      for (int64_t r = 0; r < K; ++r)
        for (int64_t j = 0; j < V; ++j) s[r * V + j] = init[r * s0s[2] + j * s0s[3]];
      for (int64_t t = 0; t < T; ++t) {
        const float a = has_a ? std::exp(ap[bi * a0 + t * a1 + h * a2]) : 1.f;
        const float w = has_b ? bp[bi * g0 + t * g1 + h * g2] : 1.f;
        const float* qr = qp + bi * qs[0] + t * qs[1] + h * qs[2];
        const float* kr = kp + bi * ks[0] + t * ks[1] + h * ks[2];
        const float* vr = vp + bi * vs[0] + t * vs[1] + h * vs[2];
        for (int64_t j = 0; j < V; ++j) vv[j] = vr[j * vs[3]];
        float* out = op + ((bi * T + t) * H + h) * V;
        for (int64_t j = 0; j < V; ++j) out[j] = 0.f;
        const float* vvp = vv.data();
        for (int64_t r = 0; r < K; ++r) {
          const float kw = kr[r * ks[3]] * w, qv = qr[r * qs[3]];
          float* row = s + r * V;
          // explicit fused multiply-adds: the vector body and any scalar peel or remainder
          // round alike, so a row's result does not depend on its alignment in the batch
#pragma omp simd
          for (int64_t j = 0; j < V; ++j) {
            const float x = std::fma(a, row[j], kw * vvp[j]);
            row[j] = x;
            out[j] = std::fma(qv, x, out[j]);
          }
        }
      }
    }
  });
  return {o, S};
}

namespace {

// A (B, H, N) float32 input read through its strides (broadcast and pool views are fine), or
// absent (an undefined optional).
struct Rows {
  const float* p = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;

  Rows() = default;
  Rows(const torch::Tensor& t, int64_t B, int64_t H, int64_t N, const char* op,
       const char* name) {
    check_f32(t, name);
    TORCH_CHECK(t.sizes() == torch::IntArrayRef({B, H, N}), op, ": ", name, " (", B, ", ", H,
                ", ", N, ") expected, got ", t.sizes());
    p = t.data_ptr<float>();
    s0 = t.stride(0);
    s1 = t.stride(1);
    s2 = t.stride(2);
  }
  Rows(const c10::optional<torch::Tensor>& t, int64_t B, int64_t H, int64_t N, const char* op,
       const char* name) {
    if (t.has_value() && t->defined()) *this = Rows(*t, B, H, N, op, name);
  }
  bool has() const { return p != nullptr; }
  // the n entries of (b, h) gathered into dst (unit stride for the vectorised loops)
  void load(int64_t b, int64_t h, int64_t n, float* dst) const {
    const float* r = p + b * s0 + h * s1;
    for (int64_t i = 0; i < n; ++i) dst[i] = r[i * s2];
  }
};

// A (B, H) float32 scalar per row and head, or absent.
struct PerHead {
  const float* p = nullptr;
  int64_t s0 = 0, s1 = 0;

  PerHead(const c10::optional<torch::Tensor>& t, int64_t B, int64_t H, const char* op,
          const char* name) {
    if (!t.has_value() || !t->defined()) return;
    check_f32(*t, name);
    TORCH_CHECK(t->sizes() == torch::IntArrayRef({B, H}), op, ": ", name, " (", B, ", ", H,
                ") expected, got ", t->sizes());
    p = t->data_ptr<float>();
    s0 = t->stride(0);
    s1 = t->stride(1);
  }
  bool has() const { return p != nullptr; }
  float at(int64_t b, int64_t h, float absent) const {
    return p ? p[b * s0 + h * s1] : absent;
  }
};

// S (B, H, K, V) float32 with each head's (K, V) block contiguous (rows may be a strided view
// of the engine's slot pool, updated where they live).
void check_state(const torch::Tensor& S, const char* op) {
  check_f32(S, "S");
  TORCH_CHECK(S.dim() == 4, op, ": S (B, H, K, V) expected, got ", S.sizes());
  TORCH_CHECK(S.stride(3) == 1 && S.stride(2) == S.size(3), op, ": S needs contiguous (K, V)");
}

// (row, head) pairs per parallel task: at least 64 KiB of state each, as linear_step_
int64_t state_grain(int64_t K, int64_t V) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * V));
}

}  // namespace

// One token of the (gated) delta rule, in place:
//   S ← α·(S − β k (kᵀS)) + β k vᵀ = α·S + k uᵀ with u = β (v − α Sᵀk),  o = Sᵀq.
// S (B, H, K, V); q, k (B, H, K); v (B, H, V); log_a (log α) and beta (B, H) or undefined
// (no decay / β = 1). Two passes per head, both over the same (K, V) block while it is in
// cache: Sᵀk first (u needs all of it before any row changes), then update + readout.
torch::Tensor delta_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                          const c10::optional<torch::Tensor>& beta) {
  const char* op = "delta_step_";
  check_state(S, op);
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), V = S.size(3);
  const Rows qr(q, B, H, K, op, "q"), kr(k, B, H, K, op, "k"), vr(v, B, H, V, op, "v");
  const PerHead ar(log_a, B, H, op, "log_a"), br(beta, B, H, op, "beta");
  auto o = torch::empty({B, H, V}, S.options());
  float* Sp = S.data_ptr<float>();
  float* op_ = o.data_ptr<float>();
  const int64_t sS0 = S.stride(0), sS1 = S.stride(1);
  at::parallel_for(0, B * H, state_grain(K, V), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * K + 2 * V);
    float *qv = buf.data(), *kv = qv + K, *vv = kv + K, *u = vv + V;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      float* s = Sp + bi * sS0 + h * sS1;
      qr.load(bi, h, K, qv);
      kr.load(bi, h, K, kv);
      vr.load(bi, h, V, vv);
      const float alpha = ar.has() ? std::exp(ar.at(bi, h, 0.f)) : 1.f;
      const float bt = br.at(bi, h, 1.f);
      for (int64_t j = 0; j < V; ++j) u[j] = 0.f;
      for (int64_t r = 0; r < K; ++r) {  // u = Sᵀk
        const float kc = kv[r];
        const float* row = s + r * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) u[j] += kc * row[j];
      }
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) u[j] = bt * (vv[j] - alpha * u[j]);
      float* out = op_ + i * V;
      for (int64_t j = 0; j < V; ++j) out[j] = 0.f;
      for (int64_t r = 0; r < K; ++r) {
        const float kc = kv[r], qc = qv[r];
        float* row = s + r * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          const float x = alpha * row[j] + kc * u[j];
          row[j] = x;
          out[j] += qc * x;
        }
      }
    }
  });
  return o;
}

// One token of RWKV-7's generalised delta rule, in place, keys on the rows of S:
//   S ← diag(w)·S + b (aᵀS) + k vᵀ,  o = Sᵀr,   w = exp(log_w).
// S (B, H, K, V); r, k, a, b, log_w (B, H, K); v (B, H, V). Two passes per head over the same
// (K, V) block: aᵀS first (every row's update reads all of it), then update + readout.
torch::Tensor rwkv7_step_(torch::Tensor S, const torch::Tensor& r, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& a, const torch::Tensor& b,
                          const torch::Tensor& log_w) {
  const char* op = "rwkv7_step_";
  check_state(S, op);
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), V = S.size(3);
  const Rows rr(r, B, H, K, op, "r"), kr(k, B, H, K, op, "k"), vr(v, B, H, V, op, "v"),
      ar(a, B, H, K, op, "a"), br(b, B, H, K, op, "b"), wr(log_w, B, H, K, op, "log_w");
  auto o = torch::empty({B, H, V}, S.options());
  float* Sp = S.data_ptr<float>();
  float* op_ = o.data_ptr<float>();
  const int64_t sS0 = S.stride(0), sS1 = S.stride(1);
  at::parallel_for(0, B * H, state_grain(K, V), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(5 * K + 2 * V);
    float *rv = buf.data(), *kv = rv + K, *av = kv + K, *bv = av + K, *wv = bv + K;
    float *vv = wv + K, *sa = vv + V;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      float* s = Sp + bi * sS0 + h * sS1;
      rr.load(bi, h, K, rv);
      kr.load(bi, h, K, kv);
      ar.load(bi, h, K, av);
      br.load(bi, h, K, bv);
      wr.load(bi, h, K, wv);
      vr.load(bi, h, V, vv);
      for (int64_t c = 0; c < K; ++c) wv[c] = std::exp(wv[c]);
      for (int64_t j = 0; j < V; ++j) sa[j] = 0.f;
      for (int64_t c = 0; c < K; ++c) {  // sa = aᵀS
        const float ac = av[c];
        const float* row = s + c * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) sa[j] += ac * row[j];
      }
      float* out = op_ + i * V;
      for (int64_t j = 0; j < V; ++j) out[j] = 0.f;
      for (int64_t c = 0; c < K; ++c) {
        const float wc = wv[c], bc = bv[c], kc = kv[c], rc = rv[c];
        float* row = s + c * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          const float x = wc * row[j] + bc * sa[j] + kc * vv[j];
          row[j] = x;
          out[j] += rc * x;
        }
      }
    }
  });
  return o;
}

// One token of vector-gated linear attention (GLA, Mamba1), in place, one pass over S:
//   S ← diag(exp(log_a))·S + (b·k) vᵀ,  o = Sᵀq.
// S (B, H, K, V); q, k, log_a (B, H, K) (log_a undefined: no decay); v (B, H, V); b (B, H) or
// undefined (unit write).
torch::Tensor gla_vec_step_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                            const c10::optional<torch::Tensor>& b) {
  const char* op = "gla_vec_step_";
  check_state(S, op);
  const int64_t B = S.size(0), H = S.size(1), K = S.size(2), V = S.size(3);
  const Rows qr(q, B, H, K, op, "q"), kr(k, B, H, K, op, "k"), vr(v, B, H, V, op, "v"),
      ar(log_a, B, H, K, op, "log_a");
  const PerHead br(b, B, H, op, "b");
  auto o = torch::empty({B, H, V}, S.options());
  float* Sp = S.data_ptr<float>();
  float* op_ = o.data_ptr<float>();
  const int64_t sS0 = S.stride(0), sS1 = S.stride(1);
  at::parallel_for(0, B * H, state_grain(K, V), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(3 * K + V);
    float *qv = buf.data(), *kv = qv + K, *av = kv + K, *vv = av + K;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bi = i / H, h = i % H;
      float* s = Sp + bi * sS0 + h * sS1;
      qr.load(bi, h, K, qv);
      kr.load(bi, h, K, kv);
      vr.load(bi, h, V, vv);
      if (ar.has()) {
        ar.load(bi, h, K, av);
        for (int64_t c = 0; c < K; ++c) av[c] = std::exp(av[c]);
      } else {
        for (int64_t c = 0; c < K; ++c) av[c] = 1.f;
      }
      const float w = br.at(bi, h, 1.f);
      float* out = op_ + i * V;
      for (int64_t j = 0; j < V; ++j) out[j] = 0.f;
      for (int64_t c = 0; c < K; ++c) {
        const float dc = av[c], kc = kv[c] * w, qc = qv[c];
        float* row = s + c * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          const float x = dc * row[j] + kc * vv[j];
          row[j] = x;
          out[j] += qc * x;
        }
      }
    }
  });
  return o;
}

// out[0:V] = Σ_m wts[m] · blocks[m]ᵀ q for nb blocks of (K, V) floats each (row stride V); the
// output columns are held in registers (chunks of 64) across every block and row.
inline void readout_row(const float* const* blocks, const float* wts, int64_t nb,
                        const float* qv, int64_t K, int64_t V, float* out) {
  constexpr int64_t kChunk = 64;
  int64_t j0 = 0;
  for (; j0 + kChunk <= V; j0 += kChunk) {
    float acc[kChunk] = {};
    for (int64_t m = 0; m < nb; ++m) {
      const float* s = blocks[m] + j0;
      const float wt = wts[m];
      for (int64_t c = 0; c < K; ++c) {
        const float f = wt * qv[c];
        const float* row = s + c * V;
#pragma omp simd
        for (int64_t j = 0; j < kChunk; ++j) acc[j] += f * row[j];
      }
    }
    for (int64_t j = 0; j < kChunk; ++j) out[j0 + j] += acc[j];
  }
  for (int64_t m = 0; m < nb && j0 < V; ++m) {  // the columns past the last full chunk
    for (int64_t c = 0; c < K; ++c) {
      const float f = wts[m] * qv[c];
      const float* row = blocks[m] + c * V;
      for (int64_t j = j0; j < V; ++j) out[j] += f * row[j];
    }
  }
}

// Σ_n w[b, n, h] · S[ids[b, n, h], h]ᵀ q[b, h] read from the block pool in place.
// pool (NB, H, K, V) contiguous, ids (B, n, H) int64, q (B, H, K), w (B, n, H) → (B, H, V).
// One decode query per row against that row's keys and values in a paged pool (a hybrid
// model's attention layer): q (B, H, D); k_pool, v_pool (NB, BS, Hkv, D) contiguous; tables
// (B, N) block ids (-1 pads); lengths (B,) tokens of each row. Grouped-query heads (head h reads
// KV head h / (H / Hkv)); one pass over the blocks in place with an online softmax in float32.
// Rows past a row's length are never read. → (B, H, D). Twin: kernels/attention.py's
// naive_paged_decode (the blocks gathered, the scores written out).
torch::Tensor paged_attention_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
                                     const torch::Tensor& v_pool, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, double scale) {
  check_f32(q, "q");
  check_f32(k_pool, "k_pool");
  check_f32(v_pool, "v_pool");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes(),
              "paged_attention_decode: contiguous k_pool, v_pool (NB, BS, Hkv, D) expected");
  const int64_t NB = k_pool.size(0), BS = k_pool.size(1), Hkv = k_pool.size(2),
                D = k_pool.size(3);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && q.size(1) % Hkv == 0,
              "paged_attention_decode: q (B, H, D) with H a multiple of Hkv expected");
  const int64_t B = q.size(0), H = q.size(1), rep = H / Hkv;
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 && tables.size(0) == B,
              "paged_attention_decode: tables (B, N) int64 expected");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.numel() == B,
              "paged_attention_decode: lengths (B,) int64 expected");
  const int64_t N = tables.size(1);
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto lc = lengths.contiguous();
  auto y = torch::zeros({B, H, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *Kp = k_pool.data_ptr<float>(),
              *Vp = v_pool.data_ptr<float>();
  const int64_t *tp = tc.data_ptr<int64_t>(), *lp = lc.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  bool bad = false;
  // Split-K (flash-decoding): a task is a run of up to kRun blocks of one row, all heads; it reads
  // each token's keys (then values) of every KV head as one contiguous row, scores a block at a
  // time (vectorised dot products), rescales its running sums once per block and head (online
  // softmax) and leaves a partial (max, sum, accumulator) per head; the partials of a row are
  // merged after. Long rows thus spread over the threads even at batch 1.
  constexpr int64_t kRun = 32;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= N * BS,
                "paged_attention_decode: a length is outside the row's table");
  std::vector<int64_t> first(B + 1, 0);  // the row's first task
  for (int64_t b = 0; b < B; ++b)
    first[b + 1] = first[b] + ((lp[b] + BS - 1) / BS + kRun - 1) / kRun;
  const int64_t T = first[B], W = D + 2;  // per head: max, sum, accumulator
  std::vector<float> part(T * H * W);
  const int64_t ts = Hkv * D;  // floats from one token's row to the next token's
  at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> sco(H * BS);
    for (int64_t task = r0; task < r1; ++task) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const int64_t L = lp[b], blk0 = (task - first[b]) * kRun;
      const int64_t blk1 = std::min((L + BS - 1) / BS, blk0 + kRun);
      const float* qv = qp + b * H * D;
      float* pt = part.data() + task * H * W;
      for (int64_t h = 0; h < H; ++h) {
        pt[h * W] = -std::numeric_limits<float>::infinity();
        std::fill(pt + h * W + 1, pt + (h + 1) * W, 0.f);
      }
      for (int64_t bi = blk0; bi < blk1; ++bi) {
        const int64_t blk = tp[b * N + bi];
        if (blk < 0 || blk >= NB) { bad = true; break; }
        const int64_t n = std::min(BS, L - bi * BS);
        const float* kb = Kp + blk * BS * ts;
        const float* vb = Vp + blk * BS * ts;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < H; ++h)
            sco[h * BS + i] = dot(qv + h * D, kb + i * ts + (h / rep) * D, D) * sc;
        for (int64_t h = 0; h < H; ++h) {
          const float* sh = sco.data() + h * BS;
          float* ph = pt + h * W;  // max, sum, accumulator
          float* ah = ph + 2;
          float bm = sh[0];
          for (int64_t i = 1; i < n; ++i) bm = std::max(bm, sh[i]);
          if (bm > ph[0]) {
            const float corr = std::exp(ph[0] - bm);
            ph[1] *= corr;
            for (int64_t c = 0; c < D; ++c) ah[c] *= corr;
            ph[0] = bm;
          }
          for (int64_t i = 0; i < n; ++i) {
            const float p = std::exp(sh[i] - ph[0]);
            ph[1] += p;
            const float* vr = vb + i * ts + (h / rep) * D;
#pragma omp simd
            for (int64_t c = 0; c < D; ++c) ah[c] += p * vr[c];
          }
        }
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t t = first[b]; t < first[b + 1]; ++t) M = std::max(M, part[(t * H + h) * W]);
      float* out = yp + (b * H + h) * D;
      float S = 0.f;
      for (int64_t t = first[b]; t < first[b + 1]; ++t) {
        const float* ph = part.data() + (t * H + h) * W;
        const float w = std::exp(ph[0] - M);
        S += w * ph[1];
        for (int64_t c = 0; c < D; ++c) out[c] += w * ph[2 + c];
      }
      for (int64_t c = 0; c < D; ++c) out[c] /= S;
    }
  }
  TORCH_CHECK(!bad, "paged_attention_decode: a length or block id is outside the pool");
  return y;
}

torch::Tensor readout_paged(const torch::Tensor& pool, const torch::Tensor& ids,
                            const torch::Tensor& q, const torch::Tensor& w) {
  check_f32(pool, "pool");
  check_f32(q, "q");
  check_f32(w, "w");
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "readout_paged: contiguous pool expected");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 3, "ids (B, n, H) int64");
  const int64_t NB = pool.size(0), H = pool.size(1), K = pool.size(2), V = pool.size(3);
  const int64_t B = ids.size(0), n = ids.size(1);
  TORCH_CHECK(ids.size(2) == H && q.sizes() == torch::IntArrayRef({B, H, K}) &&
                  w.sizes() == torch::IntArrayRef({B, n, H}),
              "readout_paged: ids (B, n, H), q (B, H, K), w (B, n, H) expected");
  auto y = torch::zeros({B, H, V}, pool.options());
  const float* P = pool.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t i0s = ids.stride(0), i1s = ids.stride(1), i2s = ids.stride(2);
  const int64_t q0 = q.stride(0), q1 = q.stride(1), q2 = q.stride(2);
  const int64_t w0 = w.stride(0), w1 = w.stride(1), w2 = w.stride(2);
  float* yp = y.data_ptr<float>();
  bool bad = false;
  at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> qv(K);
    std::vector<const float*> blocks(n);
    std::vector<float> wts(n);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / H, h = r % H;
      for (int64_t c = 0; c < K; ++c) qv[c] = qp[bi * q0 + h * q1 + c * q2];
      int64_t nb = 0;
      for (int64_t m = 0; m < n; ++m) {
        const int64_t id = ip[bi * i0s + m * i1s + h * i2s];
        if (id < 0 || id >= NB) { bad = true; continue; }
        const float wt = wp[bi * w0 + m * w1 + h * w2];
        if (wt == 0.f) continue;
        blocks[nb] = P + (id * H + h) * K * V;
        wts[nb++] = wt;
      }
      readout_row(blocks.data(), wts.data(), nb, qv.data(), K, V, yp + r * V);
    }
  });
  TORCH_CHECK(!bad, "readout_paged: a block id is outside the pool");
  return y;
}

// Indices of the k largest entries of each row of r (R, N), largest first; among equal values
// the later index ranks first (the most recent checkpoint). One pass per row keeps the k best in
// a small sorted list: a new entry only has to beat the list's last (worst) one, so a row costs
// about N comparisons. → (R, k) int64.
torch::Tensor topk_later(const torch::Tensor& r, int64_t k) {
  check_f32(r, "r");
  TORCH_CHECK(r.dim() == 2 && r.stride(1) == 1, "topk_later: r (R, N) with unit column stride");
  const int64_t R = r.size(0), N = r.size(1), rs = r.stride(0);
  TORCH_CHECK(k >= 1 && k <= N, "topk_later: k must be in [1, N], got k=", k, ", N=", N);
  auto idx = torch::empty({R, k}, r.options().dtype(torch::kInt64));
  const float* rp = r.data_ptr<float>();
  int64_t* op = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> bv(k);
    std::vector<int64_t> bi(k);
    for (int64_t row = r0; row < r1; ++row) {
      const float* x = rp + row * rs;
      int64_t m = 0;
      for (int64_t n = 0; n < N; ++n) {
        const float v = x[n];
        if (m == k && !(v >= bv[k - 1])) continue;  // not better than the worst kept
        // position: before every kept entry with a value <= v (n is later than all of them)
        int64_t p = m < k ? m : k - 1;
        while (p > 0 && bv[p - 1] <= v) {
          bv[p] = bv[p - 1];
          bi[p] = bi[p - 1];
          --p;
        }
        bv[p] = v;
        bi[p] = n;
        if (m < k) ++m;
      }
      std::copy(bi.begin(), bi.end(), op + row * k);
    }
  });
  return idx;
}

// Depthwise causal conv of one token, in place on the tail: out = act(Σ_j w[:, j]·window_j + bias)
// where window = [tail (B, W-1, C); x (B, C)]; the tail then shifts by one (x enters last).
// weight (C, W); act: silu when `silu`, else identity. Returns out (B, C).
torch::Tensor conv_step_(torch::Tensor tail, const torch::Tensor& x, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias, bool apply_silu) {
  check_f32(tail, "conv tail");
  check_f32(x, "x");
  check_f32(weight, "conv weight");
  TORCH_CHECK(tail.dim() == 3 && x.dim() == 2 && weight.dim() == 2, "conv_step_: shapes");
  const int64_t B = tail.size(0), Wm1 = tail.size(1), C = tail.size(2);
  TORCH_CHECK(weight.size(0) == C && weight.size(1) == Wm1 + 1 && x.size(0) == B &&
                  x.size(1) == C,
              "conv_step_: tail (B, W-1, C), x (B, C), weight (C, W) expected");
  TORCH_CHECK(tail.stride(2) == 1 && x.stride(1) == 1, "conv_step_: channels must be contiguous");
  // the weight read through its strides: a (C, W) one is walked row by row, W taps a channel
  // (transposing it to unit stride over channels was a copy per call, most of the op's time)
  const int64_t w0 = weight.stride(0), w1 = weight.stride(1);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32(*bias, "conv bias");
    TORCH_CHECK(bias->numel() == C && bias->is_contiguous(), "conv bias (C,) expected");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({B, C}, x.options());
  float* tp = tail.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t t0 = tail.stride(0), t1 = tail.stride(1), xs0 = x.stride(0);
  for (int64_t bi = 0; bi < B; ++bi) {
    float* tb = tp + bi * t0;
    const float* xb = xp + bi * xs0;
    float* ob = op + bi * C;
    for (int64_t c = 0; c < C; ++c) {
      const float* wc = wp + c * w0;
      float acc = (bp ? bp[c] : 0.f) + wc[Wm1 * w1] * xb[c];
      for (int64_t j = 0; j < Wm1; ++j) acc += wc[j * w1] * tb[j * t1 + c];
      ob[c] = acc;
    }
    for (int64_t j = 0; j + 1 < Wm1; ++j) {
      float* dst = tb + j * t1;
      const float* src = tb + (j + 1) * t1;
      for (int64_t c = 0; c < C; ++c) dst[c] = src[c];
    }
    if (Wm1 > 0) {
      float* last = tb + (Wm1 - 1) * t1;
      for (int64_t c = 0; c < C; ++c) last[c] = xb[c];
    }
    if (apply_silu) {
      for (int64_t c = 0; c < C; ++c) ob[c] = silu(ob[c]);
    }
  }
  return out;
}

// RMSNorm over groups of `group` channels of x (R, D): y = w · h / rms(h), where h = x, or
// x · silu(z) when z is given and !norm_before_gate (Mamba2's gated norm); with z and
// norm_before_gate the gate multiplies after the norm. w has D or `group` entries (the latter:
// the same weights for every group, as mcserve's per-head output norm).
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                       double eps, int64_t group, const c10::optional<torch::Tensor>& z,
                       bool norm_before_gate) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x (R, D) with unit stride expected");
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(group > 0 && D % group == 0, "rms_norm: group must divide ", D, ", got ", group);
  const float* wp = nullptr;
  bool w_full = false;
  if (weight.has_value() && weight->defined()) {
    check_f32(*weight, "weight");
    TORCH_CHECK(weight->is_contiguous() && (weight->numel() == D || weight->numel() == group),
                "rms_norm: weight of ", D, " or ", group, " entries expected");
    wp = weight->data_ptr<float>();
    w_full = weight->numel() == D;
  }
  const float* zp = nullptr;
  int64_t zs = 0;
  if (z.has_value() && z->defined()) {
    check_f32(*z, "z");
    TORCH_CHECK(z->dim() == 2 && z->size(0) == R && z->size(1) == D && z->stride(1) == 1,
                "rms_norm: z like x expected");
    zp = z->data_ptr<float>();
    zs = z->stride(0);
  }
  auto y = torch::empty({R, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  std::vector<float> h(group);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      const float* xr = xp + r * xs + g0;
      const float* zr = zp ? zp + r * zs + g0 : nullptr;
      float ss = 0.f;
      for (int64_t c = 0; c < group; ++c) {
        float v = xr[c];
        if (zr && !norm_before_gate) v *= silu(zr[c]);
        h[c] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(group) + static_cast<float>(eps));
      float* yr = yp + r * D + g0;
      for (int64_t c = 0; c < group; ++c) {
        float v = h[c] * inv;
        if (wp) v *= wp[w_full ? g0 + c : c];
        if (zr && norm_before_gate) v *= silu(zr[c]);
        yr[c] = v;
      }
    }
  }
  return y;
}

// MC routing scores of one token (grm/ssc on a linear memory), with the segment's key sum
// advanced in place: seg_ksum (B, H, K) += k. Returns r (B, N + 1, H): r[:, n] = ⟨u, ksum of
// block table[b, n]⟩ / (C·√K) (−inf where table < 0), r[:, N] = ⟨u, seg_ksum / (seg_len + 1)⟩/√K.
torch::Tensor mc_scores_(torch::Tensor seg_ksum, const torch::Tensor& k, const torch::Tensor& u,
                         const torch::Tensor& seg_len, const torch::Tensor& ksum_pool,
                         const torch::Tensor& table, int64_t segment_len) {
  check_f32(seg_ksum, "seg_ksum");
  check_f32(k, "k");
  check_f32(u, "u");
  check_f32(ksum_pool, "ksum_pool");
  TORCH_CHECK(seg_ksum.dim() == 3 && seg_ksum.stride(2) == 1, "seg_ksum (B, H, K) expected");
  const int64_t B = seg_ksum.size(0), H = seg_ksum.size(1), K = seg_ksum.size(2);
  TORCH_CHECK(k.sizes() == seg_ksum.sizes() && u.sizes() == seg_ksum.sizes(),
              "mc_scores_: k and u (B, H, K) expected");
  TORCH_CHECK(ksum_pool.dim() == 3 && ksum_pool.size(1) == H && ksum_pool.size(2) == K &&
                  ksum_pool.is_contiguous(), "mc_scores_: contiguous ksum_pool (NB, H, K)");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 && table.size(0) == B,
              "mc_scores_: table (B, N) int64 expected");
  TORCH_CHECK(seg_len.scalar_type() == torch::kInt64 && seg_len.numel() == B,
              "mc_scores_: seg_len (B,) int64 expected");
  const int64_t N = table.size(1), NB = ksum_pool.size(0);
  auto r = torch::empty({B, N + 1, H}, seg_ksum.options());
  float* rp = r.data_ptr<float>();
  float* sp = seg_ksum.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *up = u.data_ptr<float>();
  const float* P = ksum_pool.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = seg_len.data_ptr<int64_t>();
  const int64_t s0 = seg_ksum.stride(0), s1 = seg_ksum.stride(1);
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t u0 = u.stride(0), u1 = u.stride(1), u2 = u.stride(2);
  const int64_t t0 = table.stride(0), t1 = table.stride(1), l0 = seg_len.stride(0);
  const float rs = 1.f / std::sqrt(static_cast<float>(K));
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < B; ++b)  // every id checked before seg_ksum changes
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(tp[b * t0 + n * t1] < NB, "mc_scores_: a block id is outside the pool");
  std::vector<float> uu(H * K);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float* cum = sp + b * s0 + h * s1;
      float* uh = uu.data() + h * K;
      float on = 0.f;
      for (int64_t c = 0; c < K; ++c) {
        uh[c] = up[b * u0 + h * u1 + c * u2];
        cum[c] += kp[b * k0 + h * k1 + c * k2];
        on += uh[c] * cum[c];
      }
      rp[(b * (N + 1) + N) * H + h] = on * rs / static_cast<float>(lp[b * l0] + 1);
    }
    // block-major: each block's key sums (H·K floats) are one contiguous read
    const float scale = rs / static_cast<float>(segment_len);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t id = tp[b * t0 + n * t1];
      float* out = rp + (b * (N + 1) + n) * H;
      if (id < 0) {
        for (int64_t h = 0; h < H; ++h) out[h] = -inf;
        continue;
      }
      const float* ks = P + id * H * K;
      for (int64_t h = 0; h < H; ++h) out[h] = dot(uu.data() + h * K, ks + h * K, K) * scale;
    }
  }
  return r;
}

// One token of an MC linear memory (grm/ssc/soup read): the online state steps in place as
// in linear_step_, and y = w_on · Sᵀq + Σ_n w_c[b, n, h] · pool[ids[b, n, h], h]ᵀ q.
// w_on (B, H); ids, w_c (B, n, H). Returns y (B, H, V).
torch::Tensor mc_step_readout_(torch::Tensor S, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const c10::optional<torch::Tensor>& log_a,
                               const c10::optional<torch::Tensor>& b, const torch::Tensor& w_on,
                               const torch::Tensor& pool, const torch::Tensor& ids,
                               const torch::Tensor& w_c) {
  check_f32(w_on, "w_on");
  TORCH_CHECK(w_on.dim() == 2 && w_on.size(0) == S.size(0) && w_on.size(1) == S.size(1),
              "mc_step_readout_: w_on (B, H) expected");
  auto o = linear_step_(S, q, k, v, log_a, b);  // (B, H, V)
  o.mul_(w_on.unsqueeze(-1));
  if (ids.size(1) > 0) o.add_(readout_paged(pool, ids, q, w_c));
  return o;
}

namespace {

// x (B, I) · W (O, I)ᵀ (+ bias): a float32 W takes the matrix-vector kernel for one or two rows
// and ATen's GEMM beyond; an int8 W (with its per-row scales) or a bfloat16 W takes the
// low-precision kernels of lowp.cpp at any row count
torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& W,
                          const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& scales = c10::nullopt) {
  if (W.scalar_type() != torch::kFloat32) {
    auto y = mcserve_lowp::linear_any(x, W, scales, bias);
    TORCH_CHECK(y.defined(), "a float32, int8 or bfloat16 weight expected, got ",
                W.scalar_type());
    return y;
  }
  if (x.size(0) <= 2) return gemv(x.contiguous(), W.contiguous(), bias);
  return bias.has_value() && bias->defined() ? at::addmm(*bias, x, W.t()) : at::mm(x, W.t());
}

inline float log_sigmoid(float x) { return std::min(x, 0.f) - std::log1p(std::exp(-std::fabs(x))); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

}  // namespace

// One decode token through a whole block of mcserve's native model (models/native.py) on the
// gated linear memory: RMSNorm → projections (one stacked weight) → short conv + SiLU → q, k
// L2-normalised per head → gates → MC memory (none, grm, ssc: routing, online step, readout of
// the cached blocks) → per-head RMSNorm · silu(g) → o_proj → residual → RMSNorm → SwiGLU →
// residual. x (B, D) → (B, D); S, conv_tail and seg_ksum are updated in place. The Python path
// (Block.forward_paged under kernels.cpu.twins_only()) is its twin.
torch::Tensor native_block_decode_(
    const torch::Tensor& x, double eps, const torch::Tensor& norm1_w, const torch::Tensor& W_in,
    const c10::optional<torch::Tensor>& s_in, const c10::optional<torch::Tensor>& b_in,
    const c10::optional<torch::Tensor>& conv_w, const torch::Tensor& out_norm_w, double out_eps,
    const torch::Tensor& W_o, const c10::optional<torch::Tensor>& s_o,
    const torch::Tensor& norm2_w, const torch::Tensor& W_up,
    const c10::optional<torch::Tensor>& s_up, const torch::Tensor& W_down,
    const c10::optional<torch::Tensor>& s_down, int64_t H, int64_t K, bool use_u, bool has_decay, bool has_write, torch::Tensor S,
    c10::optional<torch::Tensor> conv_tail, torch::Tensor seg_ksum, const torch::Tensor& seg_len,
    const torch::Tensor& table, const torch::Tensor& pool, const torch::Tensor& ksum_pool,
    int64_t segment_len, int64_t variant, int64_t top_k,
    const c10::optional<torch::Tensor>& top_k_rows,
    const c10::optional<torch::Tensor>& host_pool, int64_t host_base) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "native_block_decode_: x (B, D) expected");
  TORCH_CHECK(variant >= 0 && variant <= 2, "native_block_decode_: variant 0/1/2 expected");
  const int64_t B = x.size(0), D = x.size(1), HK = H * K;
  auto xc = x.contiguous();
  auto h = rms_norm(xc, norm1_w, eps, D, c10::nullopt, false);
  auto z = rows_linear(h, W_in, b_in, s_in);  // (B, 3HK [+ HK u] + HK g + n_gates·H)
  TORCH_CHECK(z.size(1) == (4 + use_u) * HK + (has_decay + has_write) * H,
              "native_block_decode_: stacked projection width mismatch");
  torch::Tensor qkv = z.narrow(1, 0, 3 * HK);
  if (conv_w.has_value() && conv_w->defined()) {
    TORCH_CHECK(conv_tail.has_value() && conv_tail->defined(), "conv weight without a tail");
    qkv = conv_step_(*conv_tail, qkv, *conv_w, c10::nullopt, true);
  } else {
    qkv = qkv.contiguous();
  }
  // q, k normalised per head (F.normalize: x / max(‖x‖, 1e-12)); v as is
  auto q = torch::empty({B, H, K}, x.options());
  auto k = torch::empty({B, H, K}, x.options());
  auto v = qkv.narrow(1, 2 * HK, HK).reshape({B, H, K});
  {
    const float* src = qkv.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t part = 0; part < 2; ++part) {
        float* dst = part == 0 ? qp : kp;
        for (int64_t hh = 0; hh < H; ++hh) {
          const float* r = src + b * 3 * HK + part * HK + hh * K;
          float ss = 0.f;
          for (int64_t c = 0; c < K; ++c) ss += r[c] * r[c];
          const float inv = 1.f / std::max(std::sqrt(ss), 1e-12f);
          float* d = dst + (b * H + hh) * K;
          for (int64_t c = 0; c < K; ++c) d[c] = r[c] * inv;
        }
      }
    }
  }
  int64_t off = 3 * HK;
  torch::Tensor u = q;
  if (use_u) {
    u = z.narrow(1, off, HK).reshape({B, H, K});
    off += HK;
  }
  auto g = z.narrow(1, off, HK);
  off += HK;
  c10::optional<torch::Tensor> log_a, wb;
  if (has_decay || has_write) {
    auto raw = z.narrow(1, off, (has_decay + has_write) * H).contiguous();
    const float* rp = raw.data_ptr<float>();
    const int64_t nG = has_decay + has_write;
    if (has_decay) {
      auto t = torch::empty({B, H}, x.options());
      float* tp = t.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hh = 0; hh < H; ++hh) tp[b * H + hh] = log_sigmoid(rp[b * nG * H + hh]) / 8.f;
      log_a = t;
    }
    if (has_write) {
      auto t = torch::empty({B, H}, x.options());
      float* tp = t.data_ptr<float>();
      const int64_t gi = has_decay ? 1 : 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hh = 0; hh < H; ++hh) tp[b * H + hh] = sigmoid(rp[b * nG * H + gi * H + hh]);
      wb = t;
    }
  }
  torch::Tensor y;  // (B, H, K)
  if (variant == 0) {
    y = linear_step_(S, q, k, v, log_a, wb);
  } else {
    auto r = mc_scores_(seg_ksum, k, u, seg_len, ksum_pool, table, segment_len);  // (B, N+1, H)
    const int64_t N = table.size(1);
    std::vector<int64_t> kb(B, N);
    if (variant == 2) {
      for (int64_t b = 0; b < B; ++b) {
        int64_t kk = top_k;
        if (top_k_rows.has_value() && top_k_rows->defined())
          kk = top_k_rows->index({b}).item<int64_t>();
        kb[b] = std::min<int64_t>(std::max<int64_t>(kk, 0), N);
      }
    }
    y = linear_step_(S, q, k, v, log_a, wb);  // (B, H, V) online readout
    const float* rp = r.data_ptr<float>();
    const int64_t* tp = table.data_ptr<int64_t>();
    const int64_t t0 = table.stride(0), t1 = table.stride(1), NB = pool.size(0);
    TORCH_CHECK(pool.is_contiguous() && pool.size(1) == H && pool.size(2) == K &&
                    pool.size(3) == K, "native_block_decode_: contiguous pool (NB, H, K, K)");
    const float* P = pool.data_ptr<float>();
    // host-tier blocks (ids >= host_base) are read where they are: on a CPU both tiers are RAM
    const bool has_host = host_pool.has_value() && host_pool->defined();
    const float* PH = nullptr;
    int64_t NH = 0;
    if (has_host) {
      check_f32(*host_pool, "host_pool");
      TORCH_CHECK(host_pool->is_contiguous() && host_pool->size(1) == H &&
                      host_pool->size(2) == K && host_pool->size(3) == K && host_base >= NB,
                  "native_block_decode_: contiguous host pool (NH, H, K, K) above the device's");
      PH = host_pool->data_ptr<float>();
      NH = host_pool->size(0);
    }
    const float* qp = q.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    std::vector<float> sc(N);
    std::vector<int64_t> pick;
    std::vector<const float*> blocks;
    std::vector<float> wts;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t kk = kb[b];
      for (int64_t hh = 0; hh < H; ++hh) {
        for (int64_t n = 0; n < N; ++n) sc[n] = rp[(b * (N + 1) + n) * H + hh];
        const float s_on = rp[(b * (N + 1) + N) * H + hh];
        pick.clear();
        if (variant == 2 && kk < N) {
          // top kk by score, ties to the more recent block: one scan keeping the best kk in
          // descending order (n grows, so on a tie the newer block goes first)
          for (int64_t n = 0; n < N; ++n) {
            const float v = sc[n];
            if (kk == 0 ||
                (static_cast<int64_t>(pick.size()) == kk && !(v >= sc[pick.back()])))
              continue;
            auto pos = pick.begin();
            while (pos != pick.end() && sc[*pos] > v) ++pos;
            pick.insert(pos, n);
            if (static_cast<int64_t>(pick.size()) > kk) pick.pop_back();
          }
        } else {
          for (int64_t n = 0; n < N; ++n) pick.push_back(n);
        }
        float mx = s_on;
        for (int64_t n : pick) mx = std::max(mx, sc[n]);
        float tot = std::exp(s_on - mx);
        for (int64_t n : pick) tot += std::exp(sc[n] - mx);
        blocks.clear();
        wts.clear();
        for (int64_t n : pick) {
          const int64_t id = tp[b * t0 + n * t1];
          const float w = std::exp(sc[n] - mx) / tot;  // 0 for −inf (no block)
          if (id < 0 || w == 0.f) continue;
          if (has_host && id >= host_base) {
            TORCH_CHECK(id - host_base < NH, "native_block_decode_: a host block id is outside "
                        "the host pool");
            blocks.push_back(PH + ((id - host_base) * H + hh) * K * K);
          } else {
            TORCH_CHECK(id < NB, "native_block_decode_: a block id is outside the pool");
            blocks.push_back(P + (id * H + hh) * K * K);
          }
          wts.push_back(w);
        }
        float* out = yp + (b * H + hh) * K;
        const float w_on = std::exp(s_on - mx) / tot;
        for (int64_t c = 0; c < K; ++c) out[c] *= w_on;
        readout_row(blocks.data(), wts.data(), static_cast<int64_t>(blocks.size()),
                    qp + (b * H + hh) * K, K, K, out);
      }
    }
  }
  auto yn = rms_norm(y.reshape({B, HK}), out_norm_w, out_eps, K, g, true);
  auto x1 = xc + rows_linear(yn, W_o, c10::nullopt, s_o);
  auto t = rows_linear(rms_norm(x1, norm2_w, eps, D, c10::nullopt, false), W_up,
                        c10::nullopt, s_up);
  const int64_t F = t.size(1) / 2;
  auto m = torch::empty({B, F}, x.options());
  {
    const float* tp = t.data_ptr<float>();
    float* mp = m.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < F; ++c) mp[b * F + c] = silu(tp[b * 2 * F + c]) * tp[b * 2 * F + F + c];
  }
  return x1 + rows_linear(m, W_down, c10::nullopt, s_down);
}

// One decode token through a Mamba2 block (models/mamba2.py, no MC: the plain SSM state):
// RMSNorm → in_proj → (z, xBC, dt) → causal conv + SiLU on xBC (tail in place) → Δ = softplus(dt
// + dt_bias) clamped to [dt_min, dt_max] → S ← exp(Δ·A)·S + Δ·B xᵀ, y = Sᵀ C (in place) → + D·x
// → gated RMSNorm (groups of d_inner / G) or y·silu(z) → out_proj → residual. x (B, D) → (B, D).
// The Python path (Mamba2Block.forward_paged under kernels.cpu.twins_only()) is its twin.
torch::Tensor mamba2_block_decode_(
    const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const torch::Tensor& W_in,
    const c10::optional<torch::Tensor>& s_in, const c10::optional<torch::Tensor>& b_in,
    const torch::Tensor& conv_w,
    const c10::optional<torch::Tensor>& conv_b, const torch::Tensor& dt_bias,
    const torch::Tensor& A_log, double dt_min, double dt_max, const torch::Tensor& Dskip,
    const c10::optional<torch::Tensor>& gnorm_w, double gnorm_eps, bool norm_before_gate,
    const torch::Tensor& W_out, const c10::optional<torch::Tensor>& s_out,
    const c10::optional<torch::Tensor>& b_out, int64_t H,
    int64_t P, int64_t N, int64_t G, torch::Tensor S, torch::Tensor conv_tail) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "mamba2_block_decode_: x (B, D) expected");
  TORCH_CHECK(G > 0 && H % G == 0, "mamba2_block_decode_: n_groups must divide n_heads");
  const int64_t B = x.size(0), D = x.size(1), DI = H * P, CD = DI + 2 * G * N;
  auto xc = x.contiguous();
  auto zx = rows_linear(rms_norm(xc, norm_w, eps, D, c10::nullopt, false), W_in, b_in,
                        s_in);
  TORCH_CHECK(zx.size(1) == DI + CD + H, "mamba2_block_decode_: in_proj width mismatch");
  auto z = zx.narrow(1, 0, DI);
  auto xbc = conv_step_(conv_tail, zx.narrow(1, DI, CD), conv_w, conv_b, true);  // (B, CD)
  auto xs = xbc.narrow(1, 0, DI).reshape({B, H, P});
  // each group's B and C for its heads: a broadcast view for one group (linear_step_ reads
  // through strides), a copy otherwise
  auto per_head = [&](int64_t off) {
    auto g = xbc.narrow(1, off, G * N).reshape({B, G, N});
    return G == 1 ? g.expand({B, H, N}) : G == H ? g : at::repeat_interleave(g, H / G, 1);
  };
  auto k = per_head(DI);
  auto q = per_head(DI + G * N);
  auto delta = torch::empty({B, H}, x.options());
  auto log_a = torch::empty({B, H}, x.options());
  {
    auto dt = zx.narrow(1, DI + CD, H).contiguous();
    auto bias = dt_bias.contiguous();
    auto al = A_log.contiguous();
    const float *dp = dt.data_ptr<float>(), *bp = bias.data_ptr<float>(),
                *ap = al.data_ptr<float>();
    float *ep = delta.data_ptr<float>(), *lp = log_a.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const float t = dp[b * H + h] + bp[h];
        float d = t > 20.f ? t : std::log1p(std::exp(t));  // softplus (threshold 20, as torch)
        d = std::min(std::max(d, static_cast<float>(dt_min)), static_cast<float>(dt_max));
        ep[b * H + h] = d;
        lp[b * H + h] = d * -std::exp(ap[h]);
      }
    }
  }
  auto y = linear_step_(S, q, k, xs, log_a, delta);  // (B, H, P)
  {
    auto dsk = Dskip.contiguous();
    const bool per_channel = dsk.numel() == DI;
    const float* dp = dsk.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float* xp = xbc.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < DI; ++c)
        yp[b * DI + c] += xp[b * CD + c] * dp[per_channel ? c : c / P];
  }
  torch::Tensor yn;
  if (gnorm_w.has_value() && gnorm_w->defined()) {
    yn = rms_norm(y.reshape({B, DI}), gnorm_w, gnorm_eps, DI / G, z, norm_before_gate);
  } else {
    yn = y.reshape({B, DI}) * at::silu(z);
  }
  return xc + rows_linear(yn, W_out, b_out, s_out);
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x Wᵀ + bias for a few rows");
  m.def("linear_step_", &linear_step_, "one token of gated linear attention, in place");
  m.def("linear_scan", &linear_scan, "a span of gated linear attention, token by token: "
        "(o, final state)");
  m.def("delta_step_", &delta_step_, "one token of the (gated) delta rule, in place");
  m.def("rwkv7_step_", &rwkv7_step_, "one token of RWKV-7's generalised delta rule, in place");
  m.def("gla_vec_step_", &gla_vec_step_, "one token of vector-gated linear attention, in place");
  m.def("readout_paged", &readout_paged, "weighted readout of pool blocks");
  m.def("paged_attention_decode", &paged_attention_decode,
        "one decode query per row against its keys and values in a paged pool");
  m.def("topk_later", &topk_later, "indices of each row's k largest, ties to the later");
  m.def("conv_step_", &conv_step_, "one token of a depthwise causal conv, tail in place");
  m.def("rms_norm", &rms_norm, "grouped RMSNorm, optionally gated by silu(z)");
  m.def("mc_scores_", &mc_scores_, "MC routing scores of one token; seg_ksum += k in place");
  m.def("mc_step_readout_", &mc_step_readout_, "online step + weighted readout of pool blocks");
  m.def("native_block_decode_", &native_block_decode_, "one token through a native MC block");
  m.def("mamba2_block_decode_", &mamba2_block_decode_, "one token through a Mamba2 block");
  py::class_<Mamba2Stack>(m, "Mamba2Stack")
      .def(py::init<const std::vector<py::tuple>&>())
      .def("decode_", &Mamba2Stack::decode_, "one token through every layer, states in place");
  m.def("zeros_hugepage", &zeros_hugepage, "zeros on 2 MiB-aligned, huge-page-advised memory");
  mcserve_lowp::bind(m);
  mcserve_sampling::bind(m);
}
