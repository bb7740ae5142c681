#!/usr/bin/env bash
# Adaptive-runtime GPU benchmark on 2 GPUs: a real interferer on stage 1's GPU from step 60
# to 160; static, measured, adaptive and restart in the same runtime; then a static run of
# the plan the adaptive run chose (the best static plan for the interference phase).
#   bench/gpu_adapt.sh MODEL OUTDIR [PREDICTOR] [KINDS]
# KINDS: interferer kinds with a runtime/scenarios/gpu-<kind>-stage1.toml (default "gemm copy").
# DEVICE=cpu with MODEL=mlp and KINDS=emulate checks the script itself on a CPU machine.
# MODES overrides the systems run (default: static measured adaptive restart; copy: static
# adaptive); RUN_TIMEOUT bounds each run (seconds). Raw logs land in
# OUTDIR/<model>-<kind>-<mode>.jsonl; bench/adapt_table.py tabulates them.
set -u
M=$1; O=$2; P=${3:-}; KINDS=${4:-"gemm copy"}
mkdir -p "$O"
case $M in
  vgg16) ARGS=(--model vgg16 --model-arg image_size=224 --model-arg num_classes=1000
               --batch-size 64 --microbatches 8) ;;
  mlp)   ARGS=(--model mlp --model-arg width=256 --batch-size 64 --microbatches 4) ;;
  gpt)   ARGS=(--model gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12
               --model-arg seq_len=512 --batch-size 32 --microbatches 8) ;;
  *) echo "unknown model $M"; exit 2 ;;
esac
DEVICE=${DEVICE:-cuda}
BF16=(); [ "$DEVICE" = cuda ] && BF16=(--bf16)
COMMON=(--nproc 2 --device "$DEVICE" "${BF16[@]}" --steps ${STEPS:-200} --optimizer adamw --lr 1e-4 --no-progress
        --monitor-every 5 --timeout 300)
run() {  # name, extra args...
  local name=$1; shift
  local t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-600}" python3 -m dynpipe train "${ARGS[@]}" "${COMMON[@]}" \
    --log "$O/$name.jsonl" "$@" > "$O/$name.out" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 ))s"
}
tuned() {  # kind, scenario: the plan the adaptive run held during the interference, as static
  python3 - "$O/$M-$1-adaptive.jsonl" "$O/$M-$1-tuned.json" <<'PY'
import sys
from dynpipe.planner import Plan
from dynpipe.runtime.runlog import read_log
recs = read_log(sys.argv[1])
on = next(r["step"] for r in recs if r.get("event") == "interference_start")
off = next((r["step"] for r in recs if r.get("event") == "interference_stop"), 10**9)
reps = [r for r in recs if r.get("event") == "repartition" and on <= r["step"] < off]
if reps:
    Plan.from_dict(reps[-1]["new_plan"]).save(sys.argv[2])
PY
  [ -f "$O/$M-$1-tuned.json" ] && run "$M-$1-static_tuned" --adapt static --scenario "$2" \
      --plan "$O/$M-$1-tuned.json"
}
for kind in $KINDS; do
  S=runtime/scenarios/gpu-$kind-stage1.toml
  [ "$kind" = emulate ] && S=runtime/scenarios/emulate-3x-stage1.toml
  modes="static measured adaptive restart"
  [ "$kind" = copy ] && modes="static adaptive"
  modes=${MODES:-$modes}
  for mode in $modes; do
    extra=(--adapt "$mode" --scenario "$S")
    [ "$mode" = adaptive ] && [ -n "$P" ] && extra+=(--predictor "$P")
    [ "$mode" = restart ] && [ -n "$P" ] && extra+=(--predictor "$P")
    [ "$mode" = restart ] && extra+=(--save-dir "$O/ckpt-$M-$kind")
    run "$M-$kind-$mode" "${extra[@]}"
    [ "$mode" = adaptive ] && tuned "$kind" "$S"
  done
done
