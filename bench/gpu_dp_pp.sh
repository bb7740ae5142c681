#!/usr/bin/env bash
# Data x pipeline parallelism on one 4-GPU host: the same 4 GPUs as DP only (4 x 1), one
# 4-stage pipeline (1 x 4, even split), and 2 replicas x 2 stages (even split and shares)
# static, with a real 'gemm' interferer on GPU 3 (rank 3: replica 1's second stage in
# 2 x 2) from step 30 to 60 (recipes/scenarios/gpu-gemm-rank3.toml); the live policies with
# --reshape, free to change the shape among 1 x 4, 2 x 2 and 4 x 1 as well as shares and splits:
# adaptive and measured started as 2 x 2, adaptive started as DP only (adaptive-dp4); then a
# sweep run that holds every 2 x 2 split in turn, clean and then under the interferer: the
# oracle is the fastest static shape or split of each phase (bench/dp_pp_table.py prints
# the table from the raw logs).
#   bench/gpu_dp_pp.sh OUTDIR
# Models: vgg16 224x224 at batch 256 and gpt of width 2048 (12 blocks, 1024 tokens) at
# batch 32; every shape runs microbatches of the same size (32 images, 4 sequences): 2 per
# replica for 4 x 1, 4 for 2 x 2, 8 for 1 x 4. Four batches are kept on the GPUs
# (--device-batches 4), so the GPUs, not the loader, are measured.
# The whole script stops within BUDGET seconds (default 450; runs are ordered so the core
# comparison comes first - DP only, 2 x 2 static, 1 x 4 static and adaptive of each model,
# then adaptive-dp4 of each - and a run that would not fit is skipped, and said so); every run
# is also bounded by RUN_TIMEOUT (default 150). RESHAPE=0 runs the live policies without
# --reshape. Logs, outputs and the table are packed into
# OUTDIR/dp-pp-logs.tgz on exit, whatever happened.
# RUNS, if set, names the runs to do as MODEL-NAME (e.g. "gpt-measured gpt-sweep"); the others
# are skipped (the table then reads the runs that are in OUTDIR).
# DEVICE=cpu checks the script end to end on a CPU machine (a small mlp, an emulated 3x
# slowdown of rank 3: recipes/scenarios/emulate-3x-rank3.toml). MODELS overrides the models
# (vgg16 gpt); PREDICTOR, if set, is given to the adaptive runs; PARTIAL=1 adds a run of
# the adaptive policy with partial reduce allowed (it changes the training math).
# TRAIN_ARGS, if set, is added to every run's arguments (e.g. "--gc-every 0").
# STEPS, ONSET and END (default 90, 30, 60) move the interferer's steps: the scenario is
# the recipe's with its start and stop steps replaced (longer phases let a live policy's
# confirmation windows and pauses weigh less in a phase's mean).
# NPROC=2 runs the same on a 2-GPU host: DP only (dp2, 2 x 1), one 2-stage pipeline (pp2,
# 1 x 2), the live policies started as one pipeline (adaptive, measured) and as DP only
# (adaptive-dp2), the sweep over the 1 x 2 splits, the interferer on GPU 1
# (recipes/scenarios/gpu-gemm-rank1.toml); there is no 2 x 2.
set -u
O=$1
mkdir -p "$O"
T0=$(date +%s)
BUDGET=${BUDGET:-450}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-90}; ONSET=${ONSET:-30}; END=${END:-60}; WARMUP=8; EVERY=5; SWEEP_WINDOWS=2
N=${NPROC:-4}
if [ "$N" != 4 ] && [ "$N" != 2 ]; then echo "NPROC must be 4 or 2, got $N"; exit 2; fi
# The shape the live policies and the sweep start from: 2 x 2, or one pipeline on 2 GPUs.
MID=$([ "$N" = 4 ] && echo 2x2 || echo 1x2)
if [ "$DEVICE" = cuda ]; then
  MODELS=${MODELS:-"vgg16 gpt"}
  SCENARIO=recipes/scenarios/gpu-gemm-rank$(( N - 1 )).toml
  EXTRA=(--bf16 --device-batches 4)
else
  MODELS=${MODELS:-"mlp"}
  SCENARIO=recipes/scenarios/emulate-3x-rank$(( N - 1 )).toml
  EXTRA=(--pin-cores)
