#!/usr/bin/env bash
# Fit, evaluate and time the shipped slowdown predictor on the GPU profile datasets.
#
#   bash bench/fit_predictor.sh                          # every CUDA dataset in profiles/
#   bash bench/fit_predictor.sh profiles/h100.parquet    # the datasets given
#   NAME=h100 bash bench/fit_predictor.sh profiles/h100.parquet
#
# Writes predictor/$NAME.json.gz (xgboost, JSON; its cross-validated accuracy summary inside),
# predictor/${NAME}_report/ (report.md, report.json, pred_vs_measured.png, raw out-of-fold
# predictions, latency.json) and, when predictor/cpu.json.gz exists, how the CPU-trained
# predictor does on the GPU data without refitting (predictor/${NAME}_report/cpu_transfer/).
# Runs on the CPU of any host; nothing here needs the GPU. Copy predictor/${NAME}_report/report.md
# tables into predictor/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=${NAME:-gpu}
if [ "$#" -gt 0 ]; then
    DATA=("$@")
else
    mapfile -t DATA < <(python - <<'EOF'
from pathlib import Path
from dynpipe.profiler.schema import read_metadata
for p in sorted(Path("profiles").glob("*.parquet")):
    if read_metadata(p).get("device_type") == "cuda":
        print(p)
EOF
)
fi
if [ "${#DATA[@]}" -eq 0 ]; then
    echo "no CUDA profile datasets in profiles/; run the GPU sweep first (recipes/sweeps/gpu.toml)" >&2
    exit 2
fi
echo "datasets: ${DATA[*]}"

# 1. Fit on everything and cross-validate the same configuration: held-out conditions,
#    models, interferer kinds and (with two or more GPUs' datasets) devices, against random
#    forest, ridge, stage-mean and no-interference on the same folds. Fixed hyper-parameters.
python -m dynpipe predictor fit "${DATA[@]}" --estimator xgb \
    -o "predictor/${NAME}.json.gz" --report "predictor/${NAME}_report"

# 2. The saved file: schema, provenance, the accuracy summary it carries.
python -m dynpipe predictor show "predictor/${NAME}.json.gz"

# 3. Run-time cost of one call for 200 layers x 8 devices (target: median under 10 ms).
python bench/bench_predictor.py --predictor "predictor/${NAME}.json.gz" --threads 1 \
    --json "predictor/${NAME}_report/latency.json"

# 4. Transfer: the CPU-trained predictor on GPU data, no refit (telemetry means differ across
#    platforms, so expect this to be poor; it is the reason a GPU predictor is fitted at all).
if [ -f predictor/cpu.json.gz ]; then
    python -m dynpipe predictor eval predictor/cpu.json.gz "${DATA[@]}" --splits condition \
        -o "predictor/${NAME}_report/cpu_transfer"
fi
