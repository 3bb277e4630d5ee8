"""Test-wide settings.

Every model in the tests is tiny, so torch's intra-op threads only add synchronisation; on a
busy 2-core machine an OpenMP barrier around a 3×64 softmax costs 10+ ms. One thread keeps the
suite fast and its timing independent of what else runs.
"""

import os

# Without a GPU, Triton kernels are tested with its interpreter on CPU tensors. It must be set
# before triton is first imported (torch._dynamo imports it too), hence here. On a machine with
# an NVIDIA GPU, MCSERVE_TEST_CUDA=1 compiles them instead (tests/test_triton_kernels.py).
if os.environ.get("MCSERVE_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
