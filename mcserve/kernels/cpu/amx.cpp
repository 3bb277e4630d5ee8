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
// The MC prefill's bfloat16 cached readout (readout_bf16_amx_) runs on the same tiles with the
// routing weights as the left operand: 16 tokens × 32 checkpoints of bf16(w) times 16 checkpoint
// pairs × 16 columns of the checkpoints' flattened (k, v), so each tile product sums over 32
// checkpoints at once; the float32 sums M[t, (k, v)] are then read out with the queries in
// float32, o[t, v] += Σ_k q[t, k] · M[t, (k, v)], on vector registers.
//
// Where it runs: the CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7), the OS saves the tile
// state (XCR0 bits 17 and 18) and, on Linux, grants this process the tile data permission
// (arch_prctl ARCH_REQ_XCOMP_PERM): a VM or kernel that does not is found here, before any tile
// instruction runs. lowp.cpp's self-test then checks the level against the scalar kernel.
#include "common.h"
#include "lowp.h"
#include "vmath.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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
  // _tile_loadconfig's asm names only the first bytes of c as its input: without this barrier
  // the compiler may drop the stores to rows and colsb as dead
  asm volatile("" : : "r"(&c) : "memory");
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

// readout_bf16_amx_'s pieces. Tiles 0-3: the sums of token tiles m (rows 0-15, 16-31) and
// column groups c (two consecutive groups of 16) at 2m + c; 4-5: the weights of the token
// tiles; 6-7: the column groups' checkpoint pairs.

// rows of bf16(w) for a tile of 32 tokens: `rows` of w's (the rest zero), npad columns (zero
// past n), in Wb (32 × npad)
__attribute__((target("avx512f,avx512bf16"))) void ws_weights(const float* w, int64_t ws, int rows,
                                                              int64_t n, int64_t npad,
                                                              uint16_t* Wb) {
  for (int r = 0; r < 32; ++r) {
    uint16_t* dst = Wb + r * npad;
    if (r >= rows) {
      std::memset(dst, 0, sizeof(uint16_t) * npad);
      continue;
    }
    const float* src = w + r * ws;
    for (int64_t j = 0; j < npad; j += 32) {
      const int64_t a = std::max<int64_t>(0, std::min<int64_t>(16, n - j));
      const int64_t b = std::max<int64_t>(0, std::min<int64_t>(16, n - j - 16));
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << a) - 1), src + j);
      const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << b) - 1), src + j + 16);
      _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// the sums of both token tiles and both column groups over `steps` × 32 checkpoints: weights
// at Wt (row stride lda bytes), the groups' checkpoint pairs at b0 and b1 (512 values per step)
__attribute__((target("amx-tile,amx-bf16"), noinline)) void ws_tiles(
    const uint16_t* Wt, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t steps,
    float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, Wt + s * 32, lda);
    _tile_loadd(5, reinterpret_cast<const char*>(Wt + s * 32) + 16 * lda, lda);
    _tile_loadd(6, b0 + s * 512, 64);
    _tile_loadd(7, b1 + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// y[r, v..v+15] += q[r, k] · (the sums of column group g at row r), for group g (and g + 1
// when `both`), columns 16g.. of the flattened (k, v)
__attribute__((target("avx512f"))) void ws_contract(const float* c, const float* q, int64_t qs,
                                                    int rows, int64_t g, bool both, int64_t V,
                                                    float* y) {
  const int64_t ka = 16 * g / V, va = 16 * g % V;
  const int64_t kb = 16 * (g + 1) / V, vb = 16 * (g + 1) % V;
  for (int r = 0; r < rows; ++r) {
    const float* cr = c + (r / 16) * 512 + (r % 16) * 16;
    const float* qr = q + r * qs;
    float* yr = y + r * V;
    _mm512_storeu_ps(yr + va, _mm512_fmadd_ps(_mm512_set1_ps(qr[ka]), _mm512_load_ps(cr),
                                              _mm512_loadu_ps(yr + va)));
    if (both)
      _mm512_storeu_ps(yr + vb, _mm512_fmadd_ps(_mm512_set1_ps(qr[kb]), _mm512_load_ps(cr + 256),
                                                _mm512_loadu_ps(yr + vb)));
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

namespace {

// each block's last, partial pair-step of P (NBk blocks) zero-padded to a whole tile
std::vector<uint16_t> block_tails(const uint16_t* P, int64_t NBk, int64_t KP) {
  const int64_t steps = KP / 16, rem = KP % 16;
  std::vector<uint16_t> tails(rem != 0 ? static_cast<size_t>(NBk * 512) : 0, 0);
  for (int64_t j = 0; rem != 0 && j < NBk; ++j)
    std::memcpy(tails.data() + j * 512, P + (j * KP + steps * 16) * 2 * kL,
                sizeof(uint16_t) * rem * 2 * kL);
  return tails;
}

// the two blocks (or one, nt = 1) whose sums one tile call makes, and their zero-padded tails
struct BlockPair {
  const uint16_t* b[2];
  const uint16_t* t[2];
  int nt;
};

// xb's rows times `pairs` block pairs (src(p) → BlockPair), KP pair-steps each; the sums of row
// tile pair m0 (mt tiles of 16 rows) and block pair p go to epi(c, m0, mt, p, nt), c holding the
// tile of rows 16m and block n at (2m + n) · 256. Block pairs are split over torch's threads, in
// groups of about 512 KiB of weights read from memory once per call and from L2 for every further
// tile of rows.
template <class Src, class Epi>
void drive_pairs(int64_t pairs, int64_t KP, const uint16_t* xb, int64_t Kx, int64_t B, Src src,
                 Epi epi) {
  const int64_t steps = KP / 16;
  const bool tail = KP % 16 != 0;
  const int64_t Bp = (B + 15) / 16 * 16;  // xb holds Bp rows, the ones beyond B zero
  const int64_t lda = Kx * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t pair_bytes = 2 * KP * 2 * kL * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, pair_bytes));
  const int64_t group = std::max<int64_t>(1, (512 << 10) / std::max<int64_t>(1, pair_bytes));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    load_config(static_cast<int>(std::min<int64_t>(16, B)));
    alignas(64) float c[4 * 256];
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t m0 = 0; m0 < Bp;) {
        const int mt = Bp - m0 >= 32 ? 2 : 1;
        for (int64_t p = g0; p < g1; ++p) {
          const BlockPair bp = src(p);
          tile_fn(mt, bp.nt)(xb + m0 * Kx, lda, bp.b, steps, tail ? bp.t : nullptr, c);
          epi(c, m0, mt, p, bp.nt);
        }
        m0 += 16 * mt;
      }
    }
    release();
  });
}

