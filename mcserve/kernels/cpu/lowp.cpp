// Weight-only low-precision matrix products for mcserve's CPU decode (see lowp.h and
// docs/cpu-kernels.md, "Low-precision weights").
//
// A decode step reads every weight once per token: at a few rows it is bound by the bytes of
// weights read, so int8 weights (a quarter of float32's bytes) and bfloat16 weights (half) make
// it faster, provided the arithmetic keeps up. Each kernel streams the weight rows once per
// group of up to 8 input rows and keeps the partial sums of a tile of weight rows × input rows
// in registers.
//
// int8: per-output-channel scales sw; each input row is quantized to int16 with its own scale sx
// (|code| <= q8_xmax(K), which no int32 lane can overflow), and the dot products are exact
// integer sums: AVX-512 VNNI's vpdpwssd (int16 × int16 pairs into int32), or AVX-512BW / AVX2
// vpmaddwd + vpaddd, or a scalar loop. y = (double) sum · (sx · sw) + bias, rounded to float.
// Integer sums do not depend on the order of addition, so every implementation and every batch
// size give bit-identical rows (greedy decoding is batch-invariant by construction).
//
// bfloat16: AVX512-BF16's vdpbf16ps (x rounded to bfloat16, products exact, float32 sums), or
// the weights widened to float32 (a 16-bit shift) and multiplied with the float32 x by FMA
// (AVX-512F, AVX2) or a scalar loop. Every output has one accumulator vector and one order of
// additions whatever the tile, so a row gives the same result at any batch size.
//
// Portability: the vector code is compiled per instruction set with target attributes, whatever
// -march the file is built with, and chosen at run time from what the CPU reports
// (__builtin_cpu_supports, which also checks that the OS saves the AVX-512 registers), capped by
// set_cap (MCSERVE_CPU_ISA); each implementation is checked against the scalar one on a small
// random problem at first use, and one that disagrees is never used.
#include "lowp.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__x86_64__) || defined(_M_X64)
#define MCSERVE_X86 1
#include <immintrin.h>
#endif

