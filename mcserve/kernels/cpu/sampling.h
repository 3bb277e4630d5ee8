// Sampling-side ops of mcserve's CPU engine (sampling.cpp); ops.cpp binds them.
#pragma once

// torch's pybind11 casters for tensors (bind() binds ops on tensors), without the C++ frontend
// of torch/extension.h
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

namespace mcserve_sampling {

torch::Tensor mask_logits_(torch::Tensor logits, const torch::Tensor& rows,
                           const torch::Tensor& bitmask);

void bind(pybind11::module& m);

}  // namespace mcserve_sampling
