#!/usr/bin/env bash
# Adaptive-runtime GPU benchmark: real interferers on one GPU (NPROC=2: stage 1, steps
# 60-160) or on one then two GPUs (NPROC=4: stage 1 from 60, stage 2 too from 110, both
# off at 160); static, measured, adaptive and restart in the same runtime; then a static
# run of the plan the adaptive run held at the end of the interference (the best static
# plan for that phase, found by the controller).
#   bench/gpu_adapt.sh MODEL OUTDIR [PREDICTOR] [KINDS]
# KINDS: interferer kinds with a recipes/scenarios/gpu-<kind>-{stage1,4stage}.toml
#   (default "gemm copy"). DEVICE=cpu with MODEL=mlp and KINDS=emulate checks the script
#   itself on a CPU machine.
# MODES overrides the systems run (default: static measured adaptive restart; static_tuned
# runs the plan in PLAN statically, for repeated runs); STEPS the run
# length; RUN_TIMEOUT bounds each run (seconds); CKPT is where the restart baseline writes
# its checkpoints (default OUTDIR; they are large); DATA_WORKERS the loader processes per
# rank (default: the runtime's choice); SNAPSHOT, if set, is a .tgz rewritten
# with OUTDIR's logs after every run (what survives a run killed by an outer time limit).
# Raw logs land in OUTDIR/<model>-<kind>-<mode>.jsonl; bench/adapt_table.py tabulates them.
set -u
M=$1; O=$2; P=${3:-}; KINDS=${4:-"gemm copy"}
NPROC=${NPROC:-2}
mkdir -p "$O"
case $M in
  # 64 images per microbatch keep the GPUs, not kernel launches, the limit. At 8 per
  # microbatch (vgg16small) the same layers' stage time varied 2x from launch to launch
  # and a GPU interferer slowed the step by only 15-25%. A batch of 512 at 224x224 is
  # 300 MB to make and copy each step, more than the loaders kept up with once the stages
  # were balanced: four batches stay on the GPUs and are cycled.
  vgg16)    ARGS=(--model vgg16 --model-arg image_size=224 --model-arg num_classes=1000
                  --batch-size 512 --microbatches 8 --device-batches 4) ;;
  vgg16small) ARGS=(--model vgg16 --model-arg image_size=224 --model-arg num_classes=1000
                  --batch-size 64 --microbatches 8) ;;
  resnet50) ARGS=(--model resnet50 --model-arg image_size=224 --model-arg num_classes=1000
                  --batch-size 64 --microbatches 8) ;;
  mlp)      ARGS=(--model mlp --model-arg width=256 --batch-size 64 --microbatches 4) ;;
  # Wide enough that the GPUs, not kernel launches, bound the step: at width 768 and 4x512
  # tokens per microbatch the CPU launching kernels was the limit and a GPU interferer did
  # not slow the pipeline at all (gptsmall).
  gpt)      ARGS=(--model gpt --model-arg depth=12 --model-arg width=2048 --model-arg heads=16
                  --model-arg seq_len=1024 --batch-size 32 --microbatches 8) ;;
  gptsmall) ARGS=(--model gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12
                  --model-arg seq_len=512 --batch-size 32 --microbatches 8) ;;
  *) echo "unknown model $M"; exit 2 ;;
esac
DEVICE=${DEVICE:-cuda}
BF16=(); [ "$DEVICE" = cuda ] && BF16=(--bf16)
WORKERS=(); [ -n "${DATA_WORKERS:-}" ] && WORKERS=(--data-workers "$DATA_WORKERS")
COMMON=(--nproc "$NPROC" "${WORKERS[@]}" --device "$DEVICE" "${BF16[@]}" --steps "${STEPS:-200}" --optimizer adamw
        --lr 1e-4 --no-progress --monitor-every 5 --timeout 300)
run() {  # name, extra args...
  local name=$1; shift
  local t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-600}" python3 -m dynpipe train "${ARGS[@]}" "${COMMON[@]}" \
    --log "$O/$name.jsonl" "$@" > "$O/$name.out" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 ))s"
  [ -n "${SNAPSHOT:-}" ] && tar czf "$SNAPSHOT" -C "$O" --exclude='ckpt-*' .
  return 0
}
tuned() {  # kind, scenario: the plan the adaptive run held when the interference ended
  [ -n "${PLAN:-}" ] && return 0  # a given plan runs as static_tuned instead (MODES)
  python3 - "$O/$M-$1-adaptive.jsonl" "$O/$M-$1-tuned.json" <<'PY'
import sys
from dynpipe.planner import Plan
from dynpipe.runtime.records import read_log
log = read_log(sys.argv[1])
on = min(e.step for e in log.events("interference_start"))
off = max((e.step for e in log.events("interference_stop")), default=10**9)
reps = [e for e in log.events("repartition") if on <= e.step < off]
if reps:
    Plan.from_dict(reps[-1]["new_plan"]).save(sys.argv[2])
PY
  [ -f "$O/$M-$1-tuned.json" ] && run "$M-$1-static_tuned" --adapt static --scenario "$2" \
      --plan "$O/$M-$1-tuned.json"
}
for kind in $KINDS; do
  S=recipes/scenarios/gpu-$kind-stage1.toml
  [ "$NPROC" = 4 ] && S=recipes/scenarios/gpu-$kind-4stage.toml
  [ "$kind" = emulate ] && S=recipes/scenarios/emulate-3x-stage1.toml
  for mode in ${MODES:-static measured adaptive restart}; do
    if [ "$mode" = static_tuned ]; then  # a given plan (PLAN=file), static
      run "$M-$kind-static_tuned" --adapt static --scenario "$S" --plan "$PLAN"; continue
    fi
    extra=(--adapt "$mode" --scenario "$S")
    case $mode in adaptive|restart) [ -n "$P" ] && extra+=(--predictor "$P") ;; esac
    [ "$mode" = restart ] && extra+=(--save-dir "${CKPT:-$O}/ckpt-$M-$kind")
    run "$M-$kind-$mode" "${extra[@]}"
    [ "$mode" = adaptive ] && tuned "$kind" "$S"
  done
done