// vdpbf16ps needs gcc >= 11 or clang >= 12 (the intrinsics and __builtin_cpu_supports name)
#if defined(MCSERVE_X86) && ((defined(__clang__) && __clang_major__ >= 12) || \
                             (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define MCSERVE_BF16_DP 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace mcserve_lowp {
namespace {

// ------------------------------------------------------------------------ CPU features
struct Features {
  bool avx2 = false, avx512 = false, vnni = false, bf16 = false;
};

Features detect() {
  Features f;
#ifdef MCSERVE_X86
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  f.vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
#ifdef MCSERVE_BF16_DP
  f.bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#endif
  return f;
}

std::atomic<int> g_cap{3};      // highest level set_cap allows (MCSERVE_CPU_ISA)
int g_q8_max = 0, g_bf_max = 0;  // highest level the CPU runs and the self-test passed
std::string g_probe_note;
std::once_flag g_probe_once;
void probe();

int q8_best() {
  std::call_once(g_probe_once, probe);
  return std::min(g_q8_max, g_cap.load());
}
int bf_best() {
  std::call_once(g_probe_once, probe);
  return std::min(g_bf_max, g_cap.load());
}

// ------------------------------------------------------------------------ int8
// the largest |code| of a quantized input row of K: every partial sum of a dot product then
// fits in int32 (K · 127 · code < 2^31), whatever order the kernels add in: the full int16 range
// below K = 517, 14 bits at K = 768, 10 bits at K = 16384 (far finer than the weights' 8 bits)
inline int32_t q8_xmax(int64_t K) {
  return static_cast<int32_t>(
      std::min<int64_t>(32767, 2147483647LL / (127 * std::max<int64_t>(K, 1))));
}

// x (B, K) → xq (B, Kp) int16 (zero-padded to Kp) and sx (B,) with x ≈ sx · xq; an all-zero row
// gets sx = 0, a row holding inf or NaN gets sx = NaN (its outputs are NaN)
void quantize_rows(const float* x, int64_t B, int64_t K, int16_t* xq, int64_t Kp, float* sx) {
  const int32_t qm = q8_xmax(K);
  const float fqm = static_cast<float>(qm);
  for (int64_t b = 0; b < B; ++b) {
    const float* r = x + b * K;
    int16_t* q = xq + b * Kp;
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float a = std::fabs(r[k]);
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = a > amax ? a : amax;
    }
    if (!finite || amax == 0.f) {
      std::memset(q, 0, sizeof(int16_t) * Kp);
      sx[b] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float inv = fqm / amax;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(r[k] * inv);
      v = std::min(std::max(v, -fqm), fqm);
      q[k] = static_cast<int16_t>(v);
    }
    for (int64_t k = K; k < Kp; ++k) q[k] = 0;
    sx[b] = amax / fqm;
  }
}

// A tile: one weight row w (K values) × NB input rows (row stride Kx), sums into out[b]. The
// weight row is read front to back once per tile (a sequential stream: tiles that read several
// weight rows side by side streamed from DRAM at a third of the rate). Two accumulators per
// output take alternate steps of k (two dependency chains at NB = 1) and are added at the end:
// the same additions for an output whatever NB is, so a row's result does not depend on the
// batch (bfloat16; the int8 sums are exact anyway).
struct Q8Scalar {
  static constexpr int kMaxNB = 8;
  template <int NB>
  __attribute__((noinline)) static void tile(const int8_t* w, int64_t K, const int16_t* xq,
                                             int64_t Kp, int32_t* out) {
    for (int b = 0; b < NB; ++b) {
      int64_t s = 0;
      const int16_t* xr = xq + b * Kp;
      for (int64_t k = 0; k < K; ++k) s += static_cast<int32_t>(w[k]) * xr[k];
      out[b] = static_cast<int32_t>(s);  // exact: fits (q8_xmax)
    }
  }
};

#ifdef MCSERVE_X86
#define MC_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"

// The sums of four accumulators, one per lane of the result: the same tree of additions for
// each whatever the other three hold, so an output does not depend on the tile it was part of.
// int32 sums wrap, which is exact here (every partial sum fits: q8_xmax).
__attribute__((target(MC_AVX512))) inline __m128i hsum4(__m512i a, __m512i b, __m512i c,
                                                        __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  // each 128-bit block now holds [a, b, c, d] partial sums
  const __m512i s =
      _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

__attribute__((target(MC_AVX512))) inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

__attribute__((target("avx2,fma"))) inline __m128i hsum4(__m256i a, __m256i b, __m256i c,
                                                        __m256i d) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

__attribute__((target("avx2,fma"))) inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The body of a vector tile. Per step of STEP values of k: W(k) loads the weight vector,
// X(b, k) input row b's; MASKED variants take the last K % STEP values (lanes beyond K zero).
// acc[b][0] takes the even steps, acc[b][1] the odd ones. Then out[b] = hsum(acc[b][0] + [1]).
#define MC_TILE_BODY(V, ZERO, STEP, W, WTAIL, X, XTAIL, DOT, ADD, T, STORE4)                \
  V acc[NB][2];                                                                               \
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = ZERO;                                  \
  int64_t k = 0;                                                                              \
  for (; k + 2 * STEP <= K; k += 2 * STEP) {                                                  \
    const V w0 = W(k), w1 = W(k + STEP);                                                      \
    for (int b = 0; b < NB; ++b) {                                                            \
      acc[b][0] = DOT(acc[b][0], w0, X(b, k));                                                \
      acc[b][1] = DOT(acc[b][1], w1, X(b, k + STEP));                                         \
    }                                                                                         \
  }                                                                                           \
  /* constant indices only: a variable one would keep acc in memory instead of registers */  \
  if (k + STEP <= K) {                                                                        \
    const V w0 = W(k);                                                                        \
    for (int b = 0; b < NB; ++b) acc[b][0] = DOT(acc[b][0], w0, X(b, k));                     \
    k += STEP;                                                                                \
    if (k < K) {                                                                              \
      const V w1 = WTAIL(k);                                                                  \
      for (int b = 0; b < NB; ++b) acc[b][1] = DOT(acc[b][1], w1, XTAIL(b, k));               \
    }                                                                                         \
  } else if (k < K) {                                                                         \
    const V w0 = WTAIL(k);                                                                    \
    for (int b = 0; b < NB; ++b) acc[b][0] = DOT(acc[b][0], w0, XTAIL(b, k));                 \
  }                                                                                           \
  for (int b = 0; b < NB; b += 4) {                                                           \
    const V s0 = ADD(acc[b][0], acc[b][1]);                                                   \
    const V s1 = b + 1 < NB ? ADD(acc[b + 1][0], acc[b + 1][1]) : ZERO;                       \
    const V s2 = b + 2 < NB ? ADD(acc[b + 2][0], acc[b + 2][1]) : ZERO;                       \
    const V s3 = b + 3 < NB ? ADD(acc[b + 3][0], acc[b + 3][1]) : ZERO;                       \
    alignas(16) T lanes[4];                                                                   \
    STORE4(lanes, hsum4(s0, s1, s2, s3));                                                     \
    for (int j = 0; j < 4 && b + j < NB; ++j) out[b + j] = lanes[j];                          \
  }

#define MC_STORE_I(p, v) _mm_store_si128(reinterpret_cast<__m128i*>(p), v)
// int8 on AVX-512: 32 weights per step widened to int16 (the tail masked; xq is zero-padded)
#define MC_Q8_W512(k) \
  _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k))))
