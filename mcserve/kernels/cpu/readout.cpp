// Reads of the paged pools at decode: the weighted readout of cached state blocks
// (readout_paged), paged attention for one query per row (paged_attention_decode), MC routing
// (mc_scores_, topk_later) and the MC step + readout of one token (mc_step_readout_); and the
// prefill's routing (select_softmax, dense_softmax_) and readout of each token's picked
// checkpoints (readout_picks).
#include "common.h"
#include "ops.h"
#include "vmath.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace mcserve_ops {

// Σ_n w[b, n, h] · S[ids[b, n, h], h]ᵀ q[b, h] read from the block pool in place.
// pool (NB, H, K, V) contiguous, ids (B, n, H) int64, q (B, H, K), w (B, n, H) → (B, H, V).
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

namespace {

// y_r += x_rᵀ S over 64 columns from j0 for four rows at once: S's rows read once for all
// four, the 4 × 64 sums in vector registers (GCC/Clang vector types: whatever this CPU's width);
// four_rows_tail does the last V % 64 columns element by element. Both multiply-add (fused, as
// -ffp-contract=fast makes the vector form), so a row's sums do not depend on the rows beside it.
constexpr int64_t kCols = 64;

inline void four_rows(const float* X, int64_t K, const float* S, int64_t V, int64_t j0,
                      float* const* dst) {
  v16f a[4][4] = {};
  for (int64_t c = 0; c < K; ++c) {
    const v16f* row = reinterpret_cast<const v16f*>(S + c * V + j0);
    const v16f s0 = row[0], s1 = row[1], s2 = row[2], s3 = row[3];
    for (int r = 0; r < 4; ++r) {
      const float x = X[r * K + c];
      a[r][0] += x * s0;
      a[r][1] += x * s1;
      a[r][2] += x * s2;
      a[r][3] += x * s3;
    }
  }
  for (int r = 0; r < 4; ++r) {
    v16f* out = reinterpret_cast<v16f*>(dst[r] + j0);
    for (int i = 0; i < 4; ++i) out[i] += a[r][i];
  }
}

inline void four_rows_tail(const float* X, int64_t K, const float* S, int64_t V, int64_t j0,
                           float* const* dst) {
  for (int r = 0; r < 4; ++r)
    for (int64_t j = j0; j < V; ++j) {
      float acc = 0.f;
      for (int64_t c = 0; c < K; ++c) acc = std::fma(X[r * K + c], S[c * V + j], acc);
      dst[r][j] += acc;
    }
}

}  // namespace

