// The checkpoint layouts of the bfloat16 cached readouts (declared in lowp.h): checkpoints
// (B, n, H, K, V) float32 rounded to bfloat16 and interleaved in pairs in one pass, either two
// checkpoints per 32-bit word (ckpt_pairs_bf16_, for readout_bf16_amx_) or two keys per word
// (key_pairs_bf16_, for readout_picks_bf16_amx). Plain vector code (vmath.h): no AMX needed.
// Also the way back for a packed weight's rows (packed_rows: a token embedding's lookup).
#include "lowp.h"
#include "vmath.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mcserve_lowp {

using mcserve_ops::bf16_bits;
using mcserve_ops::v16u;

// checkpoints (B, n, H, K, V) float32 on the CPU with each (K, V) contiguous, as the layout
// conversions below read them
static void check_ckpt_src(const torch::Tensor& src, const char* op) {
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == torch::kFloat32 && src.dim() == 5,
              op, ": src must be a 5-D (B, n, H, K, V) float32 CPU tensor");
  TORCH_CHECK(src.stride(4) == 1 && src.stride(3) == src.size(4), op,
              ": each (K, V) of src must be contiguous");
}

torch::Tensor key_pairs_bf16_(torch::Tensor dst, const torch::Tensor& src, int64_t offset) {
  check_ckpt_src(src, "key_pairs_bf16_");
  const int64_t B = src.size(0), n = src.size(1), H = src.size(2), K = src.size(3),
                V = src.size(4);
  TORCH_CHECK(dst.device().is_cpu() && dst.scalar_type() == torch::kBFloat16 && dst.dim() == 6 &&
                  dst.is_contiguous() && dst.size(0) == B && dst.size(1) == H &&
                  dst.size(3) * 2 == K && dst.size(4) == V && dst.size(5) == 2 && K % 2 == 0,
              "key_pairs_bf16_: dst must be a contiguous bfloat16 (B, H, N, K/2, V, 2) = (", B,
              ", ", H, ", N, ", K / 2, ", ", V, ", 2), got ", dst.sizes());
  const int64_t N = dst.size(2);
  TORCH_CHECK(offset >= 0 && offset + n <= N, "key_pairs_bf16_: offset ", offset, " + ", n,
              " checkpoints past N = ", N);
  const float* sp = src.data_ptr<float>();
  uint32_t* dp = reinterpret_cast<uint32_t*>(dst.data_ptr());  // a key pair per 32 bits
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const int64_t KV2 = K / 2 * V;
  at::parallel_for(0, B * n * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K * V)),
                   [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (n * H), i = u / H % n, h = u % H;
      const uint32_t* s = reinterpret_cast<const uint32_t*>(sp + b * s0 + i * s1 + h * s2);
      uint32_t* d = dp + ((b * H + h) * N + offset + i) * KV2;
      for (int64_t kp = 0; kp < K / 2; ++kp) {
        const uint32_t *r0 = s + 2 * kp * V, *r1 = r0 + V;
        uint32_t* o = d + kp * V;
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) {
          v16u a, c;
          std::memcpy(&a, r0 + v, sizeof a);
          std::memcpy(&c, r1 + v, sizeof c);
          const v16u y = bf16_bits(a) | (bf16_bits(c) << 16);
          std::memcpy(o + v, &y, sizeof y);
        }
        for (; v < V; ++v) {
          v16u a{}, c{};
          a[0] = r0[v];
          c[0] = r1[v];
          o[v] = (bf16_bits(a) | (bf16_bits(c) << 16))[0];
        }
      }
    }
  });
  return dst;
}

