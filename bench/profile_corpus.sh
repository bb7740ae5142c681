#!/usr/bin/env bash
# The predictor's profile corpus on one GPU: 13 architectures (the zoo's mlp, vgg16, resnet50,
# gpt and bert; Hugging Face gpt2, llama, bert and vit built from configs; torchvision's
# ConvNeXt-T; MobileNetV3-Small, EfficientNet-B0 and an MLP-Mixer built from configs), each
# timed layer by layer alone and beside gemm / copy / train interferers, one parquet each.
#
#   bash bench/profile_corpus.sh OUT [SECONDS [EXTRA dynpipe profile corpus ARGS...]]
#
# SECONDS (default: none) is split evenly over the architectures; below 1800 the reduced
# sweep (recipes/sweeps/gpu-corpus-quick.toml: 8 conditions, 3 samples of 20 ms) and batch
# sizes 16 and 32 are used, else recipes/sweeps/gpu.toml's 15 conditions at 16, 32 and 64.
# 480 fits in about 8 minutes on an H100 (each architecture stops at its share and keeps
# every condition it finished); re-running with the same OUT resumes each file. The full
# corpus takes longer than one 10-minute call: run, as often as needed (each call gives every
# unfinished architecture another share; finished ones return at once),
#   bash bench/profile_corpus.sh OUT 540 --sweep recipes/sweeps/gpu.toml --batch-sizes 16,32,64
# Writes OUT/profiles/<card>-<arch>.parquet (card, driver and torch in each file's metadata),
# a markdown summary beside each, OUT/profiles/corpus.json and OUT/device.txt. Copy the
# parquet files into profiles/ and fit with
#   dynpipe predictor fit profiles/<card>-*.parquet -o predictor/<card>-corpus.json.gz \
#       --report predictor/<card>-corpus_report --splits model,interferer
# (xgboost is needed for the fit, not for this script).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/profile_corpus.sh OUT [SECONDS]}
SECONDS_BUDGET=${2:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/profiles"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    python - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"{torch.cuda.get_device_name(0)}")
for lib in ("transformers", "torchvision"):
    try:
        print(lib, __import__(lib).__version__)
    except Exception as exc:
        print(lib, "unavailable:", str(exc).splitlines()[0][:100])
PY
} | tee "$OUT/device.txt"
python -m dynpipe profile corpus "$OUT/profiles" --device cuda:0 --size gpu \
    ${SECONDS_BUDGET:+--seconds "$SECONDS_BUDGET"} "${@:3}"
for f in "$OUT"/profiles/*.parquet; do
    python -m dynpipe profile summary "$f" -o "${f%.parquet}.md" >/dev/null || true
done
ls -la "$OUT/profiles"