// act(g · sg) · (u · su) for `rows` rows of a gate tile cg and an up tile cu (16 × 16 sums),
// `cols` of the 16 outputs, into h (row stride ldh); act 0 SiLU, 1 relu², 2 relu
void store_gated(const float* cg, const float* cu, int rows, int cols, const float* sg,
                 const float* su, int act, float* h, int64_t ldh) {
  using mcserve_ops::load16;
  using mcserve_ops::v16f;
  alignas(64) float gs[16] = {}, us[16] = {}, tmp[16];
  std::memcpy(gs, sg, sizeof(float) * cols);
  std::memcpy(us, su, sizeof(float) * cols);
  const v16f vg = load16(gs), vu = load16(us);
  for (int r = 0; r < rows; ++r) {
    const v16f g = load16(cg + r * 16) * vg, u = load16(cu + r * 16) * vu;
    const v16f a = mcserve_ops::vact(g, act) * u;
    if (cols == 16) {
      mcserve_ops::store16(h + r * ldh, a);
    } else {
      mcserve_ops::store16(tmp, a);
      std::memcpy(h + r * ldh, tmp, sizeof(float) * cols);
    }
  }
}

}  // namespace

void amx_bf16_rows(const uint16_t* P, int64_t N, int64_t KP, const uint16_t* xb, int64_t Kx,
                   int64_t B, const float* sw, const float* bias, float* y) {
  const int64_t NBk = (N + kL - 1) / kL;
  const std::vector<uint16_t> tails = block_tails(P, NBk, KP);
  const uint16_t* tp = tails.data();
  drive_pairs(
      (NBk + 1) / 2, KP, xb, Kx, B,
      [&](int64_t p) {
        const int64_t j = 2 * p;
        const int nt = j + 1 < NBk ? 2 : 1;
        return BlockPair{{P + j * KP * 2 * kL, P + (j + nt - 1) * KP * 2 * kL},
                         {tp + j * 512, tp + (j + nt - 1) * 512}, nt};
      },
      [&](const float* c, int64_t m0, int mt, int64_t p, int nt) {
        for (int m = 0; m < mt; ++m)
          for (int n = 0; n < nt; ++n) {
            const int64_t r0 = m0 + 16 * m, n0 = (2 * p + n) * kL;
            const int rows = static_cast<int>(std::min<int64_t>(16, B - r0));
            const int cols = static_cast<int>(std::min<int64_t>(kL, N - n0));
            if (rows > 0)
              store_rows(c + (2 * m + n) * 256, rows, y + r0 * N, N, n0, cols, sw, bias);
          }
      });
}