torch::Tensor ckpt_pairs_bf16_(torch::Tensor dst, const torch::Tensor& src, int64_t offset) {
  check_ckpt_src(src, "ckpt_pairs_bf16_");
  const int64_t B = src.size(0), n = src.size(1), H = src.size(2), K = src.size(3),
                V = src.size(4);
  TORCH_CHECK((K * V) % 16 == 0, "ckpt_pairs_bf16_: K·V a multiple of 16 expected");
  const int64_t G = K * V / 16;
  TORCH_CHECK(dst.device().is_cpu() && dst.scalar_type() == torch::kBFloat16 && dst.dim() == 6 &&
                  dst.is_contiguous() && dst.size(0) == B && dst.size(1) == H &&
                  dst.size(2) == G && dst.size(4) == 16 && dst.size(5) == 2,
              "ckpt_pairs_bf16_: dst must be a contiguous bfloat16 (B, H, K·V/16, P, 16, 2) = (",
              B, ", ", H, ", ", G, ", P, 16, 2), got ", dst.sizes());
  const int64_t P = dst.size(3);
  TORCH_CHECK(offset >= 0 && offset + n <= 2 * P, "ckpt_pairs_bf16_: offset ", offset, " + ", n,
              " checkpoints past 2P = ", 2 * P);
  if (n == 0 || B == 0 || H == 0) return dst;
  const float* sp = src.data_ptr<float>();
  uint32_t* dp = reinterpret_cast<uint32_t*>(dst.data_ptr());  // a checkpoint pair per 32 bits
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const int64_t p0 = offset / 2, np = (offset + n - 1) / 2 - p0 + 1;  // the pairs touched
  at::parallel_for(0, B * H * np, std::max<int64_t>(1, 2048 / std::max<int64_t>(1, K * V)),
                   [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (H * np), h = u / np % H, p = p0 + u % np;
      const int64_t i0 = 2 * p - offset, i1 = i0 + 1;  // src rows of the pair's two halves
      const bool in0 = i0 >= 0 && i0 < n, in1 = i1 >= 0 && i1 < n;
      const uint32_t* a = in0 ? reinterpret_cast<const uint32_t*>(sp + b * s0 + i0 * s1 + h * s2)
                              : nullptr;
      const uint32_t* c = in1 ? reinterpret_cast<const uint32_t*>(sp + b * s0 + i1 * s1 + h * s2)
                              : nullptr;
      uint32_t* d = dp + (b * H + h) * G * P * 16 + p * 16;
      for (int64_t g = 0; g < G; ++g, d += P * 16) {
        v16u x{}, y{};
        if (a) std::memcpy(&x, a + 16 * g, sizeof x);
        if (c) std::memcpy(&y, c + 16 * g, sizeof y);
        const v16u lo = bf16_bits(x), hi = bf16_bits(y) << 16;
        v16u out;
        if (a && c) {
          out = lo | hi;
        } else {  // one half from another part: keep what is there
          std::memcpy(&out, d, sizeof out);
          out = a ? (out & 0xFFFF0000u) | lo : (out & 0x0000FFFFu) | hi;
        }
        std::memcpy(d, &out, sizeof out);
      }
    }
  });
  return dst;
}

torch::Tensor packed_rows(const torch::Tensor& P, const torch::Tensor& scales,
                          const torch::Tensor& idx, int64_t K) {
  const bool is_int8 = P.scalar_type() == torch::kChar;
  TORCH_CHECK(is_int8 || P.scalar_type() == torch::kBFloat16,
              "packed_rows: an int8 or bfloat16 packed weight expected, got ", P.scalar_type());
  check_packed(P, scales, K, P.scalar_type(), "packed_rows");
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == torch::kInt64 && idx.dim() == 1,
              "packed_rows: idx must be a 1-D int64 CPU tensor");
  const int64_t N = scales.numel(), KP = P.size(1), T = idx.size(0);
  auto ix = idx.contiguous();
  const int64_t* ip = ix.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "packed_rows: row ", ip[t], " outside [0, ", N, ")");
  auto out = torch::empty({T, K}, scales.options());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto* i8 = static_cast<const int8_t*>(P.data_ptr());
  const auto* b16 = static_cast<const uint16_t*>(P.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = ip[t];
      const int64_t base = ((n / 16) * KP * 16 + n % 16) * 2;  // pair p at base + 32p
      const float s = sp[n];
      float* o = op + t * K;
      for (int64_t c = 0; c < K; ++c) {
        const int64_t at = base + (c / 2) * 32 + c % 2;
        float v;
        if (is_int8) {
          v = static_cast<float>(i8[at]);
        } else {
          const uint32_t bits = static_cast<uint32_t>(b16[at]) << 16;
          std::memcpy(&v, &bits, sizeof v);
        }
        o[c] = v * s;
      }
    }
  });
  return out;
}

}  // namespace mcserve_lowp
