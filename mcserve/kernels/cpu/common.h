// Helpers shared by the CPU kernels (the ops of ops.h, and amx.cpp's): argument checks, the plain
// dot product, the weighted readout of (K, V) state blocks and the sort of a prefill tile's picks
// by checkpoint. Inline: each file that uses them compiles them into its own loops, as when every
// op lived in one file.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mcserve_ops {

inline void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ",
              t.scalar_type());
}

// The auto-vectorised dot product of two float vectors: one accumulator (gemv.cpp explains why
// the matrix-vector product has its own AVX2/FMA path).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
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

// The picks of one tile of tokens t0 .. t1 (k per token: pick(t, j) a checkpoint in [0, N),
// weight(t, j) its weight) sorted by checkpoint with a counting sort: order[start[n] ..
// start[n + 1]) are the (t - t0)·k + j of checkpoint n's picks, in token order; zero weights are
// left out. start has N + 1 entries, order at least (t1 - t0)·k. False when a pick lies outside
// [0, N) (it is left out too).
template <class Pick, class Weight>
bool sort_picks(const Pick& pick, const Weight& weight, int64_t t0, int64_t t1, int64_t k,
                int64_t N, std::vector<int64_t>& start, std::vector<int64_t>& order) {
  bool ok = true;
  std::fill(start.begin(), start.end(), 0);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t n = pick(t, j);
      if (n < 0 || n >= N) {
        ok = false;
        continue;
      }
      if (weight(t, j) != 0.f) ++start[n + 1];
    }
  for (int64_t n = 0; n < N; ++n) start[n + 1] += start[n];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t n = pick(t, j);
      if (n >= 0 && n < N && weight(t, j) != 0.f) order[fill[n]++] = (t - t0) * k + j;
    }
  return ok;
}

}  // namespace mcserve_ops
