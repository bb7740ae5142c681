#!/usr/bin/env bash
# Elastic stage count on one host of NGPU GPUs (4 by default; 2 where no 4-GPU host is
# lent): the last GPU (rank L = NGPU-1) taken by a heavy interferer (three co-located 'gemm'
# jobs, recipes/scenarios/gpu-gemm3-rank<L>.toml) from step 30 to 90 of 130.
# Runs, in order:
#   keep-static    NGPU stages, the even split, never moves
#   keep-measured  NGPU stages, the controller re-splits over all GPUs (no --elastic)
#   drop-static    NGPU-1 stages (--nproc NGPU-1): GPU L left out for the whole run
#   elastic        NGPU ranks, --adapt measured --elastic: the controller may leave GPU L
#                  idle and take it back (its probe) when the interferer is gone
#   release        NGPU ranks, --adapt measured; an operator's release of rank L (the request
#                  `dynpipe release --rank L` writes) as
#                  soon as the log reaches step 30, `dynpipe reclaim --rank L` at step 90
#   freeze / nofreeze  gpt 12 x 768 on real text (pystdlib, a fresh batch every step: the
#                  held-out accuracy must not be read off a model that saw four batches)
#                  with --eval-every, AdamW with warm-up and cosine decay over FREEZE_STEPS
#                  (default 900), both --adapt measured --elastic, with and without
#                  --freeze: time to accuracy (freezing changes what training computes)
#   freeze-autodp  (AUTODP=1, the default; AUTODP=0 leaves it out) the freeze run with
#                  --autodp: GPUs the frozen prefix frees host more pipeline replicas, live;
#                  last, so the runs above are the same either way (on CPU it freezes with
#                  threshold 1e9 and patience 1, as fast as --freeze-alpha allows, so the
#                  check reshapes)
# bench/elastic_table.py prints per-phase median step times (before / during / after the
# interferer) and the freeze runs' time to accuracy from the raw logs.
#   bench/gpu_elastic.sh OUTDIR
# Every run is bounded by RUN_TIMEOUT (default 90 s) and the script by BUDGET (default
# 560 s; a run that would not fit is skipped, and said so). Logs, outputs and the table
# are packed into OUTDIR/elastic-logs.tgz on exit.
# WIDTH (default 1024) is the width of the gpt of the keep / drop runs: at 2048 its
# microbatches of 4 sequences keep a GPU busy, where at 1024 they are launch-bound.
# HEAVY=train uses three 'train' interferers instead (recipes/scenarios/gpu-train3-rank3.toml;
# NGPU=4 only). RUNS, if set, names the runs to do (e.g. "keep-static drop-static elastic");
# the others are skipped.
# DEVICE=cpu checks the script end to end on a CPU machine (a small mlp / gpt, an emulated
# 10x slowdown of rank L: recipes/scenarios/emulate-10x-rank<L>.toml); it says nothing about
# speed.
set -u
O=$1
mkdir -p "$O"
T0=$(date +%s)
# shellcheck source=bench/budget.sh
. "$(dirname "$0")/budget.sh"
BUDGET=${BUDGET:-560}
RUN_TIMEOUT=${RUN_TIMEOUT:-90}
DEVICE=${DEVICE:-cuda}
NGPU=${NGPU:-4}
AUTODP=${AUTODP:-1}
L=$(( NGPU - 1 ))
if [ "$NGPU" -lt 2 ]; then echo "NGPU must be >= 2, got $NGPU"; exit 2; fi
STEPS=130; ONSET=30; END=90; EVERY=5
if [ "$DEVICE" = cuda ]; then
  SCENARIO=recipes/scenarios/gpu-${HEAVY:-gemm}3-rank$L.toml
  if [ ! -f "$SCENARIO" ]; then echo "no scenario $SCENARIO (HEAVY=gemm or train)"; exit 2; fi
  MODEL=(--model gpt --model-arg depth=12 --model-arg width="${WIDTH:-1024}" --model-arg heads=16
         --model-arg seq_len=1024 --batch-size 32 --microbatches 8 --device-batches 4)
  # bench/gpu_tta.sh's gpt and schedule (its learning rate reaches 3e-4 after 30 steps).
  TEXT=(--model gpt --model-arg depth=12 --model-arg width=768 --model-arg heads=12
        --model-arg seq_len=512 --data pystdlib --batch-size 64 --microbatches 8
        --lr 3e-4 --warmup 30 --lr-schedule cosine --eval-batches 8)
  EXTRA=(--bf16)
  FREEZE_STEPS=${FREEZE_STEPS:-900}; EVAL_EVERY=50; AUTODP_THRESHOLD=0.05; AUTODP_PATIENCE=10
