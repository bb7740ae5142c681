#!/usr/bin/env bash
# GPU check of the adaptive runtime on 2 GPUs: per-layer CUDA timing, the measured-cost
# controller and live migration, with a real `gemm` interferer on stage 1 from step 30 to 60.
#   bash bench/gpu_check.sh OUTDIR [CONFIG]     (CONFIG: a bench/oracle.py config name)
# Prints the run's decisions and per-layer timings; the log lands in OUTDIR/check.jsonl.
set -u
O=$1; C=${2:-vgg16-b128}
mkdir -p "$O"
python3 - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for m in ("pandas", "pyarrow", "sklearn", "xgboost", "tqdm", "pynvml"):
    try:
        __import__(m); print(" ", m, "ok")
    except Exception as e:
        print(" ", m, "MISSING", e)
PY
cat > "$O/scn.toml" <<'T'
name = "check"
[[events]]
step = 30
action = "start"
kind = "gemm"
intensity = 1.0
count = 1
stage = 1
[[events]]
step = 60
action = "stop"
stage = 1
T
ARGS=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import oracle; print(' '.join(oracle.CONFIGS['$C']))")
timeout 400 python3 -m dynpipe train $ARGS --nproc 2 --device cuda --bf16 --device-batches 4 \
  --optimizer adamw --lr 1e-4 --steps 90 --adapt measured --scenario "$O/scn.toml" \
  --log "$O/check.jsonl" --no-progress --timeout 120 2>&1 | tail -20
python3 - "$O/check.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["type"] == "event" and r["event"] in ("decision", "repartition", "judged", "interference_start", "interference_stop"):
        print(r["step"], r["event"], r.get("reason", ""), r.get("slowdown", ""), r.get("verdict", ""), r.get("pause_ms", ""))
    elif r["type"] == "step" and r["step"] % 10 == 9:
        print("  step", r["step"], round(r["step_ms"], 2), [s["layers"] for s in r["stages"]])
    elif r["type"] == "layer_times" and r["step"] in (19, 49):
        print("  layers", r["step"], [round(x, 3) for x in r["fwd_ms"]], [round(x, 3) for x in r["bwd_ms"]], r["stage_fwd_ms"], r["stage_bwd_ms"])
PY
