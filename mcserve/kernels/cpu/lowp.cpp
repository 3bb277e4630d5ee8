// Weight-only low-precision matrix products for mcserve's CPU decode (see lowp.h and
// docs/cpu-kernels.md, "Low-precision weights").
//
// A decode step reads every weight once per token: at a few rows it is bound by the bytes of
// weights read, so int8 weights (a quarter of float32's bytes) and bfloat16 weights (half) make
// it faster, provided the arithmetic keeps up at 8-16 rows too.
//
// Layout (pack_pairs in twins.py): the weight (N, K) in blocks of 16 output rows, each block
// k-pair by k-pair: P[N/16][K/2][16][2] (zero-padded). One vector load gives 16 outputs × 2
// values of k, which the dot-product instructions multiply by a broadcast pair of x: the 16
// lanes of an accumulator are 16 outputs, so no horizontal sums, each block's weights are one
// sequential stream, and an input row costs a 4-byte broadcast per step. A tile is R blocks × NB
// input rows of accumulators; each output is one chain of additions over k whatever the tile,
// so a row gives the same result at any batch size.
//
// int8: per-output-channel scales sw; each input row is quantized to int16 with its own scale sx
// (|code| <= q8_xmax(K): every partial sum fits in int32), and the dot products are exact
// integer sums: AVX-512 VNNI's vpdpwssd (int16 pairs into int32), or AVX-512BW / AVX2 vpmaddwd +
// vpaddd, or a scalar loop. y = (double) sum · (sx · sw) + bias, rounded to float. Every
// implementation and every batch size give bit-identical rows.
//
// bfloat16: AMX-BF16's tile products (amx.cpp: the packed blocks are its weight tiles as they
// are) or AVX512-BF16's vdpbf16ps (both: x rounded to bfloat16, products exact, float32 sums),
// or the weights widened to float32 (16-bit shifts) and multiplied with the float32 x by FMA
// (AVX-512F, AVX2), or a scalar loop; y = sum · s + bias (s is 1 for plain bfloat16 weights).
//
// Portability: the vector code is compiled per instruction set with target attributes, whatever
// -march the file is built with, and chosen at run time from what the CPU reports
// (__builtin_cpu_supports, which also checks that the OS saves the AVX-512 registers), capped by
// set_cap (MCSERVE_CPU_ISA); each implementation is checked against the scalar one on a small
// random problem at first use, and one that disagrees is never used.
#include "lowp.h"
#include "vmath.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

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
  bool avx2 = false, avx512 = false, vnni = false, bf16 = false, amx = false;
  std::string amx_note;  // why AMX-BF16 is not used, when it is not
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
  // level 4 implies level 3's instructions (outer_bf16_, the BF16 conversions): every AMX CPU
  // has them, a VM that hides them loses both
  if (f.bf16) f.amx = amx_bf16_usable(&f.amx_note);
  else f.amx_note = "no AVX512-BF16";
  return f;
}

// detect() once: the AMX permission request is a system call
const Features& features() {
  static const Features f = detect();
  return f;
}

std::atomic<int> g_cap{4};      // highest level set_cap allows (MCSERVE_CPU_ISA)
int g_q8_max = 0, g_bf_max = 0;  // highest level the CPU runs and the self-test passed
std::string g_probe_note;
std::once_flag g_probe_once;
void probe();

}  // namespace

int q8_best() {
  std::call_once(g_probe_once, probe);
  return std::min(g_q8_max, g_cap.load());
}
int bf16_level() {
  std::call_once(g_probe_once, probe);
  return std::min(g_bf_max, g_cap.load());
}

