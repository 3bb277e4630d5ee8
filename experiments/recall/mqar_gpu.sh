#!/usr/bin/env bash
# MQAR grids on one CUDA GPU, each as one prepared device call (FINDINGS.md lists which result
# file each grid wrote). Run from the repository root:
#
#   OUT=/some/dir bash experiments/recall/mqar_gpu.sh            # t256: linear none/grm/ssc/
#       # loglinear + attention, seeds 0-2, T = 256, 16-64 pairs, plus grm independent (seed 0):
#       # ~6.5 minutes on one H200, 16 cores -> mqar_capacity.json, mqar_capacity_ind.json
#   OUT=/some/dir MAXMIN=5.3 bash experiments/recall/mqar_gpu.sh t128   # T = 128, 8-32 pairs,
#       # 6000 steps, grm independent on 3 seeds, no loglinear: ~4.5 minutes
#       # -> mqar_capacity_t128.json, mqar_capacity_t128_ind.json
#   OUT=/some/dir MAXMIN=6.5 SEED=0 bash experiments/recall/mqar_gpu.sh deep-wide   # dla/titans
#       # at T = 64, linear at d_model 128 / T = 256 and at T = 512; one seed, 4000 steps:
#       # 5-6 minutes on one H100 -> mqar_deep_t64.json, mqar_d128_t256.json, mqar_t512.json
#   OUT=/some/dir MAXMIN=6.5 bash experiments/recall/mqar_gpu.sh titans-lr   # titans T = 64 at
#       # outer learning rates $TLR (default 3e-3) and 1e-2, seeds 0-2, 18 processes
#
# Tiny models are launch-bound: each process keeps one CPU core busy launching kernels, so the
# runs share the GPU through CUDA MPS when the machine has it (kernels of different processes then
# run side by side); without MPS the GPU time-slices between processes and only seed 0 is run.
# Every run stops at --max-minutes (marked "truncated" in the JSON) so that the results are written
# before the device call's limit. Data is drawn on the CPU from the seed and moved to the GPU: the
# same token stream as on the CPU, but GPU arithmetic is not bit-identical to the CPU's.
set -u
OUT=${OUT:-experiments/recall/results}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 MCSERVE_KERNELS=torch OMP_NUM_THREADS=1
MAXMIN=${MAXMIN:-7.0}  # per-run safety limit (minutes)
DEVICE=${DEVICE:-cuda}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$OUT/grid.log"

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
MPS=0
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  if timeout 60 $PY -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4"; then
    MPS=1
  else
    echo quit | nvidia-cuda-mps-control
    sleep 2
  fi
fi
echo "MPS=$MPS" | tee -a "$OUT/grid.log"

GRID=${1:-t256}
if [ "$GRID" = deep-wide ]; then
  # One seed ($SEED, default 0), three grids side by side (15 processes): dla/titans at T = 64
  # (4000 steps), d_model 128 at T = 256, and T = 512 (segments of 64: the same 8 segments as
  # T = 256 with segments of 32). Only the three result JSONs and grid.log stay under $OUT; the
  # plots are redrawn with `python experiments/recall/mqar.py --plot-from FILE.json`.
  STEPS=${STEPS:-4000}
  DEV=(--device "$DEVICE" --max-minutes "$MAXMIN" --variant-steps --seeds "${SEED:-0}"
       --eval-n "${EVALN:-512}" --steps "$STEPS")
  $PY experiments/recall/mqar.py "${DEV[@]}" --families dla titans --variants none grm ssc --deep-variants \
      none grm ssc --d-models 64 --seq-lens 64 --pairs 4 8 16 --vocab 64 \
      --segment-len 16 --top-k 1 --jobs 7 --out "$OUT/mqar_deep_t64.json" \
      --plot "/tmp/mqar_deep_t64.png" --jsonl "/tmp/mqar_deep_t64.jsonl" > /tmp/deep.log 2>&1 &
  $PY experiments/recall/mqar.py "${DEV[@]}" --families linear --variants none grm ssc --d-models 128 \
      --seq-lens 256 --pairs 16 32 64 --vocab 256 --head-dim 16 --segment-len 32 --top-k 2 \
      --jobs 4 --out "$OUT/mqar_d128_t256.json" --plot "/tmp/mqar_d128_t256.png" \
      --jsonl "/tmp/mqar_d128_t256.jsonl" > "/tmp/d128.log" 2>&1 &
  $PY experiments/recall/mqar.py "${DEV[@]}" --families linear --variants none grm ssc --d-models 64 \
      --seq-lens 512 --pairs 16 32 64 --vocab 256 --head-dim 16 --segment-len 64 --top-k 2 \
      --jobs 4 --out "$OUT/mqar_t512.json" --plot "/tmp/mqar_t512.png" \
      --jsonl "/tmp/mqar_t512.jsonl" > "/tmp/t512.log" 2>&1 &
  wait
  for f in deep d128 t512; do grep -v " step " "/tmp/$f.log" | tail -n 25; done
  [ "$MPS" = 1 ] && echo quit | nvidia-cuda-mps-control
  date -u +%FT%TZ | tee -a "$OUT/grid.log"
  exit 0
