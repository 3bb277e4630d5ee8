#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one call of at most 8 minutes (the three limits below
# plus their kill grace):
#   (a) the CUDA tests: the hybrid families on CUDA against the CPU engine (first), the Triton
#       kernels compiled (not interpreted) against their torch twins and reference loops, and
#       the engine on CUDA against the CPU engine;
#   (b) bench/kernels.py --quick: the kernel timings against the bandwidth floor;
#   (c) bench/gpu.py: Mamba2-130M and long-context decode/prefill against transformers, and the
#       CUDA-graph step, with a time budget.
# Runs from the repository root without building or installing anything (the GPU image has torch,
# triton and transformers, not the server's dependencies).
#
#   bash bench/gpu_check.sh [OUTDIR]   # OUTDIR, else $OUT, else bench/results (logs in
#                                      # bench/results/tmp_gpu_check/, git-ignored)
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh   # no GPU: gpu.py --device cpu --quick, no CUDA tests
#
# Each step runs under `timeout -s INT` (pytest and gpu.py report what they have on SIGINT);
# GPU_CHECK_PYTEST_S / GPU_CHECK_KERNELS_S / GPU_CHECK_BENCH_S change the limits (210/45/190 s;
# gpu.py gets a --time-budget-s 60 s under its limit so that the row running when the budget
# ends, and the report, still fit); GPU_CHECK_BENCH_ARGS adds arguments to gpu.py (say
# "--sections mamba2 long_context --streams 1 256"). The hybrid tests save their tiny checkpoints
# with the image's transformers, or read them from bench/results/tmp_hybrid_fixtures when that
# exists (`cd tests && python -m hybrid_models ../bench/results/tmp_hybrid_fixtures` on a machine
# with the project's transformers; carry the folder). The last line is a one-line summary.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
t_start=$SECONDS
dry=${GPU_CHECK_DRY:-0}
pytest_s=${GPU_CHECK_PYTEST_S:-210}
kernels_s=${GPU_CHECK_KERNELS_S:-45}
bench_s=${GPU_CHECK_BENCH_S:-190}
budget_s=$((bench_s > 120 ? bench_s - 60 : bench_s / 2))

out=${1:-${OUT:-}}
if [ -n "$out" ]; then
    logs=$out
    kernels_json=$out/kernels.json
    gpu_args=(--out "$out/gpu.json")  # gpu.py also writes its file in bench/results/
    gpu_json=$out/gpu.json
else  # the result files go where the other benches' are; the logs beside them, git-ignored
    logs=bench/results/tmp_gpu_check
    kernels_json=bench/results/kernels.json
    gpu_args=()
    gpu_json=bench/results/gpu.json
fi
mkdir -p "$logs" "$(dirname "$kernels_json")"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the device has no network: transformers must not try the hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -z "${MCSERVE_HYBRID_FIXTURES:-}" ] && [ -d bench/results/tmp_hybrid_fixtures ]; then
    export MCSERVE_HYBRID_FIXTURES=$PWD/bench/results/tmp_hybrid_fixtures
fi

py=python3
command -v "$py" >/dev/null || py=python

if [ "$dry" = 1 ]; then
    echo "gpu_check: dry run (GPU_CHECK_DRY=1): no CUDA tests; kernels.py and gpu.py on the CPU"
    # the bench's code paths are under test, not the C++ CPU kernels (whose first build alone
    # can take minutes)
    export MCSERVE_CPU_KERNELS=0
    gpu_args+=(--device cpu --quick --threads 1)
    gpu_json=${out:+$out/gpu.json}
    gpu_json=${gpu_json:-bench/results/tmp_gpu_quick.json}
    kernels_json=$logs/tmp_kernels_dry.json
else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        || echo "gpu_check: nvidia-smi failed"
    if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: torch sees no CUDA device (GPU_CHECK_DRY=1 for a CPU dry run)"
        exit 2
    fi
fi
"$py" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"

# (a) CUDA tests
if [ "$dry" = 1 ]; then
    echo "(a) CUDA tests: skipped (dry run)" | tee "$logs/gpu_pytest.log"
    rc_test=skip
    test_line="skipped (dry)"
else
    echo "== (a) CUDA tests (timeout ${pytest_s} s)"
    MCSERVE_TEST_CUDA=1 timeout -s INT -k 10 "$pytest_s" "$py" -m pytest -q -p no:cacheprovider \
        -rs tests/test_cuda_hybrid.py tests/test_cuda.py tests/test_triton_kernels.py tests/test_triton_fused.py \
        2>&1 | tee "$logs/gpu_pytest.log"
    rc_test=$?
    test_line=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$logs/gpu_pytest.log" \
        | tail -1 | tr -d '=' | sed 's/^ *//')
fi

# (b) kernel timings (short settings); without CUDA it says so and exits 0
echo "== (b) bench/kernels.py --quick (timeout ${kernels_s} s)"
timeout -s INT -k 10 "$kernels_s" "$py" bench/kernels.py --quick --out "$kernels_json" 2>&1 \
    | tee "$logs/kernels.log"
rc_kernels=$?

# (c) the GPU comparisons
echo "== (c) bench/gpu.py --time-budget-s ${budget_s} (timeout ${bench_s} s)"
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of words
timeout -s INT -k 10 "$bench_s" "$py" bench/gpu.py --time-budget-s "$budget_s" "${gpu_args[@]}" \
    ${GPU_CHECK_BENCH_ARGS:-} \
    2>&1 | tee "$logs/gpu_bench.log"
rc_bench=$?

targets=$("$py" - "$gpu_json" <<'EOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get("targets", [])
n = {k: sum(1 for x in t if x["pass"] is v) for k, v in (("PASS", True), ("FAIL", False))}
print(f"targets {n['PASS']} PASS / {n['FAIL']} FAIL / {len(t) - n['PASS'] - n['FAIL']} not "
      f"measured, {len(d.get('errors', []))} errors, {len(d.get('skipped', []))} rows skipped"
      + (" (partial)" if d.get("partial") else ""))
EOF
)
echo "gpu_check: tests rc=$rc_test (${test_line:-no summary}); kernels.py rc=$rc_kernels;" \
    "gpu.py rc=$rc_bench (${targets:-no JSON at $gpu_json}); $((SECONDS - t_start)) s;" \
    "logs in $logs"
[ "$rc_test" = 0 ] || [ "$rc_test" = skip ] || exit 1
[ "$rc_kernels" = 0 ] && [ "$rc_bench" = 0 ]