void amx_bf16_gated(const uint16_t* Pg, const uint16_t* Pu, int64_t I, int64_t KP,
                    const uint16_t* xb, int64_t Kx, int64_t B, const float* sg, const float* su,
                    int act, float* h) {
  const int64_t NBk = (I + kL - 1) / kL;
  const std::vector<uint16_t> tg = block_tails(Pg, NBk, KP), tu = block_tails(Pu, NBk, KP);
  drive_pairs(
      NBk, KP, xb, Kx, B,
      [&](int64_t j) {
        return BlockPair{{Pg + j * KP * 2 * kL, Pu + j * KP * 2 * kL},
                         {tg.data() + j * 512, tu.data() + j * 512}, 2};
      },
      [&](const float* c, int64_t m0, int mt, int64_t j, int) {
        const int64_t n0 = j * kL;
        const int cols = static_cast<int>(std::min<int64_t>(kL, I - n0));
        for (int m = 0; m < mt; ++m) {
          const int64_t r0 = m0 + 16 * m;
          const int rows = static_cast<int>(std::min<int64_t>(16, B - r0));
          if (rows > 0)
            store_gated(c + 2 * m * 256, c + (2 * m + 1) * 256, rows, cols, sg + n0, su + n0,
                        act, h + r0 * I + n0, I);
        }
      });
}

// readout_bf16_amx_'s pass, its arguments checked: units of (head, 32 tokens) over torch's
// threads; per unit the weights rounded once, then per pair of column groups the tile products
// of that pair and the readout of the previous pair's sums (two buffers, so the vector work
// overlaps the tile unit's), the outputs summed in a (32, V) buffer and added into o at the end
static void readout_rows(float* o, int64_t os0, int64_t os1, const float* w, int64_t ws0,
                         int64_t ws1, const float* q, int64_t qs0, int64_t qs1,
                         const uint16_t* S, int64_t A, int64_t T, int64_t n, int64_t G,
                         int64_t P, int64_t V) {
  const int64_t tiles = (T + 31) / 32, steps = (n + 31) / 32, npad = steps * 32;
  at::parallel_for(0, A * tiles, 1, [&](int64_t u0, int64_t u1) {
    load_config(16);
    std::vector<uint16_t> Wb(static_cast<size_t>(32 * npad));
    std::vector<float> y(static_cast<size_t>(32 * V));
    alignas(64) float c[2][1024];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t h = u / tiles, t0 = (u % tiles) * 32;
      const int rows = static_cast<int>(std::min<int64_t>(32, T - t0));
      const float* qt = q + h * qs0 + t0 * qs1;
      ws_weights(w + h * ws0 + t0 * ws1, ws1, rows, n, npad, Wb.data());
      std::fill(y.begin(), y.end(), 0.f);
      const uint16_t* Sh = S + h * G * P * 32;
      int64_t pending = -1;
      int buf = 0;
      for (int64_t g = 0; g < G; g += 2) {
        const uint16_t* b0 = Sh + g * P * 32;
        ws_tiles(Wb.data(), npad * 2, b0, g + 1 < G ? b0 + P * 32 : b0, steps, c[buf]);
        if (pending >= 0)
          ws_contract(c[1 - buf], qt, qs1, rows, pending, pending + 1 < G, V, y.data());
        pending = g;
        buf = 1 - buf;
      }
      ws_contract(c[1 - buf], qt, qs1, rows, pending, pending + 1 < G, V, y.data());
      for (int r = 0; r < rows; ++r) {
        float* orow = o + h * os0 + (t0 + r) * os1;
        const float* yr = y.data() + r * V;
        for (int64_t v = 0; v < V; v += 16)
          _mm512_storeu_ps(orow + v, _mm512_add_ps(_mm512_loadu_ps(orow + v),
                                                   _mm512_loadu_ps(yr + v)));
      }
    }
    release();
  });
}