namespace {

// ------------------------------------------------------------------------ int8
// the largest |code| of a quantized input row of K: every partial sum of a dot product then
// fits in int32 (K · 127 · code < 2^31), whatever order the kernels add in: the full int16 range
// below K = 517, 14 bits at K = 768, 10 bits at K = 16384 (far finer than the weights' 8 bits)
inline int32_t q8_xmax(int64_t K) {
  return static_cast<int32_t>(
      std::min<int64_t>(32767, 2147483647LL / (127 * std::max<int64_t>(K, 1))));
}

// x (B, K) → xq (B, Kx) int16 (zero-padded to Kx) and sx (B,) with x ≈ sx · xq; an all-zero row
// gets sx = 0, a row holding inf or NaN gets sx = NaN (its outputs are NaN)
void quantize_rows(const float* x, int64_t B, int64_t K, int16_t* xq, int64_t Kx, float* sx) {
  const float fqm = static_cast<float>(q8_xmax(K));
  for (int64_t b = 0; b < B; ++b) {
    const float* r = x + b * K;
    int16_t* q = xq + b * Kx;
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float a = std::fabs(r[k]);
      finite = finite && a <= std::numeric_limits<float>::max();
      amax = a > amax ? a : amax;
    }
    if (!finite || amax == 0.f) {
      std::memset(q, 0, sizeof(int16_t) * Kx);
      sx[b] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float inv = fqm / amax;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(r[k] * inv);
      v = std::min(std::max(v, -fqm), fqm);
      q[k] = static_cast<int16_t>(v);
    }
    for (int64_t k = K; k < Kx; ++k) q[k] = 0;
    sx[b] = amax / fqm;
  }
}

inline int32_t pair_of(const int16_t* p) {  // two int16 as one int32 lane (little-endian)
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

constexpr int kL = 16;  // outputs per block

// A tile: R blocks of packed weights (P: the first block, KP pair-steps each) × NB input rows
// (stride Kx), sums into out[(r * NB + b) * 16 + lane]. Tile shapes per implementation: kMaxNB
// input rows at most, R(nb) blocks (registers: R · NB accumulators and the broadcasts).
struct Q8Scalar {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int) { return 1; }
  template <int R, int NB>
  __attribute__((noinline)) static void tile(const int8_t* P, int64_t KP, const int16_t* xq,
                                             int64_t Kx, int32_t* out) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        for (int l = 0; l < kL; ++l) {
          int32_t s = 0;  // exact: every partial sum fits (q8_xmax)
          const int8_t* w = P + r * KP * 2 * kL + 2 * l;
          const int16_t* x = xq + b * Kx;
          for (int64_t kp = 0; kp < KP; ++kp)
            s += w[kp * 2 * kL] * x[2 * kp] + w[kp * 2 * kL + 1] * x[2 * kp + 1];
          out[(r * NB + b) * kL + l] = s;
        }
  }
};

#ifdef MCSERVE_X86

// The AVX-512 tile body: W(r, kp) is block r's 16 × 2 weights at step kp as a vector, X(b, kp)
// input row b's broadcast pair, DOT(acc, w, x) accumulates (VA: accumulators, VI: the integer
// vectors of w and x); acc[r][b] is stored at the end.
#define MC_TILE512(VA, VI, ZERO, W, X, DOT, STORE)                                \
  VA acc[R][NB];                                                                  \
  for (int r = 0; r < R; ++r)                                                     \
    for (int b = 0; b < NB; ++b) acc[r][b] = ZERO;                                \
  for (int64_t kp = 0; kp < KP; ++kp) {                                           \
    VI xb[NB];                                                                    \
    for (int b = 0; b < NB; ++b) xb[b] = X(b, kp);                                \
    for (int r = 0; r < R; ++r) {                                                 \
      const VI w = W(r, kp);                                                      \
      for (int b = 0; b < NB; ++b) acc[r][b] = DOT(acc[r][b], w, xb[b]);          \
    }                                                                             \
  }                                                                               \
  for (int r = 0; r < R; ++r)                                                     \
    for (int b = 0; b < NB; ++b) STORE(out + (r * NB + b) * kL, acc[r][b]);

#define MC_Q8_W(r, kp)       \
  _mm512_cvtepi8_epi16(      \
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P + ((r) * KP + (kp)) * 2 * kL)))
#define MC_PAIR_X(b, kp) _mm512_set1_epi32(pair_of(xq + (b) * Kx + 2 * (kp)))
#define MC_STORE_I(p, v) _mm512_storeu_si512(p, v)