// The readout of each token's picked checkpoints over a prefill span (ssc), grouped by
// checkpoint: y[b, t, h] = Σ_j w[b, t, h, j] · S[b, idx[b, t, h, j], h]ᵀ q[b, t, h].
// S (B, N, H, K, V) contiguous; q (B, L, H, K), idx (B, L, H, k) int64, w (B, L, H, k), any
// strides → (B, L, H, V). A task is one (row, head) and a tile of tokens: its picks sorted by
// checkpoint (a counting sort), each picked state then read once for all the tile's tokens that
// picked it, four tokens at a time, instead of once per token. Zero weights are skipped. A
// token's sum runs over its picks in checkpoint order, whatever the tile or its neighbours.
torch::Tensor readout_picks(const torch::Tensor& S, const torch::Tensor& q,
                            const torch::Tensor& idx, const torch::Tensor& w) {
  check_f32(S, "S");
  check_f32(q, "q");
  check_f32(w, "w");
  TORCH_CHECK(S.dim() == 5 && S.is_contiguous(),
              "readout_picks: contiguous S (B, N, H, K, V) expected");
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.dim() == 4 && idx.device().is_cpu(),
              "readout_picks: idx (B, L, H, k) int64 on the CPU expected");
  const int64_t B = S.size(0), N = S.size(1), H = S.size(2), K = S.size(3), V = S.size(4);
  const int64_t L = idx.size(1), k = idx.size(3);
  TORCH_CHECK(idx.size(0) == B && idx.size(2) == H &&
                  q.sizes() == torch::IntArrayRef({B, L, H, K}) &&
                  w.sizes() == torch::IntArrayRef({B, L, H, k}),
              "readout_picks: q (B, L, H, K), idx and w (B, L, H, k) expected");
  auto y = torch::zeros({B, L, H, V}, S.options());
  const float *Sp = S.data_ptr<float>(), *qp = q.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const auto qs = q.strides(), is = idx.strides(), ws = w.strides();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kTile = 1024;  // tokens of a task: ~32 rows per state at 8 picks of 256
  const int64_t tiles = (L + kTile - 1) / kTile;
  std::atomic<bool> bad{false};
  at::parallel_for(0, B * H * tiles, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> start(N + 1), order(kTile * k);
    std::vector<float> X(4 * K), spare(V);  // spare: a short group's unused rows
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / (H * tiles), h = task / tiles % H;
      const int64_t t0 = task % tiles * kTile, t1 = std::min(L, t0 + kTile);
      auto pick = [&](int64_t t, int64_t j) { return ip[b * is[0] + t * is[1] + h * is[2] +
                                                        j * is[3]]; };
      auto weight = [&](int64_t t, int64_t j) { return wp[b * ws[0] + t * ws[1] + h * ws[2] +
                                                          j * ws[3]]; };
      if (!sort_picks(pick, weight, t0, t1, k, N, start, order)) bad = true;
      for (int64_t n = 0; n < N; ++n) {
        const float* Sn = Sp + ((b * N + n) * H + h) * K * V;
        for (int64_t g = start[n]; g < start[n + 1]; g += 4) {
          float* dst[4];
          for (int64_t r = 0; r < 4; ++r) {
            float* x = X.data() + r * K;
            if (g + r < start[n + 1]) {
              const int64_t t = t0 + order[g + r] / k, j = order[g + r] % k;
              const float wt = weight(t, j);
              const float* qr = qp + b * qs[0] + t * qs[1] + h * qs[2];
              for (int64_t c = 0; c < K; ++c) x[c] = wt * qr[c * qs[3]];
              dst[r] = yp + ((b * L + t) * H + h) * V;
            } else {  // a short group: zero rows into a spare output
              std::fill(x, x + K, 0.f);
              dst[r] = spare.data();
            }
          }
          int64_t j0 = 0;
          for (; j0 + kCols <= V; j0 += kCols) four_rows(X.data(), K, Sn, V, j0, dst);
          if (j0 < V) four_rows_tail(X.data(), K, Sn, V, j0, dst);
        }
      }
    }
  });
  TORCH_CHECK(!bad, "readout_picks: a checkpoint index is outside S");
  return y;
}

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

namespace {

// The k best entries of a row in topk_later's order (largest first, ties to the later index),
// kept in a small sorted list while the row is walked left to right: an entry only has to beat
// the list's last (worst) one. Nothing below a floor is looked at: the k-th largest of 16 group
// maxima, the groups the row's lanes mod 16 (k groups hold an entry at least that large; k <= 16),
// so that with random scores about 10 of 200 entries get past it. The entries are tested 16 at a time (vmath.h) and only the lanes
// that pass are looked at one by one.
struct LaterTopK {
  std::vector<float> v;
  std::vector<int64_t> at;
  std::vector<float> gmax;
  int64_t k, m = 0;
  explicit LaterTopK(int64_t k) : v(k), at(k), gmax(16), k(k) {}

  void insert(float x, int64_t n) {  // before every kept entry <= x (n is later than them all)
    int64_t p = m < k ? m : k - 1;
    while (p > 0 && v[p - 1] <= x) {
      v[p] = v[p - 1];
      at[p] = at[p - 1];
      --p;
    }
    v[p] = x;
    at[p] = n;
    if (m < k) ++m;
  }

