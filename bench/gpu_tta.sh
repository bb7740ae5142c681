#!/usr/bin/env bash
# Time to accuracy and scaling on GPU: a model trained on real data available offline, with
# a held-out evaluation every EVAL_EVERY steps, a real 'gemm' interferer on stage 1's GPU
# from step 100 to 450 of 600 (recipes/scenarios/gpu-gemm-long-stage1.toml). TTA_MODEL picks
# the model and its data:
#   gpt (default)  12 x 768, 512 tokens, batch 64 / 8 microbatches, on this Python's
#                  standard library sources (--data pystdlib); next-byte accuracy
#   resnet50       224 x 224, batch 256 / 8, on scikit-learn's digits as images (--data
#                  digits: upsampled from 8x8, augmented in training); top-1 accuracy
#   vgg16          224 x 224, batch 128 / 8, on the same digit images
# all bf16, AdamW (LR, default 3e-4 for gpt, 1e-3 for resnet50, 1e-4 for vgg16, which has
# no batch norm) with WARMUP (30) steps of warm-up.
# Runs, in order (the restart baseline last: its relaunches make it the longest):
#   tta-static-2    2 GPUs, the even split, never moves
#   tta-adaptive-2  2 GPUs, --adapt adaptive (the shipped predictor), live moves
#   tta-static-1    1 GPU, the whole model, the interferer on that GPU over the same steps
#                   (gpu-gemm-long-stage0.toml): the scaling figure's one-GPU point
#   tta-restart-2   2 GPUs, --adapt restart: the same decisions applied by checkpoint,
#                   exit and relaunch (the original DynPipe's way)
#   tta-static-4, tta-adaptive-4   4 GPUs (4 stages, the interferer on stage 1 as in the
#                   2-GPU runs): the scaling figure's four-GPU points (not in the default
#                   RUNS; name them on a 4-GPU host)
# Every run trains the same model on the same batches (same seed): the eval curves over
# steps agree, and time to a target is what adaptation changes. Then `dynpipe figures`
# draws time to accuracy (the 2-GPU runs) and throughput against GPU count (all runs), with
# summary.md, from the raw logs only.
#   bench/gpu_tta.sh OUTDIR
#   TTA_MODEL=resnet50 bench/gpu_tta.sh OUTDIR
# INTERFERER, ISTAGE, ONSET, END: another interference scenario (see below); TTA_ARGS: more
# train arguments, e.g. TTA_ARGS="--batch-size 256".
# RUNS picks and orders the runs (default "static-2 adaptive-2 static-1 restart-2").
# Every run is bounded by RUN_TIMEOUT (default 150 s) and the script by BUDGET (default
# 540 s; a run that would not fit is skipped, and said so). Logs, figures and outputs are
# packed into OUTDIR/tta-logs.tgz on exit (checkpoints left out).
# DEVICE=cpu checks the script end to end on a CPU machine (a tiny model of the same kind:
# gpt 4 x 32, or resnet50 / vgg16 at a sixteenth of their width on 16 x 16 / 32 x 32
# digits, with a shorter warm-up; 60 steps, an emulated 3x slowdown,
# recipes/scenarios/emulate-3x-long-stage{0,1}.toml); it says nothing about speed.
set -u
O=$1
mkdir -p "$O"
T0=$(date +%s)
# shellcheck source=bench/budget.sh
. "$(dirname "$0")/budget.sh"
BUDGET=${BUDGET:-540}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
DEVICE=${DEVICE:-cuda}
PREDICTOR=${PREDICTOR:-predictor/h200.json.gz}
TTA_MODEL=${TTA_MODEL:-gpt}
EVAL_BATCHES=2
case "$DEVICE/$TTA_MODEL" in
  cuda/gpt)
    # 12 x 768 at 8 x 512 tokens per microbatch: ~85 ms a step on two GPUs (H200,
    # bench/results/pipeline-gpt-gpu-2st.json), GPU-bound enough that one gemm interferer
    # slows its stage.
    MODEL=(--model gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12
           --model-arg seq_len=512 --batch-size 64 --microbatches 8 --bf16)
    EVAL_BATCHES=8 ;;
  cuda/resnet50)
    # ~110 ms a step on two H100s (docs/results/oracle.md); one evaluation is one batch,
    # 256 of the 359 held-out digits. A loader worker makes a batch on one core (the
    # digit images are generated, not read: bench/bench_loader.py --data digits).
    MODEL=(--model resnet50 --model-arg image_size=224 --batch-size 256 --microbatches 8 --bf16)
    EVAL_BATCHES=1 ;;
  cuda/vgg16)
    # ~50-65 ms a step on two H100s (docs/results/oracle.md); two batches, 256 digits.
    MODEL=(--model vgg16 --model-arg image_size=224 --batch-size 128 --microbatches 8 --bf16) ;;
  cpu/gpt)
    MODEL=(--model gpt --model-arg depth=4 --model-arg width=32 --model-arg heads=2
           --model-arg seq_len=16 --batch-size 16 --microbatches 4 --pin-cores) ;;
  cpu/resnet50)
    # A tiny net shows the digits being learnt within 60 steps of 32 only at a higher rate,
    # a short warm-up, and batch norm over microbatches of 16.
    MODEL=(--model resnet50 --model-arg width_mult=0.0625 --model-arg image_size=16
           --batch-size 32 --microbatches 2 --pin-cores)
    LR=${LR:-1e-2}; WARMUP=${WARMUP:-10} ;;
  cpu/vgg16)
    MODEL=(--model vgg16 --model-arg width_mult=0.0625 --model-arg image_size=32
           --batch-size 32 --microbatches 4 --pin-cores)
    LR=${LR:-1e-3}; WARMUP=${WARMUP:-10} ;;
  *) echo "gpu_tta.sh: TTA_MODEL must be gpt, resnet50 or vgg16 and DEVICE cuda or cpu," \
          "got TTA_MODEL=$TTA_MODEL DEVICE=$DEVICE"; exit 2 ;;
