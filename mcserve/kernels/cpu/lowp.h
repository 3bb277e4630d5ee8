// Weight-only low-precision matrix products (int8 per-output-channel, bfloat16) for mcserve's
// CPU decode and prefill: lowp.cpp has the kernels and their run-time dispatch, lowp_ops.cpp
// the tensor side and the bindings (which ops.cpp calls); blocks.cpp calls the products inside
// the fused blocks.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

// x86-64: the vector code is compiled per instruction set with target attributes (MC_AVX512 the
// AVX-512 set the kernels take) and picked at run time
#if defined(__x86_64__) || defined(_M_X64)
#define MCSERVE_X86 1
#include <immintrin.h>
#define MC_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#endif

// vdpbf16ps needs gcc >= 11 or clang >= 12 (the intrinsics and __builtin_cpu_supports name)
#if defined(MCSERVE_X86) && ((defined(__clang__) && __clang_major__ >= 12) || \
                             (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define MCSERVE_BF16_DP 1
#endif

namespace mcserve_lowp {

// Weights are packed in blocks of 16 output rows, k-pair by k-pair: (ceil(N/16), ceil(K/2), 16,
// 2), zero-padded (twins.pack_pairs); scales (N,) float32 give N.
//
// y (B, N) = x (B, K) · (qweight · scales)ᵀ + bias for an int8 qweight. Each row of x is
// quantized to int16 with its own scale; the integer dot products are exact, so every
// implementation and every batch size give bit-identical rows. impl: -1 the best this CPU runs
// (capped by lowp_set_cap), else 0 scalar, 1 AVX2, 2 AVX-512BW, 3 AVX-512 VNNI.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                        int64_t impl);

// y (B, N) = x (B, K) · (weight · scales)ᵀ + bias for a bfloat16 weight, float32 sums. impl:
// -1 best, 0 scalar, 1 AVX2+FMA, 2 AVX-512F (these three multiply by the exact float32 x), 3
// AVX512-BF16 (vdpbf16ps), 4 AMX-BF16 (amx.cpp's tiles; 3 and 4 round x to bfloat16 first). A
// row gives the same result at any batch size.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                          int64_t impl);

// X (A, T, n, K) bfloat16 = w (A, T, n) ⊗ q (A, T, K), each float32 product rounded to nearest
// even; q unit-stride over K, X contiguous. impl: -1 best, 3 AVX512-BF16, below that scalar.
torch::Tensor outer_bf16_(torch::Tensor X, const torch::Tensor& w, const torch::Tensor& q,
                          int64_t impl);

// the product for a packed int8 or bfloat16 weight with its scales; any other weight (float32)
// returns an undefined tensor (the caller's own path)
torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& W,
                         const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& bias);

// How a product with N outputs per row splits B rows: in chunks of `rows` (32-256, whole tiles
// of 32, the chunk's float32 sums about 256 KiB, so they stay in the core's caches), one thread
// per chunk (`threaded`) once there are at least two chunks per thread and the caller is not
// already inside a parallel region; a row's result is the same either way
struct RowChunks {
  int64_t rows, count;
  bool threaded;
};
RowChunks row_chunks(int64_t B, int64_t N);

// y (B, N) = x (B, K) · (P · sw)ᵀ for a packed weight P ((ceil(N/16), KP, 16, 2), int8 when
// is_int8, else bfloat16) at the best level this CPU runs: the raw product, no checks (the
// callers check shapes and dtypes once for many products)
void lowp_rows(bool is_int8, const void* P, int64_t N, int64_t KP, const float* x, int64_t B,
               int64_t K, const float* sw, float* y);

// mlp.cpp: a dense gated MLP in one call, out (T, D) = down(act(gate x) · up x) for x (T, D)
// float32 and packed weights, all int8 or all bfloat16, with their scales: gate and up
// (ceil(I/16), ceil(D/2), 16, 2) with (I,), down (ceil(D/16), ceil(I/2), 16, 2) with (D,); act 0
// SiLU, 1 relu², 2 relu (vmath.h vact). The rows go through in chunks (one thread's each where
// there are enough); each row's result is the one the three products and the activation give
// at any batch size.
torch::Tensor gated_mlp(const torch::Tensor& x, const torch::Tensor& gate,
                        const torch::Tensor& s_gate, const torch::Tensor& up,
                        const torch::Tensor& s_up, const torch::Tensor& down,
                        const torch::Tensor& s_down, int64_t act);

// lowp_ops.cpp: P a contiguous packed weight of `t` for K inputs and the scales' length of outputs
// (a clear error naming `what` otherwise)
void check_packed(const torch::Tensor& P, const torch::Tensor& scales, int64_t K,
                  torch::ScalarType t, const char* what);

// The routed experts of a sparse MoE layer in one call (mlp.cpp; models/moe.py): x (T, D)
// float32, each token's k experts idx (T, k) int64 and weights w (T, k) float32; every expert's
// input projection w_in (E, ceil(N1/16), ceil(D/2), 16, 2) and down projection down (E,
// ceil(D/16), ceil(I/2), 16, 2), both int8 or both bfloat16 (lowp.cpp's packing), with scales
// s_in (E, N1) and s_down (E, D); N1 = 2I (gated: rows [:I] the gate) or I. Returns
// out (T, D) float32 = sum over a token's experts of w · down_e(act(gate_e x) * up_e x) (gated)
// or w · down_e(act(up_e x)); act 0 silu, 1 relu², 2 relu. The (token, expert) pairs are taken
// expert by expert, each expert's rows in one product, and added into out in that order.
// float32 experts: w_in (E, N1, D) and down (E, D, I) as the model stacks them, no scales.
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& w,
                          const torch::Tensor& w_in, const c10::optional<torch::Tensor>& s_in,
                          const torch::Tensor& down, const c10::optional<torch::Tensor>& s_down,
                          bool gated, int64_t act);

