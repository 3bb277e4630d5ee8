// Gated linear attention on the CPU (the linear memory): one token in place (linear_step_) and a
// span token by token with the same arithmetic (linear_scan).
#include "common.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace mcserve_ops {

namespace {
constexpr int64_t kCols = 64;
typedef float v16f __attribute__((vector_size(64), aligned(4)));
}  // namespace

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
// and b (B, T, H) or absent, any strides. Returns o (B, T, H, V), the final state and, when
// every > 0, the state at the end of every `every` tokens (B, ⌈T/every⌉, H, K, V), the last
// being the final state; with restart, each of those chunks after the first starts from zero
// (Memory Caching's independent segments; the final state is then the last chunk's own).
// Each (row, head) keeps its state in this thread's cache for the whole span, which beats the
// chunked form's products at any length on the CPU.
std::vector<torch::Tensor> linear_scan(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v,
                                       const c10::optional<torch::Tensor>& log_a,
                                       const c10::optional<torch::Tensor>& b,
                                       const torch::Tensor& S0, int64_t every, bool restart) {
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
  TORCH_CHECK(every >= 0, "linear_scan: every must be >= 0, got ", every);
  const int64_t G = every > 0 ? (T + every - 1) / every : 0;
  auto S = torch::empty({B, H, K, V}, S0.options());
  auto o = torch::empty({B, T, H, V}, S0.options());
  auto ends = torch::empty({B, G, H, K, V}, S0.options());
  float* ep = ends.data_ptr<float>();
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
        const float* vvp = vv.data();
        // 64 columns at a time with the token's readout in vector registers across all K
        // rows (GCC/Clang vector types, this CPU's width); -ffp-contract=fast makes each
        // a·s + kw·v and q·x + o one fused multiply-add, as std::fma does for the last V % 64
        // columns, so a column's result does not depend on where it sits
        int64_t j0 = 0;
        for (; j0 + kCols <= V; j0 += kCols) {
          const v16f* vc = reinterpret_cast<const v16f*>(vvp + j0);
          const v16f v0 = vc[0], v1 = vc[1], v2 = vc[2], v3 = vc[3];
          v16f o0 = {}, o1 = {}, o2 = {}, o3 = {};
          for (int64_t r = 0; r < K; ++r) {
            const float kw = kr[r * ks[3]] * w, qv = qr[r * qs[3]];
            v16f* row = reinterpret_cast<v16f*>(s + r * V + j0);
            const v16f x0 = a * row[0] + kw * v0, x1 = a * row[1] + kw * v1;
            const v16f x2 = a * row[2] + kw * v2, x3 = a * row[3] + kw * v3;
            row[0] = x0;
            row[1] = x1;
            row[2] = x2;
            row[3] = x3;
            o0 = qv * x0 + o0;
            o1 = qv * x1 + o1;
            o2 = qv * x2 + o2;
            o3 = qv * x3 + o3;
          }
          v16f* oc = reinterpret_cast<v16f*>(out + j0);
          oc[0] = o0;
          oc[1] = o1;
          oc[2] = o2;
          oc[3] = o3;
        }
        for (int64_t j = j0; j < V; ++j) out[j] = 0.f;
        for (int64_t r = 0; j0 < V && r < K; ++r) {
          const float kw = kr[r * ks[3]] * w, qv = qr[r * qs[3]];
          float* row = s + r * V;
          for (int64_t j = j0; j < V; ++j) {
            const float x = std::fma(a, row[j], kw * vvp[j]);
            row[j] = x;
            out[j] = std::fma(qv, x, out[j]);
          }
        }
        if (every > 0 && ((t + 1) % every == 0 || t + 1 == T)) {
          std::copy(s, s + K * V, ep + ((bi * G + t / every) * H + h) * K * V);
          if (restart && t + 1 < T && (t + 1) % every == 0) std::fill(s, s + K * V, 0.f);
        }
      }
    }
  });
  return {o, S, ends};
}

}  // namespace mcserve_ops