  // a new row: its entries x[0, n) first, then entries n .. N - 1 that score -inf
  void row(const float* x, int64_t n, int64_t N) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    m = 0;
    float floor = kNegInf;
    if (k <= 16) {  // the row's lanes of 16 as 16 groups (NaNs left out; -inf past n)
      v16f acc = splat16(kNegInf);
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) acc = vmax_keep(acc, load16(x + j));
      if (j < n) {
        alignas(64) float tail[16];
        std::fill(tail, tail + 16, kNegInf);
        std::copy(x + j, x + n, tail);
        acc = vmax_keep(acc, load16(tail));
      }
      store16(gmax.data(), acc);
      std::nth_element(gmax.begin(), gmax.begin() + (k - 1), gmax.end(), std::greater<float>());
      floor = gmax[k - 1];
    }
    float kth = kNegInf;  // v[k - 1] once k are kept
    for (int64_t j = 0; j < n; j += 16) {
      // the lanes of 16 entries that may be kept, from the state at their start (the test per
      // entry below only adds conditions as the list fills): while fewer than k are kept the
      // floor's test, which a NaN passes; then also the k-th best's, which a NaN fails
      const int cnt = static_cast<int>(std::min<int64_t>(16, n - j));
      v16f y;
      if (cnt == 16) {
        y = load16(x + j);
      } else {
        alignas(64) float tail[16] = {};
        std::copy(x + j, x + j + cnt, tail);
        y = load16(tail);
      }
      const v16i may = m < k ? ~(y < floor) : (y >= std::max(floor, kth));
      unsigned bits = lane_bits(may) & (cnt == 16 ? 0xFFFFu : (1u << cnt) - 1);
      while (bits != 0) {
        const int i = __builtin_ctz(bits);
        bits &= bits - 1;
        const float e = x[j + i];
        if (e < floor || (m == k && !(e >= kth))) continue;
        insert(e, j + i);
        if (m == k) kth = v[k - 1];
      }
    }
    // of the -inf ones only the last k can rank among the k best (later ranks first)
    for (int64_t j = std::max(n, N - k); j < N; ++j)
      if (m < k || v[k - 1] == kNegInf) insert(kNegInf, j);
  }
};

}  // namespace

// Indices of the k largest entries of each row of r (R, N), largest first; among equal values
// the later index ranks first (the most recent checkpoint). One pass per row (LaterTopK).
// → (R, k) int64.
torch::Tensor topk_later(const torch::Tensor& r, int64_t k) {
  check_f32(r, "r");
  TORCH_CHECK(r.dim() == 2 && r.stride(1) == 1, "topk_later: r (R, N) with unit column stride");
  const int64_t R = r.size(0), N = r.size(1), rs = r.stride(0);
  TORCH_CHECK(k >= 1 && k <= N, "topk_later: k must be in [1, N], got k=", k, ", N=", N);
  auto idx = torch::empty({R, k}, r.options().dtype(torch::kInt64));
  const float* rp = r.data_ptr<float>();
  int64_t* op = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    LaterTopK best(k);
    for (int64_t row = r0; row < r1; ++row) {
      const float* x = rp + row * rs;
      int64_t n_end = N;  // hidden checkpoints score -inf at the row's end
      while (n_end > 0 && x[n_end - 1] == -std::numeric_limits<float>::infinity()) --n_end;
      best.row(x, n_end, N);
      std::copy(best.at.begin(), best.at.end(), op + row * k);
    }
  });
  return idx;
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

// The routing of a prefill span's tokens (ssc): for each row of scores r (R, N) (unit column
// stride) whose first visible[row] entries are the checkpoints it sees (the rest count as -inf,
// whatever r holds there), the k best as topk_later picks them and the softmax of their scores
// together with the online score r_on[row]: → idx (R, k) int64, w (R, k) and w_on (R,) (float32;
// a pick past the visible ones, as when fewer than k are visible, has weight zero). One pass
// per row; no masked copy of r, no gather.
std::vector<torch::Tensor> select_softmax(const torch::Tensor& r, const torch::Tensor& visible,
                                          const torch::Tensor& r_on, int64_t k) {
  check_f32(r, "r");
  check_f32(r_on, "r_on");
  TORCH_CHECK(r.dim() == 2 && r.stride(1) == 1,
              "select_softmax: r (R, N) with unit column stride expected");
  const int64_t R = r.size(0), N = r.size(1), rs = r.stride(0);
  TORCH_CHECK(k >= 1 && k <= N, "select_softmax: k must be in [1, N], got k=", k, ", N=", N);
  TORCH_CHECK(visible.scalar_type() == torch::kInt64 && visible.numel() == R &&
                  visible.device().is_cpu() && r_on.numel() == R,
              "select_softmax: visible (R,) int64 and r_on (R,) expected");
  auto vis = visible.contiguous();
  auto ron = r_on.contiguous();
  auto idx = torch::empty({R, k}, r.options().dtype(torch::kInt64));
  auto w = torch::empty({R, k}, r.options());
  auto w_on = torch::empty({R}, r.options());
  const float *rp = r.data_ptr<float>(), *onp = ron.data_ptr<float>();
  const int64_t* vp = vis.data_ptr<int64_t>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float *wp = w.data_ptr<float>(), *wonp = w_on.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    LaterTopK best(k);
    const std::vector<float>& bv = best.v;
    for (int64_t row = r0; row < r1; ++row) {
      best.row(rp + row * rs, std::min(N, std::max<int64_t>(0, vp[row])), N);
      const float on = onp[row];
      float top = on;
      for (int64_t j = 0; j < k; ++j) top = std::max(top, bv[j]);
      float sum = 0.f;
      float* wr = wp + row * k;
      for (int64_t j = 0; j < k; ++j) {
        wr[j] = bv[j] == kNegInf ? 0.f : std::exp(bv[j] - top);
        sum += wr[j];
      }
      const float e_on = std::exp(on - top);
      sum += e_on;
      for (int64_t j = 0; j < k; ++j) wr[j] /= sum;
      wonp[row] = e_on / sum;
      std::copy(best.at.begin(), best.at.end(), ip + row * k);
    }
  });
  return {idx, w, w_on};
}

