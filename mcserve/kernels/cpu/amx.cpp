// bfloat16 weight products on AMX tiles (lowp.h; lowp.cpp's implementation level 4).
//
// AMX's TDPBF16PS multiplies a tile of 16 rows × 32 bfloat16 (A) by a tile of 16 k-pairs × 16
// outputs × 2 (B) into 16 × 16 float32 sums (C). B's layout is exactly a block of lowp.cpp's
// packed weights: P[N/16][K/2][16][2] holds block j's pair-steps 16s .. 16s+15 as 16 rows of 64
// bytes, one tile load with stride 64 and no repacking. A is x rounded to bfloat16, rows padded
// with zeros to a multiple of 16 and to whole tiles of k. Each output is one chain of tile
// products over k in order, whatever the number of rows and however the blocks are split over
// threads, so a row gives the same result at any batch size (rows only share the tile).
//
// The MC prefill's bfloat16 cached readout (readout_bf16_amx_) runs on the same tiles: the left
// tile is built from the weighted queries bf16(w · q) 32 keys at a time, the right tiles are a
// checkpoint's key pairs, and the float32 sums of a tile of 16 tokens cover all its checkpoints.
//
// Where it runs: the CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7), the OS saves the tile
// state (XCR0 bits 17 and 18) and, on Linux, grants this process the tile data permission
// (arch_prctl ARCH_REQ_XCOMP_PERM): a VM or kernel that does not is found here, before any tile
// instruction runs. lowp.cpp's self-test then checks the level against the scalar kernel.
#include "lowp.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) &&            \
    ((defined(__clang__) && __clang_major__ >= 12) ||                           \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define MCSERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mcserve_lowp {

#ifdef MCSERVE_AMX
namespace {

constexpr int kL = 16;  // outputs per block, as lowp.cpp packs them

// ldtilecfg's 64-byte operand, palette 1
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: sums (row tile m, block n) at 2m + n; 4-5: x rows 0-15 and 16-31; 6-7: the blocks.
// `rows` (1..16): the rows of the sum and x tiles (fewer than 16 only when that is all there is)
__attribute__((target("amx-tile"))) void load_config(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// rows of one sum tile (16 floats each) times the block's scales, plus its bias, into y
__attribute__((target("avx512f"))) void store_rows(const float* c, int rows, float* y, int64_t N,
                                                   int64_t n0, int cols, const float* sw,
                                                   const float* bias) {
  const __mmask16 m = cols >= 16 ? static_cast<__mmask16>(0xFFFF)
                                 : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 s = _mm512_maskz_loadu_ps(m, sw + n0);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_mul_ps(_mm512_load_ps(c + r * 16), s);
    if (bias) v = _mm512_add_ps(v, bv);
    _mm512_mask_storeu_ps(y + r * N + n0, m, v);
  }
}

// MT row tiles (16 rows each) × NT blocks over `steps` pair-steps of 16 (A at x, stride lda
// bytes; block n's steps at B[n], 512 values apart), then one step from the zero-padded tails
// (tail[n], when not null); the sums into c (4 tiles of 16 × 16)
template <int MT, int NT>
__attribute__((target("amx-tile,amx-bf16"), noinline)) void tiles(
    const uint16_t* x, int64_t lda, const uint16_t* const* B, int64_t steps,
    const uint16_t* const* tail, float* c) {
  _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (MT > 1) _tile_zero(2);
  if (MT > 1 && NT > 1) _tile_zero(3);
  const int64_t last = steps + (tail != nullptr ? 1 : 0);
  for (int64_t s = 0; s < last; ++s) {
    const uint16_t* a = x + s * 32;
    _tile_loadd(4, a, lda);
    if (MT > 1) _tile_loadd(5, reinterpret_cast<const char*>(a) + 16 * lda, lda);
    const uint16_t* b0 = s < steps ? B[0] + s * 512 : tail[0];
    _tile_loadd(6, b0, 64);
    if (NT > 1) {
      const uint16_t* b1 = s < steps ? B[1] + s * 512 : tail[1];
      _tile_loadd(7, b1, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    if (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  if (NT > 1) _tile_stored(1, c + 256, 64);
  if (MT > 1) _tile_stored(2, c + 512, 64);
  if (MT > 1 && NT > 1) _tile_stored(3, c + 768, 64);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t* const*, int64_t,
                        const uint16_t* const*, float*);

TileFn tile_fn(int mt, int nt) {
  if (mt > 1) return nt > 1 ? &tiles<2, 2> : &tiles<2, 1>;
  return nt > 1 ? &tiles<1, 2> : &tiles<1, 1>;
}

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// The bfloat16 cached readout (readout_bf16_amx_): 16 tokens × NVT tiles of 16 outputs (NVT
// <= 4) summed over `n` checkpoints. Per checkpoint and 32 keys the left tile A = bf16(w · q) is
// built in `a` (16 rows of 32) with AVX512-BF16's conversion, then multiplied by each output
// tile's 16 key-pairs of the checkpoint (B, stride sb bytes) into sums 0..NVT-1; tiles 5-7 take
// the B tiles in turn. Rows of `a` at or beyond `rows` stay zero.
template <int NVT>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"), noinline)) void readout_tiles(
    const float* w, int64_t ws, const float* q, int64_t qs, int rows, int64_t n, int64_t K,
    const uint16_t* S, int64_t s_ckpt, int64_t sb, uint16_t* a, float* c) {
  for (int v = 0; v < NVT; ++v) {
    if (v == 0) _tile_zero(0);
    if (v == 1) _tile_zero(1);
    if (v == 2) _tile_zero(2);
    if (v == 3) _tile_zero(3);
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      for (int r = 0; r < rows; ++r) {
        const __m512 wv = _mm512_set1_ps(w[r * ws + j]);
        const float* qr = q + r * qs + k0;
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(qr), wv);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(qr + 16), wv);
        _mm512_store_si512(a + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
      _tile_loadd(4, a, 64);
      // key-pairs k0/2 .. k0/2 + 15 of checkpoint j, output tile v: rows of sb bytes
      const char* b = reinterpret_cast<const char*>(S + j * s_ckpt) + (k0 / 2) * sb;
      _tile_loadd(5, b, sb);
      _tile_dpbf16ps(0, 4, 5);
      if (NVT > 1) {
        _tile_loadd(6, b + 64, sb);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (NVT > 2) {
        _tile_loadd(7, b + 128, sb);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (NVT > 3) {
        _tile_loadd(5, b + 192, sb);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
  }
  _tile_stored(0, c, 64);
  if (NVT > 1) _tile_stored(1, c + 256, 64);
  if (NVT > 2) _tile_stored(2, c + 512, 64);
  if (NVT > 3) _tile_stored(3, c + 768, 64);
}

using ReadoutFn = void (*)(const float*, int64_t, const float*, int64_t, int, int64_t, int64_t,
                           const uint16_t*, int64_t, int64_t, uint16_t*, float*);

ReadoutFn readout_fn(int nvt) {
  switch (nvt) {
    case 1: return &readout_tiles<1>;
    case 2: return &readout_tiles<2>;
    case 3: return &readout_tiles<3>;
    default: return &readout_tiles<4>;
  }
}

// o rows += c, 16 outputs per tile
__attribute__((target("avx512f"))) void add_rows(const float* c, int rows, float* o, int64_t os,
                                                 int cols) {
  const __mmask16 m = cols >= 16 ? static_cast<__mmask16>(0xFFFF)
                                 : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < rows; ++r) {
    float* orow = o + r * os;
    _mm512_mask_storeu_ps(orow, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, orow),
                                                 _mm512_load_ps(c + r * 16)));
  }
}

}  // namespace

bool amx_bf16_usable(std::string* why) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) {
    if (why) *why = "no AMX-BF16";
    return false;
  }
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
    if (why) *why = "AMX-BF16 without OSXSAVE";
    return false;
  }
  if ((xcr0() & (3ull << 17)) != (3ull << 17)) {
    if (why) *why = "AMX-BF16, but the OS does not save the tile state";
    return false;
  }
  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (Linux 5.16 and later; the permission is the
  // process's, for all its threads)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    if (why) *why = "AMX-BF16, but the kernel refused the tile data permission";
    return false;
  }
  return true;
}

void amx_bf16_rows(const uint16_t* P, int64_t N, int64_t KP, const uint16_t* xb, int64_t Kx,
                   int64_t B, const float* sw, const float* bias, float* y) {
  const int64_t NBk = (N + kL - 1) / kL, steps = KP / 16, rem = KP % 16;
  const int64_t Bp = (B + 15) / 16 * 16;  // xb holds Bp rows, the ones beyond B zero
  // each block's last, partial pair-step zero-padded to a whole tile
  std::vector<uint16_t> tails(rem != 0 ? static_cast<size_t>(NBk * 512) : 0, 0);
  for (int64_t j = 0; rem != 0 && j < NBk; ++j)
    std::memcpy(tails.data() + j * 512, P + (j * KP + steps * 16) * 2 * kL,
                sizeof(uint16_t) * rem * 2 * kL);
  const int64_t lda = Kx * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t pairs = (NBk + 1) / 2;
  const int64_t pair_bytes = 2 * KP * 2 * kL * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, pair_bytes));
  // block pairs per group: ~512 KiB of weights, read from memory once per call and from L2
  // for every further tile of rows
  const int64_t group = std::max<int64_t>(1, (512 << 10) / std::max<int64_t>(1, pair_bytes));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    load_config(static_cast<int>(std::min<int64_t>(16, B)));
    alignas(64) float c[4 * 256];
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t m0 = 0; m0 < Bp;) {
        const int mt = Bp - m0 >= 32 ? 2 : 1;
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t j = 2 * p;
          const int nt = j + 1 < NBk ? 2 : 1;
          const uint16_t* b[2] = {P + j * KP * 2 * kL, P + (j + nt - 1) * KP * 2 * kL};
          const uint16_t* t[2] = {tails.data() + j * 512, tails.data() + (j + nt - 1) * 512};
          tile_fn(mt, nt)(xb + m0 * Kx, lda, b, steps, rem != 0 ? t : nullptr, c);
          for (int m = 0; m < mt; ++m)
            for (int n = 0; n < nt; ++n) {
              const int64_t r0 = m0 + 16 * m, n0 = (j + n) * kL;
              const int rows = static_cast<int>(std::min<int64_t>(16, B - r0));
              const int cols = static_cast<int>(std::min<int64_t>(kL, N - n0));
              if (rows > 0)
                store_rows(c + (2 * m + n) * 256, rows, y + r0 * N, N, n0, cols, sw, bias);
            }
        }
        m0 += 16 * mt;
      }
    }
    release();
  });
}

