#!/usr/bin/env bash
# Every table of docs/post-hoc-mc.md, from the trained checkpoint (train_mamba2.py), through
# `mcserve eval` only. One thread, so the numbers do not depend on the machine's core count.
#   bash experiments/posthoc/run_eval.sh          # all parts, then the tables
#   bash experiments/posthoc/run_eval.sh fixes    # one part: fixes | delta | combined | passkey
#                                                 # | long (32x, the main settings only)
# T is the checkpoint's training length; lengths run from 1x to MAXMULT x T (16), segment lengths
# are T/2, T and 2T, and the Delta scales are calibrated at 16x T on calib.bin (never on
# eval.bin).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
M=${M:-experiments/posthoc/ckpt}
D=experiments/posthoc/data
R=${R:-experiments/posthoc/results}
T=${T:-128}
W=${W:-4}                                      # windows per length
MAXMULT=${MAXMULT:-16}                         # longest length, in multiples of T
CW=${CW:-2}                                    # calibration windows
LENS=$T; for ((m = 2; m <= MAXMULT; m *= 2)); do LENS=$LENS,$((m*T)); done
H=$((T/2)); D2=$((2*T))
# Delta-scale candidates: 1/16 (the step that keeps a 16x longer sum at its 1x size) to 2
GRID=${GRID:-0.0625,0.09,0.125,0.18,0.25,0.35,0.5,0.7,1,1.4,2}
EV=".venv/bin/mcserve eval"
mkdir -p "$R"
part=${1:-all}
ppl() { $EV ppl "$M" --data $D/eval.bin --lengths "$LENS" --max-windows "$W" --no-progress "$@"; }

if [[ $part == all || $part == fixes ]]; then
  # no MC; segment reset (reset:C is added for every C); post at C = T/2, T, 2T in both modes;
  # the parameter-free gated variants (u = q) at C = T
  ppl --mc "post:$H:independent,post:$T:independent,post:$D2:independent,post:$H:checkpoint,\
post:$T:checkpoint,post:$D2:checkpoint,grm:$T:checkpoint,grm:$T:independent,\
ssc:$T:checkpoint:1,ssc:$T:checkpoint:2,ssc:$T:checkpoint:4,loglinear:$T:checkpoint" \
    --json $R/ppl_fixes.json
fi

if [[ $part == all || $part == delta ]]; then
  # Delta scaling alone: shared scale, then per-layer coordinate search, at 16x T
  $EV calibrate-delta "$M" --data $D/calib.bin --length $((16*T)) --windows "$CW" --no-progress \
    --grid "$GRID" \
    --out $R/delta_layers.json
  shared=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['shared_scale'])" \
    $R/delta_layers.json)
  ppl --mc '' --delta-scale "$shared" --json $R/ppl_delta_shared.json
  ppl --mc '' --delta-scale $R/delta_layers.json --json $R/ppl_delta_layers.json
fi

if [[ $part == all || $part == combined ]]; then
  # MC and Delta scaling combined: scales calibrated for post:T:independent at 16x T
  $EV calibrate-delta "$M" --data $D/calib.bin --length $((16*T)) --windows "$CW" --no-progress \
    --grid "$GRID" \
    --mc "post:$T:independent" --out $R/delta_post.json
  ppl --no-reset --mc "post:$T:independent,post:$T:checkpoint,grm:$T:checkpoint" \
    --delta-scale $R/delta_post.json --json $R/ppl_combined.json
  # the Delta-only scales under MC, to see whether the scales transfer
  ppl --no-reset --mc "post:$T:independent" --delta-scale $R/delta_layers.json \
    --json $R/ppl_combined_deltaonly_scales.json
fi

if [[ $part == all || $part == long ]]; then
  # 32x T for the main settings (the calibrated scales from 16x, unchanged)
  L32="$T,$((32*T))"
  long() { $EV ppl "$M" --data $D/eval.bin --lengths "$L32" --max-windows "$W" --no-progress "$@"; }
  long --mc "post:$H:independent,post:$T:independent,grm:$T:independent,post:$T:checkpoint" \
    --json $R/ppl_long_fixes.json
  long --mc '' --delta-scale "$(.venv/bin/python -c "import json,sys; \
print(json.load(open(sys.argv[1]))['shared_scale'])" $R/delta_layers.json)" \
    --json $R/ppl_long_delta_shared.json
  long --mc '' --delta-scale $R/delta_layers.json --json $R/ppl_long_delta_layers.json
  long --no-reset --mc "post:$T:independent" --delta-scale $R/delta_post.json \
    --json $R/ppl_long_combined.json
fi

if [[ $part == all || $part == passkey ]]; then
  $EV passkey "$M" --lengths $T,$((2*T)),$((4*T)) --trials 4 --depths 0,0.5,1 \
    --mc "post:$T" --reset --no-progress --json $R/passkey.json
fi
.venv/bin/python experiments/posthoc/summarize.py $R/ppl_*.json $R/passkey.json 2>/dev/null || true