struct Q8Vnni {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int nb) { return nb >= 8 ? 2 : 4; }
  template <int R, int NB>
  __attribute__((target(MC_AVX512 ",avx512vnni"), noinline)) static void tile(
      const int8_t* P, int64_t KP, const int16_t* xq, int64_t Kx, int32_t* out) {
#define MC_DOT(a, w, x) _mm512_dpwssd_epi32(a, w, x)
    MC_TILE512(__m512i, __m512i, _mm512_setzero_si512(), MC_Q8_W, MC_PAIR_X, MC_DOT, MC_STORE_I)
#undef MC_DOT
  }
};

struct Q8Avx512 {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int nb) { return nb >= 8 ? 2 : 4; }
  template <int R, int NB>
  __attribute__((target(MC_AVX512), noinline)) static void tile(
      const int8_t* P, int64_t KP, const int16_t* xq, int64_t Kx, int32_t* out) {
#define MC_DOT(a, w, x) _mm512_add_epi32(a, _mm512_madd_epi16(w, x))
    MC_TILE512(__m512i, __m512i, _mm512_setzero_si512(), MC_Q8_W, MC_PAIR_X, MC_DOT, MC_STORE_I)
#undef MC_DOT
  }
};

// AVX2: a block is two 8-lane halves
struct Q8Avx2 {
  static constexpr int kMaxNB = 4;
  static constexpr int R(int nb) { return nb >= 4 ? 1 : nb >= 2 ? 2 : 4; }
  template <int R, int NB>
  __attribute__((target("avx2,fma"), noinline)) static void tile(
      const int8_t* P, int64_t KP, const int16_t* xq, int64_t Kx, int32_t* out) {
    __m256i acc[R][NB][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_si256();
    for (int64_t kp = 0; kp < KP; ++kp) {
      __m256i xb[NB];
      for (int b = 0; b < NB; ++b) xb[b] = _mm256_set1_epi32(pair_of(xq + b * Kx + 2 * kp));
      for (int r = 0; r < R; ++r) {
        const int8_t* p = P + (r * KP + kp) * 2 * kL;
        const __m256i lo =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i hi =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kL)));
        for (int b = 0; b < NB; ++b) {
          acc[r][b][0] = _mm256_add_epi32(acc[r][b][0], _mm256_madd_epi16(lo, xb[b]));
          acc[r][b][1] = _mm256_add_epi32(acc[r][b][1], _mm256_madd_epi16(hi, xb[b]));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) {
        int32_t* o = out + (r * NB + b) * kL;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), acc[r][b][0]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8), acc[r][b][1]);
      }
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

// A tile as above on bfloat16 blocks; x: float32 rows of stride Kx (even, zero-padded), or the
// bfloat16 copy for the dot-product kernel
struct BfScalar {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int) { return 1; }
  using X = float;
  template <int R, int NB>
  __attribute__((noinline)) static void tile(const uint16_t* P, int64_t KP, const float* x,
                                             int64_t Kx, float* out) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        for (int l = 0; l < kL; ++l) {
          float s = 0.f;
          const uint16_t* w = P + r * KP * 2 * kL + 2 * l;
          const float* xr = x + b * Kx;
          for (int64_t kp = 0; kp < KP; ++kp) {
            s += bf16_to_float(w[kp * 2 * kL]) * xr[2 * kp];
            s += bf16_to_float(w[kp * 2 * kL + 1]) * xr[2 * kp + 1];
          }
          out[(r * NB + b) * kL + l] = s;
        }
  }
};

