#!/usr/bin/env bash
# Adaptive-runtime GPU benchmark on 2 GPUs: a real interferer on stage 1's GPU from step 60
# to 160; static, measured, adaptive and restart in the same runtime; then a static run of
# the plan the adaptive run chose (the best static plan for the interference phase).
#   bench/gpu_adapt.sh MODEL OUTDIR [PREDICTOR] [KINDS]
# Raw logs land in OUTDIR/<model>-<kind>-<mode>.jsonl; analysis/adapt_table.py tabulates them.
set -u
M=$1; O=$2; P=${3:-}; KINDS=${4:-"gemm copy"}
mkdir -p "$O"
case $M in
  vgg16) ARGS=(--model vgg16 --model-arg image_size=224 --model-arg num_classes=1000
               --batch-size 64 --microbatches 8) ;;
  gpt)   ARGS=(--model gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12
               --model-arg seq_len=512 --batch-size 32 --microbatches 8) ;;
  *) echo "unknown model $M"; exit 2 ;;
esac
COMMON=(--nproc 2 --device cuda --bf16 --steps 200 --optimizer adamw --lr 1e-4 --no-progress
        --monitor-every 5 --timeout 300)
run() {  # name, extra args...
  local name=$1; shift
  local t0=$(date +%s)
  python3 -m dynpipe train "${ARGS[@]}" "${COMMON[@]}" --log "$O/$name.jsonl" "$@" \
    > "$O/$name.out" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 ))s"
}
for kind in $KINDS; do
  S=runtime/scenarios/gpu-$kind-stage1.toml
  modes="static measured adaptive restart"
  [ "$kind" = copy ] && modes="static adaptive"
  for mode in $modes; do
    extra=(--adapt "$mode" --scenario "$S")
    [ "$mode" = adaptive ] && [ -n "$P" ] && extra+=(--predictor "$P")
    [ "$mode" = restart ] && [ -n "$P" ] && extra+=(--predictor "$P")
    [ "$mode" = restart ] && extra+=(--save-dir "$O/ckpt-$M-$kind")
    run "$M-$kind-$mode" "${extra[@]}"
  done
  # The plan the adaptive run moved to during the interference, as a static plan.
  python3 - "$O/$M-$kind-adaptive.jsonl" "$O/$M-$kind-tuned.json" <<'PY'
import json, sys
from dynpipe.planner import Plan
from dynpipe.runtime.runlog import read_log
reps = [r for r in read_log(sys.argv[1]) if r.get("event") == "repartition"]
if reps:
    Plan.from_dict(reps[0]["new_plan"]).save(sys.argv[2])
PY
  [ -f "$O/$M-$kind-tuned.json" ] && run "$M-$kind-static_tuned" --adapt static --scenario "$S" \
      --plan "$O/$M-$kind-tuned.json"
done
