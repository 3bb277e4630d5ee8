// Vector math of the CPU kernels: e^x, SiLU and the MLP activations over 16 floats in GCC vector types, so a pass
// over a row takes the vector registers of whatever -march the build targets (no intrinsics, no
// CPU feature assumed) instead of calling the scalar expf per element.
#pragma once

#include <cstdint>

namespace mcserve_ops {

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof v); }

inline v16f splat16(float x) { return v16f{} + x; }

// e^x: Cephes' single-precision polynomial on r = x - n·ln 2 (n the integer nearest x·log2 e),
// times 2^n through the exponent bits. 0 below -87.33 (and for -inf), inf above 88 (a little
// before float's own overflow at 88.72, so 2^n stays a normal float), NaN stays NaN.
inline v16f vexp(v16f x) {
  const v16i under = x < -87.3365f, over = x > 88.f, nan = x != x;
  x = under ? splat16(-87.3365f) : x;
  x = over ? splat16(88.f) : x;
  const v16f t = x * 1.44269504088896341f + 0.5f;
  v16i n = __builtin_convertvector(t, v16i);  // truncated toward zero
  n += __builtin_convertvector(n, v16f) > t;  // floor: one less where t was negative
  const v16f nf = __builtin_convertvector(n, v16f);
  v16f r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  v16f y = p * (v16f)((n + 127) << 23);
  y = (v16f)((v16i)y & ~under);
  y = over ? splat16(__builtin_inff()) : y;
  return nan ? x : y;
}

// bfloat16 bits (in the low half of each lane) of 16 floats given as their bits: round to
// nearest even, a NaN as 0x7FC0 (as c10::BFloat16 converts)
inline v16u bf16_bits(v16u u) {
  const v16u nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return nan ? v16u{} + 0x7FC0u : r;
}

// dst[0:n] = bfloat16(src[0:n]), 16 at a time
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16u u;
    __builtin_memcpy(&u, src + i, sizeof u);
    const v16u b = bf16_bits(u);
    for (int j = 0; j < 16; ++j) dst[i + j] = static_cast<uint16_t>(b[j]);
  }
  for (; i < n; ++i) {
    v16u u{};
    __builtin_memcpy(&u, src + i, sizeof(float));
    dst[i] = static_cast<uint16_t>(bf16_bits(u)[0]);
  }
}

// per lane acc < x ? x : acc, std::max(acc, x)'s choice: a NaN x leaves acc
inline v16f vmax_keep(v16f acc, v16f x) { return acc < x ? x : acc; }

// lanes i and i ^ h of v swapped (h = 8, 4, 2, 1): one step of a reduction by halving
template <int h>
inline v16f vswap(v16f v) {
#if defined(__clang__)
  return __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h,
                                 8 ^ h, 9 ^ h, 10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h);
#else
  return __builtin_shuffle(v, v16i{0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h, 8 ^ h,
                                   9 ^ h, 10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h});
#endif
}

// a lane mask (each lane 0 or -1) as 16 bits, lane i at bit i
inline unsigned lane_bits(v16i m) {
  const v16i bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  v16f b = (v16f)(m & bit);
  b = (v16f)((v16i)b | (v16i)vswap<8>(b));
  b = (v16f)((v16i)b | (v16i)vswap<4>(b));
  b = (v16f)((v16i)b | (v16i)vswap<2>(b));
  b = (v16f)((v16i)b | (v16i)vswap<1>(b));
  return static_cast<unsigned>(((v16i)b)[0]);
}

// x·sigmoid(x) = x / (1 + e^-x)
inline v16f vsilu(v16f x) { return x / (1.f + vexp(-x)); }

// an MLP's activation: 0 SiLU, 1 relu², 2 relu
inline v16f vact(v16f x, int act) {
  if (act == 1) {
    const v16f r = x > 0.f ? x : v16f{};
    return r * r;
  }
  if (act == 2) return x > 0.f ? x : v16f{};
  return vsilu(x);
}

}  // namespace mcserve_ops