#ifdef MCSERVE_X86
// FMA: the even-k weight of each pair is the low 16 bits of a 32-bit lane, the odd-k the high
struct BfAvx512 {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int nb) { return nb >= 8 ? 1 : nb >= 4 ? 2 : 4; }
  using X = float;
  template <int R, int NB>
  __attribute__((target(MC_AVX512), noinline)) static void tile(
      const uint16_t* P, int64_t KP, const float* x, int64_t Kx, float* out) {
    __m512 acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
    const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t kp = 0; kp < KP; ++kp) {
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_loadu_si512(P + (r * KP + kp) * 2 * kL);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
        for (int b = 0; b < NB; ++b) {
          acc[r][b] = _mm512_fmadd_ps(we, _mm512_set1_ps(x[b * Kx + 2 * kp]), acc[r][b]);
          acc[r][b] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[b * Kx + 2 * kp + 1]), acc[r][b]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + (r * NB + b) * kL, acc[r][b]);
  }
};

struct BfAvx2 {  // 16 ymm registers: 8 accumulators, 4 weight halves, 2 broadcasts, the mask
  static constexpr int kMaxNB = 4;
  static constexpr int R(int nb) { return nb >= 2 ? 1 : 2; }
  using X = float;
  template <int R, int NB>
  __attribute__((target("avx2,fma"), noinline)) static void tile(
      const uint16_t* P, int64_t KP, const float* x, int64_t Kx, float* out) {
    __m256 acc[R][NB][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t kp = 0; kp < KP; ++kp) {
      for (int r = 0; r < R; ++r) {
        __m256 we[2], wo[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(P + (r * KP + kp) * 2 * kL + h * kL));
          we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
        }
        for (int b = 0; b < NB; ++b) {
          const __m256 xe = _mm256_broadcast_ss(x + b * Kx + 2 * kp);
          const __m256 xo = _mm256_broadcast_ss(x + b * Kx + 2 * kp + 1);
          for (int h = 0; h < 2; ++h) {
            acc[r][b][h] = _mm256_fmadd_ps(we[h], xe, acc[r][b][h]);
            acc[r][b][h] = _mm256_fmadd_ps(wo[h], xo, acc[r][b][h]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(out + (r * NB + b) * kL + 8 * h, acc[r][b][h]);
  }
};

#ifdef MCSERVE_BF16_DP
// vdpbf16ps: x rounded to bfloat16 (a zero-padded copy of stride Kx)
struct BfDot {
  static constexpr int kMaxNB = 8;
  static constexpr int R(int nb) { return nb >= 8 ? 2 : 4; }
  using X = uint16_t;
  template <int R, int NB>
  __attribute__((target(MC_AVX512 ",avx512bf16"), noinline)) static void tile(
      const uint16_t* P, int64_t KP, const uint16_t* x, int64_t Kx, float* out) {
    const int16_t* xq = reinterpret_cast<const int16_t*>(x);
#define MC_W(r, kp) _mm512_loadu_si512(P + ((r) * KP + (kp)) * 2 * kL)
#define MC_DOT(a, w, xv) _mm512_dpbf16_ps(a, (__m512bh)(w), (__m512bh)(xv))
    MC_TILE512(__m512, __m512i, _mm512_setzero_ps(), MC_W, MC_PAIR_X, MC_DOT, _mm512_storeu_ps)
#undef MC_W
#undef MC_DOT
  }
};
#endif  // MCSERVE_BF16_DP
#endif  // MCSERVE_X86

// ------------------------------------------------------------------------ driver
// at least this many bytes of weights per parallel task: fewer cost more in threads than saved
constexpr int64_t kGrainBytes = 64 << 10;
constexpr int64_t kUnit = 4;  // blocks per parallel task unit

// the input rows a tile takes from `left` rows: kMaxNB, 4, 2 or 1
template <class Impl>
inline int tile_rows(int64_t left) {
  return left >= Impl::kMaxNB ? Impl::kMaxNB : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

template <class Impl, int NB, class W, class X, class Acc>
inline int run_nb(int64_t left_blocks, const W* P, int64_t KP, const X* x, int64_t Kx,
                  Acc* out) {
  constexpr int R = Impl::R(NB);
  if (R > 1 && left_blocks >= R) {
    Impl::template tile<R, NB>(P, KP, x, Kx, out);
    return R;
  }
  Impl::template tile<1, NB>(P, KP, x, Kx, out);
  return 1;
}

// the tile of nb input rows over blocks P .. (as many as the shape takes, at most left_blocks):
// returns how many blocks it covered
template <class Impl, class W, class X, class Acc>
inline int run_tile(int nb, int64_t left_blocks, const W* P, int64_t KP, const X* x, int64_t Kx,
                    Acc* out) {
  switch (nb) {
    case 8:
      if constexpr (Impl::kMaxNB >= 8) return run_nb<Impl, 8>(left_blocks, P, KP, x, Kx, out);
      break;
    case 4:
      if constexpr (Impl::kMaxNB >= 4) return run_nb<Impl, 4>(left_blocks, P, KP, x, Kx, out);
      break;
    case 2: return run_nb<Impl, 2>(left_blocks, P, KP, x, Kx, out);
    default: break;
  }
  return run_nb<Impl, 1>(left_blocks, P, KP, x, Kx, out);
}

// y from packed weights P (NBk blocks of KP pair-steps) and inputs x (B rows of stride Kx):
// epi(out, block, blocks, row, rows) stores a tile's outputs. Loops, outermost first: a thread's
// range of blocks; chunks of input rows (~256 KiB, stay in L2); groups of blocks (~256 KiB of
// weights, read from memory once per chunk, then from L2); tiles of input rows (stay in L1); the
// group's blocks, each streamed once per tile.
template <class Impl, class W, class X, class Acc, class Epi>
void drive(const W* P, int64_t NBk, int64_t KP, const X* x, int64_t Kx, int64_t B,
           const Epi& epi) {
  const int64_t blk_bytes = KP * 2 * kL * static_cast<int64_t>(sizeof(W));
  const int64_t units = (NBk + kUnit - 1) / kUnit;
  const int64_t grain =
      std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, blk_bytes * kUnit));
  const int64_t row_bytes = Kx * static_cast<int64_t>(sizeof(X));
  const int64_t chunk =
      std::min(B, std::max<int64_t>(8, (256 << 10) / std::max<int64_t>(1, row_bytes) / 8 * 8));
  const int64_t group = std::max<int64_t>(kUnit, (256 << 10) / std::max<int64_t>(1, blk_bytes));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    alignas(64) Acc out[4 * 8 * kL];
    const int64_t j_end = std::min(NBk, u1 * kUnit);
    for (int64_t c0 = 0; c0 < B; c0 += chunk) {
      const int64_t c1 = std::min(B, c0 + chunk);
      for (int64_t g0 = u0 * kUnit; g0 < j_end; g0 += group) {
        const int64_t g1 = std::min(j_end, g0 + group);
        for (int64_t r0 = c0; r0 < c1;) {
          const int nb = tile_rows<Impl>(c1 - r0);
          for (int64_t j = g0; j < g1;) {
            const int nr =
                run_tile<Impl>(nb, g1 - j, P + j * KP * 2 * kL, KP, x + r0 * Kx, Kx, out);
            epi(out, j, nr, r0, nb);
            j += nr;
          }
          r0 += nb;
        }
      }
    }
  });
}

// the outputs of a tile into y (B, N): f(acc, row, output)
template <class Acc, class F>
inline void store_tile(const Acc* out, int64_t j, int nr, int64_t r0, int nb, int64_t N,
                       float* y, const F& f) {
  for (int r = 0; r < nr; ++r)
    for (int b = 0; b < nb; ++b) {
      const int64_t n0 = (j + r) * kL;
      const int64_t n1 = std::min<int64_t>(N, n0 + kL);
      float* yr = y + (r0 + b) * N;
      const Acc* o = out + (r * nb + b) * kL;
      for (int64_t n = n0; n < n1; ++n) yr[n] = f(o[n - n0], r0 + b, n);
    }
}

template <class Impl>
void q8_drive(const int8_t* P, int64_t N, int64_t KP, const int16_t* xq, int64_t Kx, int64_t B,
              const float* sx, const float* sw, const float* bias, float* y) {
  const int64_t NBk = (N + kL - 1) / kL;
  drive<Impl, int8_t, int16_t, int32_t>(
      P, NBk, KP, xq, Kx, B, [&](const int32_t* out, int64_t j, int nr, int64_t r0, int nb) {
        store_tile(out, j, nr, r0, nb, N, y, [&](int32_t acc, int64_t b, int64_t n) {
          const float s = sx[b] * sw[n];
          const float v = static_cast<float>(static_cast<double>(acc) * s);
          return bias ? v + bias[n] : v;
        });
      });
}

template <class Impl>
void bf_drive(const uint16_t* P, int64_t N, int64_t KP, const typename Impl::X* x, int64_t Kx,
              int64_t B, const float* sw, const float* bias, float* y) {
  const int64_t NBk = (N + kL - 1) / kL;
  drive<Impl, uint16_t, typename Impl::X, float>(
      P, NBk, KP, x, Kx, B, [&](const float* out, int64_t j, int nr, int64_t r0, int nb) {
        store_tile(out, j, nr, r0, nb, N, y, [&](float acc, int64_t, int64_t n) {
          const float v = acc * sw[n];
          return bias ? v + bias[n] : v;
        });
      });
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// a scratch buffer of n elements of T (not zeroed: the callers write every element), its start
// 64-byte aligned
template <class T>
T* scratch(torch::Tensor& holder, int64_t n) {
  holder = torch::empty({n * static_cast<int64_t>(sizeof(T)) + 64}, torch::kUInt8);
  auto p = reinterpret_cast<uintptr_t>(holder.data_ptr());
  return reinterpret_cast<T*>((p + 63) / 64 * 64);
}

}  // namespace

void q8_raw(const float* x, int64_t B, int64_t K, const int8_t* P, int64_t N, int64_t KP,
            const float* sw, const float* bias, float* y, int impl) {
  const int64_t Kx = round_up(2 * KP, 32);  // 64-byte rows
  torch::Tensor buf;
  int16_t* xq = scratch<int16_t>(buf, B * Kx);
  std::vector<float> sx(static_cast<size_t>(B));
  quantize_rows(x, B, K, xq, Kx, sx.data());
  switch (impl) {
#ifdef MCSERVE_X86
    case 3: return q8_drive<Q8Vnni>(P, N, KP, xq, Kx, B, sx.data(), sw, bias, y);
    case 2: return q8_drive<Q8Avx512>(P, N, KP, xq, Kx, B, sx.data(), sw, bias, y);
    case 1: return q8_drive<Q8Avx2>(P, N, KP, xq, Kx, B, sx.data(), sw, bias, y);
#endif
    default: return q8_drive<Q8Scalar>(P, N, KP, xq, Kx, B, sx.data(), sw, bias, y);
  }
}

void bf_raw(const float* x, int64_t B, int64_t K, const uint16_t* P, int64_t N, int64_t KP,
            const float* sw, const float* bias, float* y, int impl) {
  const int64_t Kx = round_up(2 * KP, 32);
  torch::Tensor buf;
  if (impl >= 3) {  // x rounded to bfloat16; AMX's tiles take whole tiles of 16 rows
    const int64_t rows = impl == 4 ? round_up(B, 16) : B;
    uint16_t* xb = scratch<uint16_t>(buf, rows * Kx);
    at::parallel_for(0, B, std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, 4 * K)),
                     [&](int64_t b0, int64_t b1) {
                       for (int64_t b = b0; b < b1; ++b) {
                         mcserve_ops::to_bf16(x + b * K, xb + b * Kx, K);
                         std::memset(xb + b * Kx + K, 0, sizeof(uint16_t) * (Kx - K));
                       }
                     });
    std::memset(xb + B * Kx, 0, sizeof(uint16_t) * (rows - B) * Kx);
    if (impl == 4) return amx_bf16_rows(P, N, KP, xb, Kx, B, sw, bias, y);
#if defined(MCSERVE_X86) && defined(MCSERVE_BF16_DP)
    return bf_drive<BfDot>(P, N, KP, xb, Kx, B, sw, bias, y);
#endif
  }
  float* xf = scratch<float>(buf, B * Kx);  // rows padded to whole pairs with zeros
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(xf + b * Kx, x + b * K, sizeof(float) * K);
    std::memset(xf + b * Kx + K, 0, sizeof(float) * (Kx - K));
  }
  switch (impl) {
#ifdef MCSERVE_X86
    case 2: return bf_drive<BfAvx512>(P, N, KP, xf, Kx, B, sw, bias, y);
    case 1: return bf_drive<BfAvx2>(P, N, KP, xf, Kx, B, sw, bias, y);
#endif
    default: return bf_drive<BfScalar>(P, N, KP, xf, Kx, B, sw, bias, y);
  }
}