fi
if [ "$GRID" = titans-lr ]; then
  # titans at T = 64 (the deep-wide grid's deep cells): none/grm/ssc x seeds 0-2 at the outer
  # learning rate $TLR (default 3e-3, at which titans trains without diverging) and, in the
  # same call, at the default 1e-2 (where most titans runs diverge): 18 processes.
  STEPS=${STEPS:-4000}
  for LR in "${TLR:-3e-3}" 1e-2; do
    $PY experiments/recall/mqar.py --device "$DEVICE" --max-minutes "$MAXMIN" --variant-steps --seeds 0 1 2 \
        --eval-n "${EVALN:-512}" --steps "$STEPS" --no-attention --families titans \
        --deep-variants none grm ssc --d-models 64 --seq-lens 64 --pairs 4 8 16 --vocab 64 \
        --segment-len 16 --top-k 1 --family-lr "titans=$LR" --jobs 9 \
        --out "$OUT/mqar_titans_lr$LR.json" --plot "/tmp/mqar_titans_lr$LR.png" \
        --jsonl "/tmp/mqar_titans_lr$LR.jsonl" > "/tmp/titans_$LR.log" 2>&1 &
  done
  wait
  for LR in "${TLR:-3e-3}" 1e-2; do grep -v " step " "/tmp/titans_$LR.log" | tail -n 12; done
  [ "$MPS" = 1 ] && echo quit | nvidia-cuda-mps-control
  date -u +%FT%TZ | tee -a "$OUT/grid.log"
  exit 0
fi
if [ "$GRID" = t128 ]; then
  COMMON=(--families linear --seq-lens 128 --pairs 8 16 32 --vocab 128 --head-dim 16
          --segment-len 32 --steps "${STEPS:-6000}" --variant-steps --device "$DEVICE"
          --max-minutes "$MAXMIN")
  VARIANTS=(none grm ssc); IND_SEEDS=(0 1 2); NAME=mqar_capacity_t128
else
  COMMON=(--families linear --seq-lens 256 --pairs 16 32 64 --vocab 256 --head-dim 16
          --segment-len 32 --steps "${STEPS:-4000}" --variant-steps --device "$DEVICE"
          --max-minutes "$MAXMIN")
  VARIANTS=(none grm ssc loglinear); IND_SEEDS=(0); NAME=mqar_capacity
fi
if [ "$MPS" = 1 ]; then
  $PY experiments/recall/mqar.py "${COMMON[@]}" --no-attention --variants grm --mc-modes independent \
      --seeds "${IND_SEEDS[@]}" --jobs "${#IND_SEEDS[@]}" --out "$OUT/${NAME}_ind.json" \
      --plot "/tmp/${NAME}_ind.png" > "$OUT/ind.log" 2>&1 &
  IND=$!
  SEEDS=(0 1 2); JOBS=$((3 * (${#VARIANTS[@]} + 1)))
else
  IND=
  SEEDS=(0); JOBS=$((${#VARIANTS[@]} + 1))
fi
$PY experiments/recall/mqar.py "${COMMON[@]}" --variants "${VARIANTS[@]}" --top-k 2 \
    --seeds "${SEEDS[@]}" --jobs "$JOBS" --out "$OUT/$NAME.json" 2>&1 \
    | tee -a "$OUT/grid.log" | grep -v " step "
[ -n "$IND" ] && wait "$IND"
tail -n 12 "$OUT/ind.log" 2>/dev/null
[ "$MPS" = 1 ] && echo quit | nvidia-cuda-mps-control
date -u +%FT%TZ | tee -a "$OUT/grid.log"
