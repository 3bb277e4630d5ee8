// Weight-only low-precision matrix products (int8 per-output-channel, bfloat16) for mcserve's
// CPU decode; lowp.cpp has the kernels and their run-time dispatch, ops.cpp the callers.
#pragma once

#include <torch/extension.h>

namespace mcserve_lowp {

// y (B, N) = x (B, K) · (qweight (N, K) int8 · scales (N,))ᵀ + bias. Each row of x is quantized
// to int16 with its own scale; the integer dot products are exact, so every implementation and
// every batch size give bit-identical rows. impl: -1 the best this CPU runs (capped by
// set_cap), else 0 scalar, 1 AVX2, 2 AVX-512BW, 3 AVX-512 VNNI.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                        int64_t impl);

// y (B, N) = x (B, K) · weight (N, K) bfloat16ᵀ + bias, float32 accumulation. impl: -1 best,
// 0 scalar, 1 AVX2+FMA, 2 AVX-512F (these three multiply by the exact float32 x), 3 AVX512-BF16
// (vdpbf16ps: x rounded to bfloat16 first). A row gives the same result at any batch size.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias, int64_t impl);

// the product for a float32 (nullopt), int8 (with scales) or bfloat16 weight; float32 weights
// return an undefined tensor (the caller's own path)
torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& W,
                         const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& bias);

void bind(pybind11::module& m);

}  // namespace mcserve_lowp
