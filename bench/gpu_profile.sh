#!/usr/bin/env bash
# GPU profile datasets for the predictor, on one GPU (written for an H100; about 8 minutes:
# ~1 min of checks, ~7 min of sweep — the same sweep took 233 s per batch size on an H200).
#
#   OUT=/path/to/results bash bench/gpu_profile.sh
#
# 1. checks the GPU paths (interferers, NVML telemetry, timing) with tests/test_profiler_gpu.py;
# 2. times every layer of vgg16 and resnet50 (224x224 images, 1000 classes) and gpt (512
#    tokens) in bfloat16 at batch sizes 32 and 64, forward and backward — the settings of the
#    shipped profiles/h200-*.parquet — alone and beside gemm / copy / train interferers at
#    four duty cycles, 2-3 co-located training jobs and a gemm+copy mix
#    (recipes/sweeps/gpu.toml), with three 20 ms timing samples per (layer, phase, condition);
# 3. writes $OUT/profiles/<gpu>-zoo.parquet and a markdown summary beside it.
#
# Re-running resumes: conditions already in the parquet are skipped. Copy the parquet and
# summary into profiles/ and add a line to profiles/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the datasets}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/profiles"
T0=$SECONDS
log() { printf '[%4ds] %s\n' "$((SECONDS - T0))" "$*"; }

log "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
python - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"{torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible")
EOF
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z')
SLUG=$(printf '%s' "$GPU" | grep -oE '[a-z]+[0-9]{2,4}[a-z]*' | grep -vE '^(nvidia|geforce|rtx|tesla)$' | head -1)
SLUG=${SLUG:-gpu}
DATA="$OUT/profiles/${SLUG}-zoo.parquet"

log "GPU checks: interferers, NVML telemetry, layer timing (about 1 minute)"
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_profiler_gpu.py 2>&1 | tail -15 \
    || log "GPU checks failed (see above); the sweep still runs"

log "telemetry seen from this process (2 s)"
python -m dynpipe profile telemetry --device cuda:0 --seconds 2

log "sweep -> $DATA"
python -m dynpipe profile \
    --model vgg16,resnet50,gpt --batch-size 32,64 \
    --set image_size=224 --set num_classes=1000 --set gpt.seq_len=512 --dtype bfloat16 \
    --sweep recipes/sweeps/gpu.toml --device cuda:0 --repeats 3 \
    -o "$DATA"

log "summary -> ${DATA%.parquet}.md"
python -m dynpipe profile summary "$DATA" -o "${DATA%.parquet}.md"
cat "${DATA%.parquet}.md"
log "done"
