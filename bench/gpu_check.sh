#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run: the Triton kernels compiled (not interpreted)
# against their torch twins and reference loops, the engine on CUDA against the CPU engine, and
# the kernel timings (bench/kernels.py). Runs from the repository root without installing the
# package (the GPU image has torch and triton but not the server's dependencies).
#   bash bench/gpu_check.sh [OUTDIR]     # logs and kernels.json go to OUTDIR (default /tmp)
set -o pipefail
out=${1:-/tmp}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MCSERVE_TEST_CUDA=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_kernels.py tests/test_cuda.py \
    2>&1 | tee "$out/gpu_pytest.log"
rc=$?
python3 bench/kernels.py --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" || rc=1
exit $rc