// readout_bf16_amx_'s pass, its arguments checked
static void readout_rows(float* o, int64_t os0, int64_t os1, const float* w, int64_t ws0,
                         int64_t ws1, const float* q, int64_t qs0, int64_t qs1,
                         const uint16_t* S, int64_t A, int64_t T, int64_t n, int64_t N, int64_t K,
                         int64_t V) {
  const int64_t tiles = (T + 15) / 16;
  const int64_t s_ckpt = (K / 2) * V * 2;  // bfloat16 values per checkpoint
  const int64_t sb = V * 2 * static_cast<int64_t>(sizeof(uint16_t));  // bytes per key-pair row
  // (head, tile of 16 tokens) units, head-major: a thread's tiles share their checkpoints
  const int64_t work = std::max<int64_t>(1, n * K * V);
  at::parallel_for(0, A * tiles, std::max<int64_t>(1, (1 << 20) / work), [&](int64_t u0,
                                                                             int64_t u1) {
    load_config(16);
    alignas(64) uint16_t a[16 * 32] = {};
    alignas(64) float c[4 * 256];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t h = u / tiles, t0 = (u % tiles) * 16;
      const int rows = static_cast<int>(std::min<int64_t>(16, T - t0));
      if (rows < 16) std::memset(a, 0, sizeof a);  // the rows past the tile's last token
      for (int64_t v0 = 0; v0 < V; v0 += 64) {
        const int nvt = static_cast<int>(std::min<int64_t>(4, (V - v0) / 16));
        readout_fn(nvt)(w + h * ws0 + t0 * ws1, ws1, q + h * qs0 + t0 * qs1, qs1, rows, n, K,
                        S + h * N * s_ckpt + v0 * 2, s_ckpt, sb, a, c);
        for (int v = 0; v < nvt; ++v)
          add_rows(c + v * 256, rows, o + h * os0 + t0 * os1 + v0 + v * 16, os1, 16);
      }
    }
    release();
  });
}

