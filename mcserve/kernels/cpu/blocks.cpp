// Whole blocks of a decode step in one call: mcserve's native block (native_block_decode_) and a
// Mamba2 block (mamba2_block_decode_; ops.cpp's Mamba2Stack runs it for every layer), with the
// pieces they share that are ops of their own too (conv_step_, rms_norm); and a prefill span's
// short conv (conv_span).
#include "common.h"
#include "lowp.h"
#include "ops.h"
#include "vmath.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace mcserve_ops {

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// x[0:n] = silu(x[0:n]) in place, 16 at a time (vmath.h), the rest one by one
inline void silu_row(float* x, int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) store16(x + c, vsilu(load16(x + c)));
  for (; c < n; ++c) x[c] = silu(x[c]);
}

}  // namespace

// Depthwise causal conv of a span (a prefill's): out[b, t] = bias + Σ_j w[:, j]·[tail; x][b,
// t + j], then SiLU when `silu`; tail (B, W-1, C) and x (B, T, C) with contiguous channels,
// weight (C, W) any strides → (B, T, C); the tail is not modified. One pass over the span
// (torch's form passes over it once per tap), by (row, tile of tokens) over torch's threads;
// each output a chain of multiply-adds from the last tap down.
torch::Tensor conv_span(const torch::Tensor& tail, const torch::Tensor& x,
                        const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                        bool silu) {
  check_f32(tail, "conv tail");
  check_f32(x, "x");
  check_f32(weight, "conv weight");
  TORCH_CHECK(tail.dim() == 3 && x.dim() == 3 && weight.dim() == 2, "conv_span: shapes");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), W = weight.size(1);
  TORCH_CHECK(W >= 1 && weight.size(0) == C && tail.size(0) == B && tail.size(1) == W - 1 &&
                  tail.size(2) == C,
              "conv_span: tail (B, W-1, C), x (B, T, C), weight (C, W) expected");
  TORCH_CHECK(tail.stride(2) == 1 && x.stride(2) == 1, "conv_span: channels must be contiguous");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32(*bias, "conv bias");
    TORCH_CHECK(bias->numel() == C && bias->is_contiguous(), "conv bias (C,) expected");
    bp = bias->data_ptr<float>();
  }
  const auto wt = weight.t().contiguous();  // (W, C): each tap a contiguous row
  auto out = torch::empty({B, T, C}, x.options());
  const float *xp = x.data_ptr<float>(), *tp = tail.data_ptr<float>(),
              *wp = wt.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), ts0 = tail.stride(0),
                ts1 = tail.stride(1);
  constexpr int64_t kTile = 64;
  const int64_t tiles = (T + kTile - 1) / kTile;
  at::parallel_for(0, B * tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / tiles, ta = i % tiles * kTile, te = std::min(T, ta + kTile);
      for (int64_t t = ta; t < te; ++t) {
        float* o = op + (b * T + t) * C;
        const float* last = xp + b * xs0 + t * xs1;  // tap W - 1 reads x[t]
        const float* wl = wp + (W - 1) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = std::fma(wl[c], last[c], bp ? bp[c] : 0.f);
        for (int64_t j = W - 2; j >= 0; --j) {
          const int64_t s = t + j - (W - 1);  // the row tap j reads: x[s], or the tail's
          const float* row = s >= 0 ? xp + b * xs0 + s * xs1 : tp + b * ts0 + (W - 1 + s) * ts1;
          const float* wj = wp + j * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) o[c] = std::fma(wj[c], row[c], o[c]);
        }
        if (silu) silu_row(o, C);
      }
    }
  });
  return out;
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
  // rows split over torch's threads (a long prefill's norms); each row's sums as before
  at::parallel_for(0, R, std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, D)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> h(group), gate(zp ? group : 0);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g0 = 0; g0 < D; g0 += group) {
        const float* xr = xp + r * xs + g0;
        const float* zr = zp ? zp + r * zs + g0 : nullptr;
        float* yr = yp + r * D + g0;
        if (group % 16 == 0) {  // 16 channels at a time, the sum of squares in 16 lanes
          v16f acc{};
          for (int64_t c = 0; c < group; c += 16) {
            v16f v = load16(xr + c);
            if (zr && !norm_before_gate) v *= vsilu(load16(zr + c));
            store16(h.data() + c, v);
            acc += v * v;
          }
          float ss = 0.f;
          for (int i = 0; i < 16; ++i) ss += acc[i];
          const float inv =
              1.f / std::sqrt(ss / static_cast<float>(group) + static_cast<float>(eps));
          for (int64_t c = 0; c < group; c += 16) {
            v16f v = load16(h.data() + c) * inv;
            if (wp) v *= load16(wp + (w_full ? g0 + c : c));
            if (zr && norm_before_gate) v *= vsilu(load16(zr + c));
            store16(yr + c, v);
          }
          continue;
        }
        float ss = 0.f;
        if (zr) {  // silu(z), 16 at a time
          std::copy(zr, zr + group, gate.data());
          silu_row(gate.data(), group);
        }
        for (int64_t c = 0; c < group; ++c) {
          float v = xr[c];
          if (zr && !norm_before_gate) v *= gate[c];
          h[c] = v;
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(group) + static_cast<float>(eps));
        for (int64_t c = 0; c < group; ++c) {
          float v = h[c] * inv;
          if (wp) v *= wp[w_full ? g0 + c : c];
          if (zr && norm_before_gate) v *= gate[c];
          yr[c] = v;
        }
      }
    }
  });
  return y;
}

// silu(gate) · up → (R, H) contiguous, gate and up (R, H) with contiguous columns (the two
// halves of a SwiGLU's stacked projection, say): one pass where torch takes three (the SiLU, the
// product, and the copy the next GEMM needs of a strided view).
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_f32(gate, "gate");
  check_f32(up, "up");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "silu_mul: gate and up (R, H) alike with unit column stride expected");
  const int64_t R = gate.size(0), H = gate.size(1);
  auto out = torch::empty({R, H}, gate.options());
  const float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::parallel_for(0, R, std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, H)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = gp + r * gs, *u = up_ + r * us;
      float* o = op + r * H;
      int64_t c = 0;
      for (; c + 16 <= H; c += 16) store16(o + c, vsilu(load16(g + c)) * load16(u + c));
      for (; c < H; ++c) o[c] = silu(g[c]) * u[c];
    }
  });
  return out;
}

// Each group of `group` columns of x (R, D) divided by its L2 norm (at least 1e-12, as
// F.normalize), in place; x may be a strided view of rows (q and k inside a qkv buffer).
torch::Tensor l2norm_(torch::Tensor x, int64_t group) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "l2norm_: x (R, D) with unit column stride");
  const int64_t R = x.size(0), D = x.size(1), xs = x.stride(0);
  TORCH_CHECK(group > 0 && D % group == 0, "l2norm_: group must divide ", D, ", got ", group);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, D)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g0 = 0; g0 < D; g0 += group) {
        float* v = xp + r * xs + g0;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < group; ++c) ss += v[c] * v[c];
        const float inv = 1.f / std::max(std::sqrt(ss), 1e-12f);
#pragma omp simd
        for (int64_t c = 0; c < group; ++c) v[c] *= inv;
      }
    }
  });
  return x;
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

}  // namespace mcserve_ops