// amx.cpp: whether this CPU, OS and process run AMX-BF16 tiles (why not, when not), and
// y (B, N) = xb (B, K) · (P · sw)ᵀ + bias on them for a packed bfloat16 weight P ((ceil(N/16),
// KP, 16, 2)); xb is x rounded to bfloat16, rows of stride Kx (a multiple of 32, zero-padded
// from 2·KP) and zero rows up to a multiple of 16. Call only where amx_bf16_usable() said so.
bool amx_bf16_usable(std::string* why);
void amx_bf16_rows(const uint16_t* P, int64_t N, int64_t KP, const uint16_t* xb, int64_t Kx,
                   int64_t B, const float* sw, const float* bias, float* y);
// amx.cpp: h (B, I) = act(xb · (Pg · sg)ᵀ) · (xb · (Pu · su)ᵀ), the gate and up projections of
// a gated MLP (packed bfloat16, (ceil(I/16), KP, 16, 2) each) on the same tiles, the activation
// (vmath.h vact: 0 SiLU, 1 relu², 2 relu) applied to the float32 sums as they leave the tiles;
// xb as for amx_bf16_rows. Each sum is the chain amx_bf16_rows makes for that weight.
void amx_bf16_gated(const uint16_t* Pg, const uint16_t* Pu, int64_t I, int64_t KP,
                    const uint16_t* xb, int64_t Kx, int64_t B, const float* sg, const float* su,
                    int act, float* h);

// the bfloat16 level bf16_linear runs at here (lowp.cpp's probe, under the cap): 4 on AMX tiles
int bf16_level();

// lowp.cpp, for lowp_ops.cpp: the int8 level this CPU runs (its self-test, under the cap); the
// raw products at a level (x rounded as that level rounds it, no checks); the cap
// (MCSERVE_CPU_ISA); what the CPU reports and the levels chosen (lowp_info)
int q8_best();
void q8_raw(const float* x, int64_t B, int64_t K, const int8_t* P, int64_t N, int64_t KP,
            const float* sw, const float* bias, float* y, int impl);