#define MC_Q8_W512T(k) \
  _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << (K - (k))) - 1), \
                                               w + (k)))
#define MC_Q8_X512(b, k) _mm512_loadu_si512(xq + (b) * Kp + (k))

struct Q8Vnni {
  static constexpr int kMaxNB = 8;
  template <int NB>
  __attribute__((target(MC_AVX512 ",avx512vnni"), noinline)) static void tile(
      const int8_t* w, int64_t K, const int16_t* xq, int64_t Kp, int32_t* out) {
#define MC_DOT(a, x, y) _mm512_dpwssd_epi32(a, x, y)
    MC_TILE_BODY(__m512i, _mm512_setzero_si512(), 32, MC_Q8_W512, MC_Q8_W512T, MC_Q8_X512,
                 MC_Q8_X512, MC_DOT, _mm512_add_epi32, int32_t, MC_STORE_I)
#undef MC_DOT
  }
};

struct Q8Avx512 {
  static constexpr int kMaxNB = 8;
  template <int NB>
  __attribute__((target(MC_AVX512), noinline)) static void tile(
      const int8_t* w, int64_t K, const int16_t* xq, int64_t Kp, int32_t* out) {
#define MC_DOT(a, x, y) _mm512_add_epi32(a, _mm512_madd_epi16(x, y))
    MC_TILE_BODY(__m512i, _mm512_setzero_si512(), 32, MC_Q8_W512, MC_Q8_W512T, MC_Q8_X512,
                 MC_Q8_X512, MC_DOT, _mm512_add_epi32, int32_t, MC_STORE_I)
#undef MC_DOT
  }
};

// int8 on AVX2: 16 weights per step; no masked byte loads, so the tail is scalar (exact)
struct Q8Avx2 {
  static constexpr int kMaxNB = 4;  // 16 ymm registers
  template <int NB>
  __attribute__((target("avx2,fma"), noinline)) static void tile(
      const int8_t* w, int64_t K, const int16_t* xq, int64_t Kp, int32_t* out) {
    const int64_t Kv = K / 16 * 16;
    {
      const int64_t K = Kv;  // the vector part
#define MC_W(k) _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k))))
#define MC_X(b, k) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b) * Kp + (k)))
#define MC_DOT(a, x, y) _mm256_add_epi32(a, _mm256_madd_epi16(x, y))
      MC_TILE_BODY(__m256i, _mm256_setzero_si256(), 16, MC_W, MC_W, MC_X, MC_X, MC_DOT,
                   _mm256_add_epi32, int32_t, MC_STORE_I)
#undef MC_W
#undef MC_X
#undef MC_DOT
    }
    for (int b = 0; b < NB; ++b)
      for (int64_t j = Kv; j < K; ++j) out[b] += static_cast<int32_t>(w[j]) * xq[b * Kp + j];
  }
};
#endif  // MCSERVE_X86