// readout_picks_bf16_amx_'s pass: per (row, head, 1024 tokens) the picks sorted by checkpoint
// (a counting sort, as readout_picks), then per checkpoint 16 picks at a time: the left tile
// bf16(w · q) of those tokens (32 keys per tile), the checkpoint's key pairs on the right, the
// 16 × V float32 sums added into the tokens' outputs.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"), noinline)) void picks_tiles(
    const uint16_t* a, int64_t K, const uint16_t* Sn, int64_t V, int64_t v0, int nvt,
    float* c) {
  const int64_t sb = V * 2 * static_cast<int64_t>(sizeof(uint16_t));  // bytes per key pair
  _tile_zero(0);
  if (nvt > 1) _tile_zero(1);
  if (nvt > 2) _tile_zero(2);
  if (nvt > 3) _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    _tile_loadd(4, a + k0, K * 2);
    const char* b = reinterpret_cast<const char*>(Sn + (k0 / 2) * V * 2 + v0 * 2);
    _tile_loadd(5, b, sb);
    _tile_dpbf16ps(0, 4, 5);
    if (nvt > 1) {
      _tile_loadd(6, b + 64, sb);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (nvt > 2) {
      _tile_loadd(7, b + 128, sb);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (nvt > 3) {
      _tile_loadd(5, b + 192, sb);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 64);
  if (nvt > 1) _tile_stored(1, c + 256, 64);
  if (nvt > 2) _tile_stored(2, c + 512, 64);
  if (nvt > 3) _tile_stored(3, c + 768, 64);
}

// row r of a (K wide) = bf16(wt · q[0:K])
__attribute__((target("avx512f,avx512bf16"))) void weighted_row(const float* q, int64_t qs,
                                                                float wt, int64_t K,
                                                                uint16_t* a) {
  const __m512 wv = _mm512_set1_ps(wt);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    __m512 lo, hi;
    if (qs == 1) {
      lo = _mm512_loadu_ps(q + k0);
      hi = _mm512_loadu_ps(q + k0 + 16);
    } else {
      alignas(64) float t[32];
      for (int i = 0; i < 32; ++i) t[i] = q[(k0 + i) * qs];
      lo = _mm512_load_ps(t);
      hi = _mm512_load_ps(t + 16);
    }
    _mm512_storeu_si512(a + k0, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, wv),
                                                             _mm512_mul_ps(lo, wv)));
  }
}

static bool picks_rows(const uint16_t* S, const float* qp, const int64_t* qs, const int64_t* ip,
                       const int64_t* is, const float* wp, const int64_t* ws, float* yp,
                       int64_t B, int64_t N, int64_t H, int64_t K, int64_t V, int64_t L,
                       int64_t k) {
  constexpr int64_t kTile = 1024;
  const int64_t tiles = (L + kTile - 1) / kTile;
  std::atomic<bool> bad{false};
  at::parallel_for(0, B * H * tiles, 1, [&](int64_t i0, int64_t i1) {
    load_config(16);
    std::vector<int64_t> start(N + 1), order(kTile * k);
    std::vector<uint16_t> a(static_cast<size_t>(16 * K));
    alignas(64) float c[4 * 256];
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / (H * tiles), h = task / tiles % H;
      const int64_t t0 = task % tiles * kTile, t1 = std::min(L, t0 + kTile);
      auto pick = [&](int64_t t, int64_t j) { return ip[b * is[0] + t * is[1] + h * is[2] +
                                                        j * is[3]]; };
      auto weight = [&](int64_t t, int64_t j) { return wp[b * ws[0] + t * ws[1] + h * ws[2] +
                                                          j * ws[3]]; };
      if (!mcserve_ops::sort_picks(pick, weight, t0, t1, k, N, start, order)) bad = true;
      for (int64_t n = 0; n < N; ++n) {
        const uint16_t* Sn = S + ((b * H + h) * N + n) * K * V;
        for (int64_t g = start[n]; g < start[n + 1]; g += 16) {
          const int rows = static_cast<int>(std::min<int64_t>(16, start[n + 1] - g));
          for (int r = 0; r < 16; ++r) {
            if (r >= rows) {
              std::memset(a.data() + r * K, 0, sizeof(uint16_t) * K);
              continue;
            }
            const int64_t t = t0 + order[g + r] / k, j = order[g + r] % k;
            weighted_row(qp + b * qs[0] + t * qs[1] + h * qs[2], qs[3], weight(t, j), K,
                         a.data() + r * K);
          }
          for (int64_t v0 = 0; v0 < V; v0 += 64) {
            const int nvt = static_cast<int>(std::min<int64_t>(4, (V - v0) / 16));
            picks_tiles(a.data(), K, Sn, V, v0, nvt, c);
            for (int r = 0; r < rows; ++r) {
              const int64_t t = t0 + order[g + r] / k;
              float* yr = yp + ((b * L + t) * H + h) * V + v0;
              for (int v = 0; v < nvt; ++v)
                _mm512_storeu_ps(yr + 16 * v, _mm512_add_ps(_mm512_loadu_ps(yr + 16 * v),
                                                             _mm512_load_ps(c + v * 256 + r * 16)));
            }
          }
        }
      }
    }
    release();
  });
  return !bad;
}

#else  // no AMX build: never usable, never called