fi
if [ "$END" -ge "$STEPS" ] || [ "$ONSET" -ge "$END" ]; then
  echo "need ONSET < END < STEPS, got $ONSET, $END, $STEPS"; exit 2
fi
pack() {
  [ -f "$O/meta.json" ] && python3 bench/dp_pp_table.py "$O" --json "$O/dp-pp-table.json" \
    > "$O/table.out" 2>&1
  # Written beside OUTDIR, then moved in: an archive growing inside the folder it packs
  # would change that folder while tar reads it.
  local tmp
  tmp=$(mktemp "${TMPDIR:-/tmp}/dp-pp-logs.XXXXXX")
  tar czf "$tmp" -C "$O" --exclude='dp-pp-logs.tgz' . && mv "$tmp" "$O/dp-pp-logs.tgz"
  echo "packed $O/dp-pp-logs.tgz after $(( $(date +%s) - T0 ))s"
}
trap pack EXIT

args_of() {  # model -> its arguments (without microbatches)
  case $1 in
    vgg16) echo --model vgg16 --model-arg image_size=224 --model-arg num_classes=1000 \
                --batch-size 256 ;;
    gpt)   echo --model gpt --model-arg depth=12 --model-arg width=2048 --model-arg heads=16 \
                --model-arg seq_len=1024 --batch-size 32 ;;
    mlp)   echo --model mlp --model-arg depth=6 --model-arg width=64 --batch-size 32 ;;
    *) echo "unknown model $1" >&2; exit 2 ;;
  esac
}
layers_of() {  # model arguments -> layer count
  python3 - "$@" <<'PY'
import argparse, sys
from dynpipe.runtime.cli import config_from_args, register
p = argparse.ArgumentParser()
register(p.add_subparsers())
from dynpipe.models import get_model
cfg = config_from_args(p.parse_args(["train", *sys.argv[1:]]))
print(len(get_model(cfg.model, **cfg.model_args)))
PY
}
sweep_scenario() {  # recipe, onset, out: the recipe's interferer switched on at ONSET only
  python3 - "$@" <<'PY'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
src, onset, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
doc = tomllib.loads(open(src).read())
start = next(e for e in doc["events"] if e["action"] == "start")
lines = [f'name = "{doc.get("name", "scenario")}-sweep"', "[[events]]", f"step = {onset}"]
for k, v in start.items():
    if k != "step":
        lines.append(f"{k} = {v!r}".replace("'", '"'))
open(out, "w").write("\n".join(lines) + "\n")
PY
}

phase_scenario() {  # recipe, onset, end, out: the recipe's events at ONSET and END
  python3 - "$@" <<'PY'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
src, onset, end, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
doc = tomllib.loads(open(src).read())
lines = [f'name = "{doc.get("name", "scenario")}-{onset}-{end}"']
for e in doc["events"]:
    lines.append("[[events]]")
    e = {**e, "step": onset if e["action"] == "start" else end}
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in e.items()]
open(out, "w").write("\n".join(lines) + "\n")
PY
}
phase_scenario "$SCENARIO" "$ONSET" "$END" "$O/scenario.toml"
SCENARIO=$O/scenario.toml

# The shapes' microbatches per replica (same microbatch size in every shape: 8 in all).
declare -A MB=([4x1]=2 [2x2]=4 [1x4]=8 [2x1]=4 [1x2]=8)
declare -A SWEEP_ONSET
python3 - "$O" "$STEPS" "$ONSET" "$END" "$WARMUP" "$EVERY" "$DEVICE" "$SCENARIO" $MODELS <<'PY'
import json, subprocess, sys
import os
o, steps, onset, end, warm, every, device, scenario, *models = sys.argv[1:]
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
json.dump({"steps": int(steps), "onset": int(onset), "end": int(end), "warmup": int(warm),
           "nproc": int(os.environ.get("NPROC", "4")),
           "monitor_every": int(every), "device": device, "scenario": scenario,
           "models": models, "sweep_onset": {},
           "reshape": os.environ.get("RESHAPE", "1") != "0",
           "train_args": os.environ.get("TRAIN_ARGS", ""),
           "revision": os.environ.get("DYNPIPE_REVISION") or rev.stdout.strip() or None},
          open(f"{o}/meta.json", "w"), indent=1)
