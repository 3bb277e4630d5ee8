// One token of the other recurrent memories, in place on the engine's slot pool: the (gated)
// delta rule (delta_step_), RWKV-7 (rwkv7_step_) and vector-gated linear attention
// (gla_vec_step_).
#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace mcserve_ops {

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

}  // namespace mcserve_ops