bool amx_bf16_usable(std::string* why) {
  if (why) *why = "built without AMX support (x86-64 Linux, gcc >= 11 or clang >= 12)";
  return false;
}

void amx_bf16_rows(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                   const float*, const float*, float*) {}

void amx_bf16_gated(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                    int64_t, const float*, const float*, int, float*) {}

static void readout_rows(float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                         int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t) {}

static bool picks_rows(const uint16_t*, const float*, const int64_t*, const int64_t*,
                       const int64_t*, const float*, const int64_t*, float*, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, int64_t) {
  return true;
}

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
  TORCH_CHECK(V % 16 == 0 && K > 0 && V > 0,
              "readout_bf16_amx_: V a multiple of 16 expected, got V = ", V);
  const int64_t G = K * V / 16, steps = (n + 31) / 32;
  TORCH_CHECK(S.device().is_cpu() && S.scalar_type() == torch::kBFloat16 && S.dim() == 5 &&
                  S.is_contiguous() && S.size(0) == A && S.size(1) == G &&
                  S.size(2) % 16 == 0 && S.size(2) >= steps * 16 && S.size(3) == 16 &&
                  S.size(4) == 2,
              "readout_bf16_amx_: S must be a contiguous bfloat16 (A, K·V/16, P, 16, 2) with P a "
              "multiple of 16 holding n = ", n, " checkpoints = (", A, ", ", G, ", >= ",
              steps * 16, ", 16, 2), got ", S.sizes());
  if (A == 0 || T == 0 || n == 0) return o;
  readout_rows(o.data_ptr<float>(), o.stride(0), o.stride(1), w.data_ptr<float>(), w.stride(0),
               w.stride(1), q.data_ptr<float>(), q.stride(0), q.stride(1),
               reinterpret_cast<const uint16_t*>(S.data_ptr()), A, T, n, G, S.size(2), V);
  return o;
}

torch::Tensor readout_picks_bf16_amx(const torch::Tensor& S, const torch::Tensor& q,
                                    const torch::Tensor& idx, const torch::Tensor& w,
                                    const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK(bf16_level() >= 4,
              "readout_picks_bf16_amx needs AMX-BF16 (lowp_info()['bf16_impl'] == 4)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && q.dim() == 4 &&
                  w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 4,
              "readout_picks_bf16_amx: q (B, L, H, K) and w (B, L, H, k) float32 expected");
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.dim() == 4 && idx.device().is_cpu(),
              "readout_picks_bf16_amx: idx (B, L, H, k) int64 on the CPU expected");
  TORCH_CHECK(S.device().is_cpu() && S.scalar_type() == torch::kBFloat16 && S.dim() == 6 &&
                  S.is_contiguous() && S.size(5) == 2,
              "readout_picks_bf16_amx: S (B, H, N, K/2, V, 2) contiguous bfloat16 expected");
  const int64_t B = S.size(0), H = S.size(1), N = S.size(2), K = 2 * S.size(3), V = S.size(4);
  const int64_t L = q.size(1), k = idx.size(3);
  TORCH_CHECK(K % 32 == 0 && V % 16 == 0 && K > 0 && V > 0,
              "readout_picks_bf16_amx: K a multiple of 32 and V of 16 expected, got K = ", K,
              ", V = ", V);
  TORCH_CHECK(q.sizes() == torch::IntArrayRef({B, L, H, K}) && idx.size(0) == B &&
                  idx.size(1) == L && idx.size(2) == H && w.sizes() == idx.sizes(),
              "readout_picks_bf16_amx: q (B, L, H, K), idx and w (B, L, H, k) expected");
  torch::Tensor y;
  if (out.has_value() && out->defined()) {  // the sums added to what out holds
    y = *out;
    TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == torch::kFloat32 && y.is_contiguous() &&
                    y.sizes() == torch::IntArrayRef({B, L, H, V}),
                "readout_picks_bf16_amx: out must be a contiguous float32 (B, L, H, V) = (", B,
                ", ", L, ", ", H, ", ", V, "), got ", y.sizes());
  } else {
    y = torch::zeros({B, L, H, V}, q.options());
  }
  const auto qs = q.strides(), is = idx.strides(), ws = w.strides();
  const bool ok = picks_rows(reinterpret_cast<const uint16_t*>(S.data_ptr()),
                             q.data_ptr<float>(), qs.data(), idx.data_ptr<int64_t>(), is.data(),
                             w.data_ptr<float>(), ws.data(), y.data_ptr<float>(), B, N, H, K, V,
                             L, k);
  TORCH_CHECK(ok, "readout_picks_bf16_amx: a checkpoint index is outside S");
  return y;
}

}  // namespace mcserve_lowp