PY
for m in $MODELS; do
  n=$(layers_of $(args_of "$m"))
  # n - 1 splits a pass, and the first pass holds the launch's split once more before them.
  SWEEP_ONSET[$m]=$(( n * SWEEP_WINDOWS * EVERY ))
  python3 - "$O/meta.json" "$m" "${SWEEP_ONSET[$m]}" <<'PY'
import json, sys
p, m, onset = sys.argv[1:]
meta = json.load(open(p)); meta["sweep_onset"][m] = int(onset); json.dump(meta, open(p, "w"), indent=1)
PY
  sweep_scenario "$SCENARIO" "${SWEEP_ONSET[$m]}" "$O/$m-sweep-scenario.toml"
  # The planner's choice of shape and split for these GPUs (analytic costs), beside the runs.
  python3 -m dynpipe plan $(args_of "$m" | sed 's/--model-arg/--set/g') --gpus "$N" \
    --bf16 --link-gbs 300 > "$O/$m-plan-gpus$N.txt" 2>&1
done

run() {  # model, name, shape, extra args...
  local m=$1 name=$2 shape=$3; shift 3
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $m-$name "* ]]; then return 0; fi
  local left=$(( BUDGET - ($(date +%s) - T0) - 15 ))
  if [ "$left" -lt 40 ]; then echo "$m-$name: skipped (${left}s of the budget left)"; return 0; fi
  local limit=$(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
  local dp=${shape%x*}
  local t0=$(date +%s)
  timeout "$limit" python3 -m dynpipe train $(args_of "$m") --nproc "$N" --dp "$dp" \
    --microbatches "${MB[$shape]}" --device "$DEVICE" "${EXTRA[@]}" --optimizer adamw \
    --lr 1e-4 --no-progress --monitor-every "$EVERY" --timeout 120 \
    --log "$O/$m-$name.jsonl" ${TRAIN_ARGS:-} "$@" > "$O/$m-$name.out" 2>&1
  echo "$m-$name: exit $? in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
}
# The live policies may change the dp x pp shape (2 x 2 <-> 4 x 1) unless RESHAPE=0.
LIVE=(); [ "${RESHAPE:-1}" != 0 ] && LIVE=(--reshape)
P=(); [ -n "${PREDICTOR:-}" ] && P=(--predictor "$PREDICTOR")
core() {  # model: the comparison the benchmark is for
  local m=$1
  run "$m" "dp$N" "${N}x1" --adapt static --steps "$STEPS" --scenario "$SCENARIO"
  [ "$N" = 4 ] && run "$m" static 2x2 --adapt static --steps "$STEPS" --scenario "$SCENARIO"
  # One pipeline over every GPU is a static shape of the oracle (gpt's fastest under the
  # interferer at 8515182), so it comes before the live runs.
  run "$m" "pp$N" "1x$N" --adapt static --steps "$STEPS" --scenario "$SCENARIO"
  run "$m" adaptive "$MID" --adapt adaptive "${P[@]}" "${LIVE[@]}" --steps "$STEPS" \
    --scenario "$SCENARIO"
}
core2() {  # model: the adaptive policy started as DP only
  local m=$1
  run "$m" "adaptive-dp$N" "${N}x1" --adapt adaptive "${P[@]}" "${LIVE[@]}" --steps "$STEPS" \
    --scenario "$SCENARIO"
}
rest() {
  local m=$1
  run "$m" measured "$MID" --adapt measured "${LIVE[@]}" --steps "$STEPS" --scenario "$SCENARIO"
  run "$m" sweep "$MID" --adapt sweep --sweep-windows "$SWEEP_WINDOWS" \
    --steps $(( 2 * ${SWEEP_ONSET[$m]} )) --scenario "$O/$m-sweep-scenario.toml"
  if [ -n "${PARTIAL:-}" ]; then
    run "$m" partial "$MID" --adapt adaptive --partial-reduce --steps "$STEPS" --scenario "$SCENARIO"
  fi
}
for m in $MODELS; do core "$m"; done
for m in $MODELS; do core2 "$m"; done
for m in $MODELS; do rest "$m"; done