#else  // no AMX build: never usable, never called

bool amx_bf16_usable(std::string* why) {
  if (why) *why = "built without AMX support (x86-64 Linux, gcc >= 11 or clang >= 12)";
  return false;
}

void amx_bf16_rows(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                   const float*, const float*, float*) {}

static void readout_rows(float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                         int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t) {}

#endif

torch::Tensor readout_bf16_amx_(torch::Tensor o, const torch::Tensor& w, const torch::Tensor& q,
                                const torch::Tensor& S) {
  TORCH_CHECK(bf16_level() >= 4,
              "readout_bf16_amx_ needs AMX-BF16 (lowp_info()['bf16_impl'] == 4)");
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&o, &w, &q})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->dim() == 3 &&
                    t->stride(2) == 1,
                "readout_bf16_amx_: o, w and q must be 3-D float32 CPU tensors with unit stride "
                "in their last dim");
  const int64_t A = o.size(0), T = o.size(1), V = o.size(2), n = w.size(2), K = q.size(2);
  TORCH_CHECK(w.size(0) == A && w.size(1) == T && q.size(0) == A && q.size(1) == T,
              "readout_bf16_amx_: o (A, T, V), w (A, T, n) and q (A, T, K) must agree, got ",
              o.sizes(), ", ", w.sizes(), ", ", q.sizes());
  TORCH_CHECK(K % 32 == 0 && V % 16 == 0 && K > 0 && V > 0,
              "readout_bf16_amx_: K a multiple of 32 and V of 16 expected, got K = ", K,
              ", V = ", V);
  TORCH_CHECK(S.device().is_cpu() && S.scalar_type() == torch::kBFloat16 && S.dim() == 5 &&
                  S.is_contiguous() && S.size(0) == A && S.size(1) >= n && S.size(2) == K / 2 &&
                  S.size(3) == V && S.size(4) == 2,
              "readout_bf16_amx_: S must be a contiguous bfloat16 (A, N >= n, K/2, V, 2) = (", A,
              ", >= ", n, ", ", K / 2, ", ", V, ", 2), got ", S.sizes());
  if (A == 0 || T == 0 || n == 0) return o;
  readout_rows(o.data_ptr<float>(), o.stride(0), o.stride(1), w.data_ptr<float>(), w.stride(0),
               w.stride(1), q.data_ptr<float>(), q.stride(0), q.stride(1),
               reinterpret_cast<const uint16_t*>(S.data_ptr()), A, T, n, S.size(1), K, V);
  return o;
}

}  // namespace mcserve_lowp
