#!/usr/bin/env bash
# 4-stage CPU (gloo) runs with emulated interference on one, then two stages, then none:
# static vs measured in the same runtime. Raw logs: analysis/logs/cpu-4stage-emulated/.
#   bash bench/cpu_4stage.sh [OUTDIR]
set -u
O=${1:-analysis/logs/cpu-4stage-emulated}
mkdir -p "$O"
for mode in static measured; do
  OMP_NUM_THREADS=1 python -m dynpipe train --nproc 4 --device cpu --model mlp \
      --model-arg depth=14 --model-arg width=256 --model-arg in_features=256 \
      --steps 120 --batch-size 64 --microbatches 8 --optimizer adamw --lr 1e-3 \
      --adapt "$mode" --scenario recipes/scenarios/emulate-4stage-two-slow.toml \
      --no-progress --no-telemetry --log "$O/mlp-emulate-$mode.jsonl"
  echo "$mode: exit $?"
done
