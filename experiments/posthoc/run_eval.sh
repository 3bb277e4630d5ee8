#!/usr/bin/env bash
# Every table of docs/post-hoc-mc.md, from a trained checkpoint (train_mamba2.py), through
# `mcserve eval` only. One thread, so the numbers do not depend on the machine's core count.
#   bash experiments/posthoc/run_eval.sh            # all parts, then the tables
#   bash experiments/posthoc/run_eval.sh main       # one part: main | segments | delta |
#                                                   # combined | passkey | tables
#   M=experiments/posthoc/ckpt bash experiments/posthoc/run_eval.sh   # the 128-token model
# W (windows per length, 4), MAXMULT (32), CW (calibration windows, 2) and PKT (passkey trials
# per length x depth, 4) override the defaults.
# T is the checkpoint's training length (config.json's max_position_embeddings); lengths run
# from 1x to MAXMULT x T (32), segment lengths are T/2, T and 2T, and the Delta scales are
# calibrated at 16x T on calib.bin (never on eval.bin). Reports go to results/T$T/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
PY=.venv/bin/python
M=${M:-experiments/posthoc/ckpt512}
D=experiments/posthoc/data
T=${T:-$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['max_position_embeddings'])" \
  "$M/config.json")}
R=${R:-experiments/posthoc/results/T$T}
W=${W:-4}                                      # windows per length
MAXMULT=${MAXMULT:-32}                         # longest length, in multiples of T
CW=${CW:-2}                                    # calibration windows
LENS=$T; for ((m = 2; m <= MAXMULT; m *= 2)); do LENS=$LENS,$((m*T)); done
H=$((T/2)); D2=$((2*T))
# Delta-scale candidates: 1/32 to 2 (1/16 keeps a 16x longer sum at its 1x size)
GRID=${GRID:-0.03125,0.0625,0.09,0.125,0.18,0.25,0.35,0.5,0.7,1,1.4,2}
EV=".venv/bin/mcserve eval"
mkdir -p "$R"
part=${1:-all}
ppl() { $EV ppl "$M" --data $D/eval.bin --lengths "$LENS" --max-windows "$W" --no-progress "$@"; }
shared() { $PY -c "import json,sys; print(json.load(open(sys.argv[1]))['shared_scale'])" "$1"; }

if [[ $part == all || $part == main ]]; then
  # no MC; segment reset at T (added by --mc); MC at C = T: post and the parameter-free gated
  # variants (u = q): grm in both modes, ssc top-k 1/2/4, loglinear (checkpoint mode only)
  ppl --mc "post:$T:independent,grm:$T:independent,grm:$T:checkpoint,ssc:$T:checkpoint:1,\
ssc:$T:checkpoint:2,ssc:$T:checkpoint:4,loglinear:$T:checkpoint" --json $R/ppl_main.json
fi

if [[ $part == all || $part == segments ]]; then
  # post at C = T/2, T, 2T in both modes (reset:C is added for every C)
  ppl --mc "post:$H:independent,post:$D2:independent,post:$H:checkpoint,post:$T:checkpoint,\
post:$D2:checkpoint" --json $R/ppl_segments.json
fi

if [[ $part == all || $part == delta ]]; then
  # Delta scaling alone: shared scale, then per-layer coordinate search, at 16x T
  $EV calibrate-delta "$M" --data $D/calib.bin --length $((16*T)) --windows "$CW" --no-progress \
    --grid "$GRID" --out $R/delta_layers.json
  ppl --mc '' --delta-scale "$(shared $R/delta_layers.json)" --json $R/ppl_delta_shared.json
  ppl --mc '' --delta-scale $R/delta_layers.json --json $R/ppl_delta_layers.json
fi

if [[ $part == all || $part == combined ]]; then
  # MC and Delta scaling combined: scales calibrated for post:T:independent at 16x T
  $EV calibrate-delta "$M" --data $D/calib.bin --length $((16*T)) --windows "$CW" --no-progress \
    --grid "$GRID" --mc "post:$T:independent" --out $R/delta_post.json
  ppl --no-reset --mc "post:$T:independent,post:$T:checkpoint" \
    --delta-scale $R/delta_post.json --json $R/ppl_combined.json
fi

if [[ $part == all || $part == passkey ]]; then
  # the same lengths; as-is, reset:T, post:T:independent, grm:T:independent, Delta scaling
  PK=${PK:-$LENS}
  $EV passkey "$M" --lengths "$PK" --trials "${PKT:-4}" --depths 0,0.5,1 --reset --no-progress \
    --mc "post:$T:independent,grm:$T:independent" --json $R/passkey.json
  if [[ -f $R/delta_layers.json ]]; then
    $EV passkey "$M" --lengths "$PK" --trials "${PKT:-4}" --depths 0,0.5,1 --no-progress --mc '' \
      --delta-scale "$(shared $R/delta_layers.json)" --json $R/passkey_delta.json
  fi
fi

$PY experiments/posthoc/summarize.py $R/ppl_*.json $R/passkey*.json 2>/dev/null || true