// ------------------------------------------------------------------------ bfloat16
inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A tile as above: one bfloat16 weight row × NB input rows (X: float32 with stride Kx, or the
// bfloat16 copy for the dot-product kernel), float32 sums into out[b]
struct BfScalar {
  static constexpr int kMaxNB = 8;
  using X = float;
  template <int NB>
  __attribute__((noinline)) static void tile(const uint16_t* w, int64_t K, const float* x,
                                             int64_t Kx, float* out) {
    for (int b = 0; b < NB; ++b) {
      float s = 0.f;
      const float* xr = x + b * Kx;
      for (int64_t k = 0; k < K; ++k) s += bf16_to_float(w[k]) * xr[k];
      out[b] = s;
    }
  }
};

#ifdef MCSERVE_X86
struct BfAvx2 {
  static constexpr int kMaxNB = 4;
  using X = float;
  template <int NB>
  __attribute__((target("avx2,fma"), noinline)) static void tile(
      const uint16_t* w, int64_t K, const float* x, int64_t Kx, float* out) {
    const int64_t Kv = K / 8 * 8;
    {
      const int64_t K = Kv;  // the vector part
#define MC_W(k)                                                                    \
  _mm256_castsi256_ps(_mm256_slli_epi32(                                           \
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k)))), 16))
#define MC_X(b, k) _mm256_loadu_ps(x + (b) * Kx + (k))
#define MC_DOT(a, p, q) _mm256_fmadd_ps(p, q, a)
      MC_TILE_BODY(__m256, _mm256_setzero_ps(), 8, MC_W, MC_W, MC_X, MC_X, MC_DOT, _mm256_add_ps,
                   float, _mm_store_ps)
#undef MC_W
#undef MC_X
#undef MC_DOT
    }
    for (int b = 0; b < NB; ++b)
      for (int64_t j = Kv; j < K; ++j) out[b] += bf16_to_float(w[j]) * x[b * Kx + j];
  }
};

__attribute__((target(MC_AVX512))) inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

struct BfAvx512 {
  static constexpr int kMaxNB = 8;
  using X = float;
  template <int NB>
  __attribute__((target(MC_AVX512), noinline)) static void tile(
      const uint16_t* w, int64_t K, const float* x, int64_t Kx, float* out) {
#define MC_M16(k) static_cast<__mmask16>((1u << (K - (k))) - 1)
#define MC_W(k) widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k))))
#define MC_WT(k) widen_bf16(_mm256_maskz_loadu_epi16(MC_M16(k), w + (k)))
#define MC_X(b, k) _mm512_loadu_ps(x + (b) * Kx + (k))
#define MC_XT(b, k) _mm512_maskz_loadu_ps(MC_M16(k), x + (b) * Kx + (k))
#define MC_DOT(a, p, q) _mm512_fmadd_ps(p, q, a)
    MC_TILE_BODY(__m512, _mm512_setzero_ps(), 16, MC_W, MC_WT, MC_X, MC_XT, MC_DOT,
                 _mm512_add_ps, float, _mm_store_ps)
#undef MC_M16
#undef MC_W
#undef MC_WT
#undef MC_X
#undef MC_XT
#undef MC_DOT
  }
};