esac
WARMUP=${WARMUP:-30}
case $TTA_MODEL in
  gpt) DATA=pystdlib; LR=${LR:-3e-4} ;;
  resnet50) DATA=digits; LR=${LR:-1e-3} ;;
  vgg16) DATA=digits; LR=${LR:-1e-4} ;;
esac
if [ "$DEVICE" = cuda ]; then
  # An image model's evaluation is one or two batches: every 25 steps, twice gpt's rate.
  STEPS=${STEPS:-600}; EVAL_EVERY=${EVAL_EVERY:-$([ "$TTA_MODEL" = gpt ] && echo 50 || echo 25)}
  S1=recipes/scenarios/gpu-gemm-long-stage1.toml
  S0=recipes/scenarios/gpu-gemm-long-stage0.toml
else
  STEPS=${STEPS:-60}; EVAL_EVERY=${EVAL_EVERY:-20}
  S1=recipes/scenarios/emulate-3x-long-stage1.toml
  S0=recipes/scenarios/emulate-3x-long-stage0.toml
fi
if [ -n "${INTERFERER:-}" ]; then
  # Another interferer, stage or window than the recipes': INTERFERER (gemm, copy, train,
  # emulate) on stage ISTAGE (default 1) of the pipelines, on the one GPU of static-1,
  # from step ONSET (default 100) to END (default 450).
  scn() {  # path, stage
    printf 'name = "tta %s on stage %s"\n[[events]]\nstep = %s\naction = "start"\n' \
      "$INTERFERER" "$2" "${ONSET:-100}" > "$1"
    printf 'kind = "%s"\nintensity = 1.0\ncount = 1\nstage = %s\n' "$INTERFERER" "$2" >> "$1"
    [ "$INTERFERER" = emulate ] && echo 'factor = 3.0' >> "$1"
    printf '[[events]]\nstep = %s\naction = "stop"\nstage = %s\n' "${END:-450}" "$2" >> "$1"
  }
  S1=$O/scenario-pipeline.toml; S0=$O/scenario-one-gpu.toml
  scn "$S1" "${ISTAGE:-1}"; scn "$S0" 0
