// Sampling-side ops for mcserve's CPU engine: the grammar bitmask of structured outputs applied
// to the logits in place (one pass over the words, no unpacked mask).
#include "sampling.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace mcserve_sampling {

// logits (B, V) float32, rows (R,) int64, bitmask (R, W) int32: token t of row rows[j] keeps its
// logit when bit t % 32 of bitmask[j][t / 32] is set, else becomes -inf; tokens at or past 32 W
// become -inf. Returns logits.
torch::Tensor mask_logits_(torch::Tensor logits, const torch::Tensor& rows,
                           const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.is_contiguous(),
              "mask_logits_: logits must be contiguous float32 (B, V)");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "mask_logits_: rows must be contiguous int64 (R,)");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous() && bitmask.size(0) == rows.size(0),
              "mask_logits_: bitmask must be contiguous int32 (R, W)");
  const int64_t B = logits.size(0), V = logits.size(1), R = rows.size(0), W = bitmask.size(1);
  const float neg = -std::numeric_limits<float>::infinity();
  float* L = logits.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint32_t* bm = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t j = 0; j < R; ++j) {
    const int64_t r = rp[j];
    TORCH_CHECK(r >= 0 && r < B, "mask_logits_: row ", r, " is outside the batch of ", B);
    float* x = L + r * V;
    const uint32_t* words = bm + j * W;
    const int64_t covered = std::min<int64_t>(W * 32, V);
    for (int64_t w = 0; w * 32 < covered; ++w) {
      uint32_t keep = words[w];
      if (keep == 0xFFFFFFFFu) continue;
      const int64_t t0 = w * 32, n = std::min<int64_t>(32, covered - t0);
      if (keep == 0) {
        for (int64_t i = 0; i < n; ++i) x[t0 + i] = neg;
        continue;
      }
      for (int64_t i = 0; i < n; ++i)
        if (!((keep >> i) & 1u)) x[t0 + i] = neg;
    }
    for (int64_t t = covered; t < V; ++t) x[t] = neg;
  }
  return logits;
}

void bind(pybind11::module& m) {
  m.def("mask_logits_", &mask_logits_,
        "the grammar bitmask of the constrained rows applied to the logits, in place");
}

}  // namespace mcserve_sampling