#ifdef MCSERVE_BF16_DP
// vdpbf16ps: x rounded to bfloat16 (a zero-padded copy of stride Kx, a multiple of 32)
struct BfDot {
  static constexpr int kMaxNB = 8;
  using X = uint16_t;
  template <int NB>
  __attribute__((target(MC_AVX512 ",avx512bf16"), noinline)) static void tile(
      const uint16_t* w, int64_t K, const uint16_t* x, int64_t Kx, float* out) {
#define MC_W(k) _mm512_loadu_si512(w + (k))
#define MC_WT(k) \
  _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << (K - (k))) - 1), w + (k))
#define MC_X(b, k) _mm512_loadu_si512(x + (b) * Kx + (k))
#define MC_DOT(a, p, q) _mm512_dpbf16_ps(a, (__m512bh)(p), (__m512bh)(q))
    using V = __m512i;
    __m512 acc[NB][2];
    for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const V w0 = MC_W(k), w1 = MC_W(k + 32);
      for (int b = 0; b < NB; ++b) {
        acc[b][0] = MC_DOT(acc[b][0], w0, MC_X(b, k));
        acc[b][1] = MC_DOT(acc[b][1], w1, MC_X(b, k + 32));
      }
    }
    if (k + 32 <= K) {  // constant indices only (see MC_TILE_BODY)
      const V w0 = MC_W(k);
      for (int b = 0; b < NB; ++b) acc[b][0] = MC_DOT(acc[b][0], w0, MC_X(b, k));
      k += 32;
      if (k < K) {
        const V w1 = MC_WT(k);
        for (int b = 0; b < NB; ++b) acc[b][1] = MC_DOT(acc[b][1], w1, MC_X(b, k));
      }
    } else if (k < K) {
      const V w0 = MC_WT(k);
      for (int b = 0; b < NB; ++b) acc[b][0] = MC_DOT(acc[b][0], w0, MC_X(b, k));
    }
#undef MC_W
#undef MC_WT
#undef MC_X
#undef MC_DOT
    for (int b = 0; b < NB; b += 4) {
      const __m512 z = _mm512_setzero_ps();
      const __m512 s0 = _mm512_add_ps(acc[b][0], acc[b][1]);
      const __m512 s1 = b + 1 < NB ? _mm512_add_ps(acc[b + 1][0], acc[b + 1][1]) : z;
      const __m512 s2 = b + 2 < NB ? _mm512_add_ps(acc[b + 2][0], acc[b + 2][1]) : z;
      const __m512 s3 = b + 3 < NB ? _mm512_add_ps(acc[b + 3][0], acc[b + 3][1]) : z;
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, hsum4(s0, s1, s2, s3));
      for (int j = 0; j < 4 && b + j < NB; ++j) out[b + j] = lanes[j];
    }
  }
};
#endif  // MCSERVE_BF16_DP
#endif  // MCSERVE_X86

// ------------------------------------------------------------------------ driver
// weight rows per parallel task unit
constexpr int64_t kR = 4;
// at least this many bytes of weights per parallel task: fewer cost more in threads than saved
constexpr int64_t kGrainBytes = 64 << 10;
// input rows per pass over the weights: their copy (~256 KiB) stays in L2 while the weights
// stream past, at large row counts (prefill)
inline int64_t chunk_rows(int64_t row_bytes, int64_t B) {
  const int64_t c = std::max<int64_t>(8, (256 << 10) / std::max<int64_t>(1, row_bytes) / 8 * 8);
  return std::min(B, c);
}