fi
# TTA_ARGS: more train arguments, after the model's (a later --batch-size wins).
read -r -a EXTRA <<< "${TTA_ARGS:-}"
MODEL+=("${EXTRA[@]}")
pack() {
  local figs
  figs=$(ls "$O"/tta-*-2/log.jsonl 2>/dev/null)
  # shellcheck disable=SC2086  # one path per word
  [ -n "$figs" ] && python3 -m dynpipe figures -o "$O/figures-tta" $figs > "$O/figures-tta.out" 2>&1
  figs=$(ls "$O"/tta-*/log.jsonl 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$figs" ] && python3 -m dynpipe figures -o "$O/figures-scaling" $figs > "$O/figures-scaling.out" 2>&1
  cat "$O/figures-tta/summary.md" 2>/dev/null
  local tmp
  tmp=$(mktemp "${TMPDIR:-/tmp}/tta-logs.XXXXXX")
  tar czf "$tmp" -C "$O" --exclude='tta-logs.tgz' --exclude='ckpt' . && mv "$tmp" "$O/tta-logs.tgz"
  echo "packed $O/tta-logs.tgz after $(( $(date +%s) - T0 ))s"
}
trap pack EXIT
python3 - "$O" "$STEPS" "$DEVICE" "$S1" "$S0" "$TTA_MODEL" "$DATA" "$LR" "$WARMUP" "${MODEL[*]}" <<'PY'
import json, os, subprocess, sys
o, steps, device, s1, s0, model, data, lr, warmup, args = sys.argv[1:]
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
json.dump({"steps": int(steps), "device": device, "scenario_2gpu": s1, "scenario_1gpu": s0,
           "model": model, "data": data, "lr": float(lr), "warmup": int(warmup), "model_args": args,
           "revision": os.environ.get("DYNPIPE_REVISION") or rev.stdout.strip() or None}, open(f"{o}/meta.json", "w"), indent=1)
PY

run() {  # name, nproc, extra args...
  local name=$1 n=$2; shift 2
  local limit
  limit=$(run_limit "$name" 20 40) || return 0
  local t0=$(date +%s)
  mkdir -p "$O/$name"
  timeout "$limit" python3 -m dynpipe train --nproc "$n" --device "$DEVICE" "${MODEL[@]}" \
    --data "$DATA" --steps "$STEPS" --eval-every "$EVAL_EVERY" --eval-batches "$EVAL_BATCHES" \
    --optimizer adamw --lr "$LR" --warmup "$WARMUP" --no-progress --monitor-every 5 --timeout 120 \
    --log "$O/$name/log.jsonl" "$@" > "$O/$name/out.txt" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
}

for r in ${RUNS:-static-2 adaptive-2 static-1 restart-2}; do
  case $r in
    static-2) run tta-static-2 2 --adapt static --scenario "$S1" ;;
    adaptive-2) run tta-adaptive-2 2 --adapt adaptive --predictor "$PREDICTOR" --scenario "$S1" ;;
    static-1) run tta-static-1 1 --adapt static --scenario "$S0" ;;
    static-4) run tta-static-4 4 --adapt static --scenario "$S1" ;;
    adaptive-4) run tta-adaptive-4 4 --adapt adaptive --predictor "$PREDICTOR" --scenario "$S1" ;;
    restart-2) run tta-restart-2 2 --adapt restart --predictor "$PREDICTOR" --scenario "$S1" \
                 --save-dir "$O/ckpt" ;;
    *) echo "unknown run $r (static-2, adaptive-2, static-1, restart-2, static-4, adaptive-4)"; exit 2 ;;
  esac
done