void bf_raw(const float* x, int64_t B, int64_t K, const uint16_t* P, int64_t N, int64_t KP,
            const float* sw, const float* bias, float* y, int impl);
void set_cap(int level);
pybind11::dict info();

// amx.cpp: the bfloat16 cached readout of an MC prefill tile on AMX tiles. For each of A heads
// and T tokens: o[h, t, :] += sum over checkpoints j < n and keys k of q[h, t, k] ·
// bf16(w[h, t, j]) · bf16(S_j)[k, :], float32 sums, in place. o (A, T, V), w (A, T, n) and q (A,
// T, K) float32 with unit stride in their last dim; S (A, K·V/16, P, 16, 2) bfloat16 contiguous:
// checkpoint j's flattened (k, v) in groups of 16, checkpoints in pairs (ckpt_pairs_bf16_), P a
// multiple of 16 with at least n rounded up to 32 checkpoints (finite past n); V a multiple of
// 16. A clear error where bf16_level() < 4.
torch::Tensor readout_bf16_amx_(torch::Tensor o, const torch::Tensor& w, const torch::Tensor& q,
                                const torch::Tensor& S);

// amx.cpp: an ssc prefill's readout of each token's picked checkpoints on AMX tiles:
// y[b, t, h] = Σ_j Σ_k bf16(w[b, t, h, j] · q[b, t, h, k]) · S[b, h, idx[b, t, h, j], k, :],
// float32 sums (readout_picks' grouping: per tile of tokens the picks sorted by checkpoint, 16
// picks of a checkpoint per tile product). S (B, H, N, K/2, V, 2) bfloat16 in key pairs
// (key_pairs_bf16_), q (B, L, H, K), idx (B, L, H, k) int64 and w (B, L, H, k) any strides;
// K a multiple of 32, V of 16 → (B, L, H, V): `out` (contiguous float32) with the sums added
// in place when given, else new.
torch::Tensor readout_picks_bf16_amx(const torch::Tensor& S, const torch::Tensor& q,
                                    const torch::Tensor& idx, const torch::Tensor& w,
                                    const c10::optional<torch::Tensor>& out);

// pairs.cpp: checkpoints into readout_picks_bf16_amx's key pairs: src (B, n, H, K, V) float32
// with each (K, V) contiguous → dst[b, h, offset + i, k/2, v, k % 2] = bf16(src[b, i, h, k,
// v]) (round to nearest even, NaN kept), dst (B, H, N, K/2, V, 2) bfloat16 contiguous.
torch::Tensor key_pairs_bf16_(torch::Tensor dst, const torch::Tensor& src, int64_t offset);

// pairs.cpp: checkpoints into readout_bf16_amx_'s layout. src (B, n, H, K, V) float32 with each
// (K, V) contiguous → dst[b, h, g, p, c, e] = bf16(src[b, j - offset, h].flat[16g + c]) for j =
// 2p + e in offset .. offset + n (round to nearest even, NaN kept; the other checkpoint of a
// pair at either end left as it is), dst (B, H, K·V/16, P, 16, 2) bfloat16 contiguous. One pass;
// no AMX needed.
torch::Tensor ckpt_pairs_bf16_(torch::Tensor dst, const torch::Tensor& src, int64_t offset);

// pairs.cpp: rows idx (T,) int64 of a packed int8 or bfloat16 weight P ((ceil(N/16), ceil(K/2),
// 16, 2), as check_packed takes it) as float32 times their scales: out (T, K) =
// dequantized(P)[idx], the value times scales[idx[t]] as one float32 product (a token
// embedding's lookup without unpacking the table). A row outside [0, N) is a clear error.
torch::Tensor packed_rows(const torch::Tensor& P, const torch::Tensor& scales,
                          const torch::Tensor& idx, int64_t K);

void bind(pybind11::module& m);

}  // namespace mcserve_lowp