// the input rows a tile takes from `left` rows: kMaxNB, 4, 2 or 1
template <class Impl>
inline int64_t tile_rows(int64_t left) {
  return left >= Impl::kMaxNB ? Impl::kMaxNB : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

template <class Impl, class W, class X, class Acc>
inline void run_tile(int64_t nb, const W* w, int64_t K, const X* x, int64_t Kx, Acc* out) {
  switch (nb) {
    case 8:
      if constexpr (Impl::kMaxNB >= 8) Impl::template tile<8>(w, K, x, Kx, out);
      return;
    case 4: Impl::template tile<4>(w, K, x, Kx, out); return;
    case 2: Impl::template tile<2>(w, K, x, Kx, out); return;
    default: Impl::template tile<1>(w, K, x, Kx, out); return;
  }
}

// y (B, N) from weight rows W (N, K) and inputs x (B, Kx): epi(acc, b, n) stores an output.
// Loops, outermost first: a thread's range of weight rows; chunks of input rows (stay in L2);
// groups of weight rows (~256 KiB, read from memory once per chunk, then from L2); tiles of
// input rows (stay in L1); the group's rows, each streamed once per tile. The order of the
// additions inside an output is the tile's alone.
template <class Impl, class W, class X, class Acc, class Epi>
void drive(const W* Wp, int64_t N, int64_t K, int64_t w_bytes, const X* x, int64_t Kx, int64_t B,
           const Epi& epi) {
  const int64_t blocks = (N + kR - 1) / kR;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, w_bytes * kR));
  const int64_t chunk = chunk_rows(Kx * static_cast<int64_t>(sizeof(X)), B);
  const int64_t group = std::max<int64_t>(kR, (256 << 10) / std::max<int64_t>(1, w_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    Acc acc[8];
    const int64_t n_end = std::min(N, b1 * kR);
    for (int64_t c0 = 0; c0 < B; c0 += chunk) {
      const int64_t c1 = std::min(B, c0 + chunk);
      for (int64_t g0 = b0 * kR; g0 < n_end; g0 += group) {
        const int64_t g1 = std::min(n_end, g0 + group);
        for (int64_t r0 = c0; r0 < c1;) {
          const int64_t nb = tile_rows<Impl>(c1 - r0);
          for (int64_t n = g0; n < g1; ++n) {
            run_tile<Impl>(nb, Wp + n * K, K, x + r0 * Kx, Kx, acc);
            for (int64_t b = 0; b < nb; ++b) epi(acc[b], r0 + b, n);
          }
          r0 += nb;
        }
      }
    }
  });
}

template <class Impl>
void q8_drive(const int8_t* W, int64_t N, int64_t K, const int16_t* xq, int64_t Kp, int64_t B,
              const float* sx, const float* sw, const float* bias, float* y) {
  drive<Impl, int8_t, int16_t, int32_t>(W, N, K, K, xq, Kp, B, [&](int32_t acc, int64_t b,
                                                                   int64_t n) {
    const float s = sx[b] * sw[n];
    const float v = static_cast<float>(static_cast<double>(acc) * s);
    y[b * N + n] = bias ? v + bias[n] : v;
  });
}

