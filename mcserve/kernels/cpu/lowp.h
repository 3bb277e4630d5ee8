// Weight-only low-precision matrix products (int8 per-output-channel, bfloat16) for mcserve's
// CPU decode; lowp.cpp has the kernels and their run-time dispatch, blocks.cpp calls them inside
// the fused blocks and ops.cpp binds them.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/types.h>

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
// AVX512-BF16 (vdpbf16ps: x rounded to bfloat16 first). A row gives the same result at any batch
// size.
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

void bind(pybind11::module& m);

}  // namespace mcserve_lowp
