#!/usr/bin/env bash
# Runs bench/oracle.py experiments in lanes of GPUs of one host, lanes in parallel, the
# experiments of a lane one after another; then reports each (one that LANE_TIMEOUT cut, from
# the logs it has) and packs every log.
#   bash bench/oracle_lanes.sh OUTDIR LANE [LANE ...]
# LANE: GPUS=EXP+EXP+...   EXP: CONFIG:INTERFERERS:STAGES[:SYSTEMS[:PROFILE]]   e.g.
#   0,1=vgg16-b128:gemm:1+resnet50-b256:copy:0  2,3=gpt-w2048:gemm:0:sweep,static,adaptive
# PROFILE: every system starts from the split `dynpipe plan` picks from that profile dataset
# (oracle.py --plan-profile; default: the even split).
# Set DYNPIPE_REVISION to the commit under test where the tree is a copy (the device machine's):
# its git metadata may be older than its files, and every run log's header names it.
# A lane of 4 GPUs runs 4 stages. PREDICTOR (default predictor/h200.json.gz), STEPS, ONSET,
# END, SWEEP_WINDOWS, SWEEP_PLANS, LANE_TIMEOUT (seconds) and DEVICE (cuda; cpu checks the script on a CPU machine,
# a lane's "GPUS" then only counting its stages) are read from the environment. Logs and reports land in
# OUTDIR/<config>-<interferers>-s<stages>/ and OUTDIR/oracle-logs.tgz.
set -u
O=$1; shift
mkdir -p "$O"
P=${PREDICTOR:-predictor/h200.json.gz}
lane() {  # gpus, experiments
  local gpus=$1 exps=$2 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  for exp in ${exps//+/ }; do
    IFS=: read -r cfg kinds stages systems profile <<< "$exp"
    local d="$O/$cfg-${kinds//,/+}-s${stages//,/+}${profile:+-planned}"
    CUDA_VISIBLE_DEVICES=$gpus python3 bench/oracle.py run --config "$cfg" --interferer "$kinds" \
      --stage "$stages" --nproc "$n" --device "${DEVICE:-cuda}" --steps "${STEPS:-150}" --onset "${ONSET:-40}" \
      --end "${END:-100}" --predictor "$P" --ckpt "/tmp/ckpt-$cfg-$gpus" \
      --sweep-windows "${SWEEP_WINDOWS:-3}" --sweep-plans "${SWEEP_PLANS:-12}" \
      --systems "${systems:-sweep,static,measured,adaptive,restart}" \
      ${profile:+--plan-profile "$profile"} -o "$d"
    python3 bench/oracle.py report "$d" -o "$d/report.json"
  done
}
pids=()
for spec in "$@"; do
  timeout "${LANE_TIMEOUT:-560}" bash -c "$(declare -f lane); O='$O' P='$P' STEPS='${STEPS:-}' ONSET='${ONSET:-}' END='${END:-}' DEVICE='${DEVICE:-}' SWEEP_WINDOWS='${SWEEP_WINDOWS:-}' SWEEP_PLANS='${SWEEP_PLANS:-}' lane '${spec%%=*}' '${spec#*=}'" > "$O/lane-${spec%%=*}.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
cat "$O"/lane-*.txt
# A lane cut by LANE_TIMEOUT loses the report of the experiment it was in: report every
# experiment that has none from the logs it has (a run cut short shows the phases it ran).
for d in "$O"/*/; do
  if [ -f "$d/oracle.json" ] && [ ! -f "$d/report.json" ]; then
    echo "$(basename "$d") (cut by the lane's time; reported from its logs):"
    python3 bench/oracle.py report "$d" -o "$d/report.json" 2>&1 | tail -n 4
  fi
done
tar czf /tmp/oracle-logs.tgz -C "$O" --exclude='*.tgz' --exclude='ckpt-*' . && mv /tmp/oracle-logs.tgz "$O/"