template <class Impl>
void bf_drive(const uint16_t* W, int64_t N, int64_t K, const typename Impl::X* x, int64_t Kx,
              int64_t B, const float* bias, float* y) {
  drive<Impl, uint16_t, typename Impl::X, float>(W, N, K, 2 * K, x, Kx, B, [&](float acc,
                                                                              int64_t b,
                                                                              int64_t n) {
    y[b * N + n] = bias ? acc + bias[n] : acc;
  });
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

void q8_raw(const float* x, int64_t B, int64_t K, const int8_t* W, int64_t N, const float* sw,
            const float* bias, float* y, int impl) {
  const int64_t Kp = round_up(std::max<int64_t>(K, 1), 32);
  // 64-byte aligned rows (Kp is a multiple of 32 int16): no vector load splits a cache line
  auto buf = torch::empty({B * Kp + 32}, torch::kInt16);
  int16_t* xq = buf.data_ptr<int16_t>();
  xq += ((64 - reinterpret_cast<uintptr_t>(xq) % 64) % 64) / sizeof(int16_t);
  std::vector<float> sx(static_cast<size_t>(B));
  quantize_rows(x, B, K, xq, Kp, sx.data());
  switch (impl) {
#ifdef MCSERVE_X86
    case 3: return q8_drive<Q8Vnni>(W, N, K, xq, Kp, B, sx.data(), sw, bias, y);
    case 2: return q8_drive<Q8Avx512>(W, N, K, xq, Kp, B, sx.data(), sw, bias, y);
    case 1: return q8_drive<Q8Avx2>(W, N, K, xq, Kp, B, sx.data(), sw, bias, y);
#endif
    default: return q8_drive<Q8Scalar>(W, N, K, xq, Kp, B, sx.data(), sw, bias, y);
  }
}

void bf_raw(const float* x, int64_t B, int64_t K, const uint16_t* W, int64_t N,
            const float* bias, float* y, int impl) {
  switch (impl) {
#ifdef MCSERVE_X86
#ifdef MCSERVE_BF16_DP
    case 3: {
      const int64_t Kp = round_up(std::max<int64_t>(K, 1), 32);
      auto buf = torch::empty({B * Kp + 32}, torch::kInt16);
      uint16_t* xb = reinterpret_cast<uint16_t*>(buf.data_ptr<int16_t>());
      xb += ((64 - reinterpret_cast<uintptr_t>(xb) % 64) % 64) / sizeof(uint16_t);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t k = 0; k < K; ++k) xb[b * Kp + k] = c10::BFloat16(x[b * K + k]).x;
        for (int64_t k = K; k < Kp; ++k) xb[b * Kp + k] = 0;
      }
      return bf_drive<BfDot>(W, N, K, xb, Kp, B, bias, y);
    }
#endif
    case 2: return bf_drive<BfAvx512>(W, N, K, x, K, B, bias, y);
    case 1: return bf_drive<BfAvx2>(W, N, K, x, K, B, bias, y);
#endif
    default: return bf_drive<BfScalar>(W, N, K, x, K, B, bias, y);
  }
}

// ------------------------------------------------------------------------ self-test
// every level the CPU reports runs a small random problem (odd sizes, every tile shape) against
// the scalar kernel once; a level that disagrees (a CPU or VM that misreports a feature, a
// compiler bug) is never used
void probe() {
  const Features f = detect();
  int q8 = f.vnni ? 3 : f.avx512 ? 2 : f.avx2 ? 1 : 0;
  int bf = f.bf16 ? 3 : f.avx512 ? 2 : f.avx2 ? 1 : 0;
  const int64_t N = 11, K = 77, B = 13;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> x(B * K), sw(N), bias(N), want(B * N), got(B * N);
  std::vector<int8_t> q(N * K);
  std::vector<uint16_t> wb(N * K);
  for (auto& v : x) v = u(gen);
  for (auto& v : sw) v = 0.01f + std::fabs(u(gen));
  for (auto& v : bias) v = u(gen);
  for (auto& v : q) v = static_cast<int8_t>(std::lrint(127 * u(gen)));
  for (auto& v : wb) v = c10::BFloat16(u(gen)).x;
  q8_raw(x.data(), B, K, q.data(), N, sw.data(), bias.data(), want.data(), 0);
  for (int lvl = q8; lvl > 0; --lvl) {
    q8_raw(x.data(), B, K, q.data(), N, sw.data(), bias.data(), got.data(), lvl);
    if (std::memcmp(got.data(), want.data(), sizeof(float) * got.size()) == 0) break;
    g_probe_note += "int8 level " + std::to_string(lvl) + " disagreed with the scalar kernel; ";
    q8 = lvl - 1;
  }
  // bfloat16: against the scalar kernel on x rounded as the level rounds it
  std::vector<float> xr(x);
  for (int lvl = bf; lvl > 0; --lvl) {
    const bool rounds = lvl == 3;
    for (size_t i = 0; i < x.size(); ++i)
      xr[i] = rounds ? static_cast<float>(c10::BFloat16(x[i])) : x[i];
    bf_raw(xr.data(), B, K, wb.data(), N, bias.data(), want.data(), 0);
    bf_raw(x.data(), B, K, wb.data(), N, bias.data(), got.data(), lvl);
    bool ok = true;
    for (size_t i = 0; i < got.size(); ++i)
      ok = ok && std::fabs(got[i] - want[i]) <= 1e-4f * (1.f + std::fabs(want[i]));
    if (ok) break;
    g_probe_note += "bf16 level " + std::to_string(lvl) + " disagreed with the scalar kernel; ";
    bf = lvl - 1;
  }
  g_q8_max = q8;
  g_bf_max = bf;
}