else
  SCENARIO=recipes/scenarios/emulate-10x-rank$L.toml
  MODEL=(--model mlp --model-arg depth=6 --model-arg width=64 --batch-size 32 --microbatches 4)
  TEXT=(--model gpt --model-arg depth=2 --model-arg width=32 --model-arg heads=2
        --model-arg seq_len=16 --data pystdlib --batch-size 16 --microbatches 4)
  EXTRA=(--pin-cores)
  FREEZE_STEPS=60; EVAL_EVERY=20; AUTODP_THRESHOLD=1e9; AUTODP_PATIENCE=1
fi
pack() {
  python3 bench/elastic_table.py "$O" > "$O/table.out" 2>&1
  cat "$O/table.out"
  local tmp
  tmp=$(mktemp "${TMPDIR:-/tmp}/elastic-logs.XXXXXX")
  tar czf "$tmp" -C "$O" --exclude='elastic-logs.tgz' . && mv "$tmp" "$O/elastic-logs.tgz"
  echo "packed $O/elastic-logs.tgz after $(( $(date +%s) - T0 ))s"
}
trap pack EXIT
python3 - "$O" "$STEPS" "$ONSET" "$END" "$EVERY" "$DEVICE" "$SCENARIO" "$NGPU" <<'PY'
import json, os, subprocess, sys
o, steps, onset, end, every, device, scenario, ngpu = sys.argv[1:]
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
json.dump({"steps": int(steps), "onset": int(onset), "end": int(end), "monitor_every": int(every),
           "device": device, "scenario": scenario, "gpus": int(ngpu), "revision": os.environ.get("DYNPIPE_REVISION") or rev.stdout.strip() or None},
          open(f"{o}/meta.json", "w"), indent=1)
PY

run() {  # name, nproc, extra args...
  local name=$1 n=$2; shift 2
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then return 0; fi
  local limit
  limit=$(run_limit "$name" 15 30) || return 0
  local t0=$(date +%s)
  mkdir -p "$O/$name"
  timeout "$limit" python3 -m dynpipe train --nproc "$n" --device "$DEVICE" "${EXTRA[@]}" \
    --optimizer adamw --lr 1e-4 --no-progress --monitor-every "$EVERY" --timeout 120 \
    --log "$O/$name/log.jsonl" "$@" > "$O/$name/out.txt" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
}
operator() {  # run dir: release rank L once the log reaches ONSET, reclaim it at END
  python3 - "$1" "$ONSET" "$END" "$L" <<'PY' &
import json, pathlib, sys, time
# The request itself, not `dynpipe release` in a new process: that imports torch first, 4-5 s
# on a GPU host, and a reclaim written after step 89 reached the job after its last window.
from dynpipe.runtime.requests import request
run, onset, end, rank = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
log, done = run / "log.jsonl", set()
deadline = time.time() + 600
while time.time() < deadline and len(done) < 2:
    time.sleep(0.2)
    if not log.is_file():
        continue
    last = -1
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("type") == "step":
            last = max(last, int(rec["step"]))
    for verb, at in (("release", onset), ("reclaim", end)):
        if verb not in done and last + 1 >= at:
            now = request(run, **{verb: rank})
            print(f"operator: {verb} rank {rank} after step {last} at {time.time():.3f}; "
                  f"released ranks now {now}", flush=True)
            done.add(verb)
PY
}

run keep-static "$NGPU" "${MODEL[@]}" --steps "$STEPS" --adapt static --scenario "$SCENARIO"
run elastic "$NGPU" "${MODEL[@]}" --steps "$STEPS" --adapt measured --elastic --scenario "$SCENARIO"
run drop-static "$L" "${MODEL[@]}" --steps "$STEPS" --adapt static
run keep-measured "$NGPU" "${MODEL[@]}" --steps "$STEPS" --adapt measured --scenario "$SCENARIO"
if [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" release "* ]]; then
  mkdir -p "$O/release"
  operator "$O/release" > "$O/release/operator.txt" 2>&1
fi
run release "$NGPU" "${MODEL[@]}" --steps "$STEPS" --adapt measured --scenario "$SCENARIO"
wait
run nofreeze "$NGPU" "${TEXT[@]}" --steps "$FREEZE_STEPS" --eval-every "$EVAL_EVERY" --adapt measured \
  --elastic
run freeze "$NGPU" "${TEXT[@]}" --steps "$FREEZE_STEPS" --eval-every "$EVAL_EVERY" --adapt measured \
  --elastic --freeze --freeze-every 20 --freeze-threshold 0.05
if [ "$AUTODP" = 1 ]; then
  run freeze-autodp "$NGPU" "${TEXT[@]}" --steps "$FREEZE_STEPS" --eval-every "$EVAL_EVERY" \
    --adapt measured --elastic --freeze --freeze-every 20 --freeze-threshold "$AUTODP_THRESHOLD" \
    --freeze-patience "$AUTODP_PATIENCE" --autodp
fi
