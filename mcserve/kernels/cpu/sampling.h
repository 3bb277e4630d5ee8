// Sampling-side ops of mcserve's CPU engine (sampling.cpp); ops.cpp binds them.
#pragma once

#include <torch/extension.h>

namespace mcserve_sampling {

torch::Tensor mask_logits_(torch::Tensor logits, const torch::Tensor& rows,
                           const torch::Tensor& bitmask);

void bind(pybind11::module& m);

}  // namespace mcserve_sampling