void check_f32_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor, got ", t.scalar_type());
}

const float* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_f32_2d(*bias, "bias");
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bias (", N, ",) expected, got ",
              bias->sizes());
  return bias->data_ptr<float>();
}

int pick(int64_t impl, int best, const char* what) {
  if (impl < 0) return best;
  TORCH_CHECK(impl <= best, what, ": implementation ", impl, " is not available on this CPU "
              "(best: ", best, ")");
  return static_cast<int>(impl);
}

}  // namespace

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                        int64_t impl) {
  check_f32_2d(x, "x");
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == torch::kChar,
              "q8_linear: qweight must be an int8 CPU tensor, got ", qweight.scalar_type());
  check_f32_2d(scales, "scales");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1),
              "q8_linear: x (B, K) and qweight (N, K) expected, got ", x.sizes(), " and ",
              qweight.sizes());
  TORCH_CHECK(x.is_contiguous() && qweight.is_contiguous() && scales.is_contiguous(),
              "q8_linear: contiguous x, qweight and scales expected");
  const int64_t B = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(scales.numel() == N, "q8_linear: scales (", N, ",) expected, got ", scales.sizes());
  const float* bp = bias_ptr(bias, N);
  const int lvl = pick(impl, q8_best(), "q8_linear");
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  q8_raw(x.data_ptr<float>(), B, K, qweight.data_ptr<int8_t>(), N, scales.data_ptr<float>(), bp,
         y.data_ptr<float>(), lvl);
  return y;
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, int64_t impl) {
  check_f32_2d(x, "x");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16,
              "bf16_linear: weight must be a bfloat16 CPU tensor, got ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_linear: x (B, K) and weight (N, K) expected, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(),
              "bf16_linear: contiguous x and weight expected");
  const int64_t B = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bp = bias_ptr(bias, N);
  const int lvl = pick(impl, bf_best(), "bf16_linear");
  auto y = torch::empty({B, N}, x.options());
  if (B == 0 || N == 0) return y;
  bf_raw(x.data_ptr<float>(), B, K, reinterpret_cast<const uint16_t*>(weight.data_ptr()), N, bp,
         y.data_ptr<float>(), lvl);
  return y;
}

torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& W,
                         const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& bias) {
  if (W.scalar_type() == torch::kChar) {
    TORCH_CHECK(scales.has_value() && scales->defined(), "an int8 weight needs its scales");
    return q8_linear(x.contiguous(), W, *scales, bias, -1);
  }
  if (W.scalar_type() == torch::kBFloat16) return bf16_linear(x.contiguous(), W, bias, -1);
  return torch::Tensor();
}

void bind(pybind11::module& m) {
  m.def("q8_linear", &q8_linear, "x · (int8 weight · per-row scales)ᵀ + bias",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("impl") = -1);
  m.def("bf16_linear", &bf16_linear, "x · bfloat16 weightᵀ + bias, float32 accumulation",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("impl") = -1);
  m.def("lowp_set_cap", [](int64_t level) { g_cap.store(static_cast<int>(level)); },
        "highest implementation level the low-precision kernels may pick (0..3)");
  m.def("lowp_info", []() {
    const Features f = detect();
    pybind11::dict d;
    d["int8_impl"] = q8_best();
    d["bf16_impl"] = bf_best();
    d["int8_max"] = g_q8_max;
    d["bf16_max"] = g_bf_max;
    d["cap"] = g_cap.load();
    d["avx2_fma"] = f.avx2;
    d["avx512"] = f.avx512;
    d["avx512_vnni"] = f.vnni;
    d["avx512_bf16"] = f.bf16;
    d["note"] = g_probe_note;
    return d;
  }, "what the CPU reports, the implementations chosen and why any was dropped");
}

}  // namespace mcserve_lowp