namespace {
inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
}  // namespace

// The softmax of each row's first visible[row] scores together with the online score
// r_on[row], in place: r (R, N) becomes the weights (zero past the visible ones, whatever they
// held), and the online score's weight is returned (R,). One pass per row for the max, one for
// the exponentials and their sum, one to scale (the dense MC prefill's routing of a tile).
torch::Tensor dense_softmax_(torch::Tensor r, const torch::Tensor& visible,
                             const torch::Tensor& r_on) {
  check_f32(r, "r");
  check_f32(r_on, "r_on");
  TORCH_CHECK(r.dim() == 2 && r.stride(1) == 1,
              "dense_softmax_: r (R, N) with unit column stride expected");
  const int64_t R = r.size(0), N = r.size(1), rs = r.stride(0);
  TORCH_CHECK(visible.scalar_type() == torch::kInt64 && visible.numel() == R &&
                  visible.device().is_cpu() && r_on.numel() == R,
              "dense_softmax_: visible (R,) int64 and r_on (R,) expected");
  auto vis = visible.contiguous();
  auto ron = r_on.contiguous();
  auto w_on = torch::empty({R}, r.options());
  float* rp = r.data_ptr<float>();
  const float* onp = ron.data_ptr<float>();
  const int64_t* vp = vis.data_ptr<int64_t>();
  float* wonp = w_on.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, N)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      float* x = rp + row * rs;
      const int64_t n = std::min(N, std::max<int64_t>(0, vp[row]));
      const int64_t nv = n / 16 * 16;
      const float on = onp[row];
      float top = on;
      if (nv) {
        v16f mx = *reinterpret_cast<const v16f*>(x);
        for (int64_t j = 16; j < nv; j += 16) {
          const v16f v = *reinterpret_cast<const v16f*>(x + j);
          mx = mx > v ? mx : v;
        }
        for (int i = 0; i < 16; ++i) top = std::max(top, mx[i]);
      }
      for (int64_t j = nv; j < n; ++j) top = std::max(top, x[j]);
      v16f acc{};
      for (int64_t j = 0; j < nv; j += 16) {
        v16f* px = reinterpret_cast<v16f*>(x + j);
        const v16f e = vexp(*px - top);
        *px = e;
        acc += e;
      }
      float sum = hsum(acc);
      if (nv < n) {  // the last partial group of 16, padded with -inf (weight zero)
        v16f t = v16f{} - std::numeric_limits<float>::infinity();
        for (int64_t j = nv; j < n; ++j) t[j - nv] = x[j] - top;
        const v16f e = vexp(t);
        for (int64_t j = nv; j < n; ++j) {
          x[j] = e[j - nv];
          sum += e[j - nv];
        }
      }
      const float e_on = std::exp(on - top);
      const float inv = 1.f / (sum + e_on);
      for (int64_t j = 0; j < nv; j += 16) *reinterpret_cast<v16f*>(x + j) *= inv;
      for (int64_t j = nv; j < n; ++j) x[j] *= inv;
      std::fill(x + n, x + N, 0.f);
      wonp[row] = e_on * inv;
    }
  });
  return w_on;
}

}  // namespace mcserve_ops