namespace {

// (N, K) weights into the packed layout (the reference for the self-test; twins.pack_pairs)
template <class T>
std::vector<T> pack(const std::vector<T>& w, int64_t N, int64_t K) {
  const int64_t NBk = (N + kL - 1) / kL, KP = (K + 1) / 2;
  std::vector<T> p(static_cast<size_t>(NBk * KP * 2 * kL), T(0));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      p[((n / kL * KP + k / 2) * kL + n % kL) * 2 + k % 2] = w[n * K + k];
  return p;
}

// ------------------------------------------------------------------------ self-test
// every level the CPU reports runs a small random problem (odd sizes, every tile shape) against
// the scalar kernel once; a level that disagrees (a CPU or VM that misreports a feature, a
// compiler bug) is never used
void probe() {
  const Features& f = features();
  int q8 = f.vnni ? 3 : f.avx512 ? 2 : f.avx2 ? 1 : 0;
  int bf = f.amx ? 4 : f.bf16 ? 3 : f.avx512 ? 2 : f.avx2 ? 1 : 0;
  const int64_t N = 75, K = 77, B = 13, KP = (K + 1) / 2;
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
  const auto qp = pack(q, N, K);
  const auto bp = pack(wb, N, K);
  q8_raw(x.data(), B, K, qp.data(), N, KP, sw.data(), bias.data(), want.data(), 0);
  for (int lvl = q8; lvl > 0; --lvl) {
    q8_raw(x.data(), B, K, qp.data(), N, KP, sw.data(), bias.data(), got.data(), lvl);
    if (std::memcmp(got.data(), want.data(), sizeof(float) * got.size()) == 0) break;
    g_probe_note += "int8 level " + std::to_string(lvl) + " disagreed with the scalar kernel; ";
    q8 = lvl - 1;
  }
  // bfloat16: against the scalar kernel on x rounded as the level rounds it
  std::vector<float> xr(x);
  for (int lvl = bf; lvl > 0; --lvl) {
    const bool rounds = lvl >= 3;
    for (size_t i = 0; i < x.size(); ++i)
      xr[i] = rounds ? static_cast<float>(c10::BFloat16(x[i])) : x[i];
    bf_raw(xr.data(), B, K, bp.data(), N, KP, sw.data(), bias.data(), want.data(), 0);
    bf_raw(x.data(), B, K, bp.data(), N, KP, sw.data(), bias.data(), got.data(), lvl);
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

}  // namespace

void set_cap(int level) { g_cap.store(level); }

pybind11::dict info() {
  const Features& f = features();
  pybind11::dict d;
  d["int8_impl"] = q8_best();
  d["bf16_impl"] = bf16_level();
  d["int8_max"] = g_q8_max;
  d["bf16_max"] = g_bf_max;
  d["cap"] = g_cap.load();
  d["avx2_fma"] = f.avx2;
  d["avx512"] = f.avx512;
  d["avx512_vnni"] = f.vnni;
  d["avx512_bf16"] = f.bf16;
  d["amx_bf16"] = f.amx;
  d["amx_note"] = f.amx_note;
  d["note"] = g_probe_note;
  return d;
}

}  // namespace mcserve_lowp
