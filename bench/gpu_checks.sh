#!/usr/bin/env bash
# Every one-GPU check of the runtime, in one command, for one lease of a GPU machine:
#   bash bench/gpu_checks.sh OUT [SECONDS]
# Runs from the repository root with the repository on PYTHONPATH (no install needed).
# Each check writes its JSON and log under OUT and gets its own time limit, so the whole
# stays within SECONDS (default 590); the checks run in the order their results are
# needed (fp16 smoke, fault suite, Hugging Face Llama, recompute memory, efficiency).
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT [SECONDS]}
budget=${2:-590}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$out/card.txt"

check() {  # check NAME LIMIT COMMAND...: run with at most LIMIT s of what is left
  local name=$1 limit=$2; shift 2
  local left=$((budget - (SECONDS - start) - 5))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "$name: skipped (no time left)"; return; fi
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s"
}

check fp16 60 python -m dynpipe train --model gpt --model-arg depth=2 --model-arg width=256 \
  --model-arg heads=4 --model-arg seq_len=128 --model-arg vocab=256 --nproc 1 --device cuda \
  --fp16 --steps 40 --batch-size 16 --no-progress --log "$out/fp16.jsonl"
check faults 260 python bench/gpu_faults.py "$out/faults"
check hf_llama 150 python bench/hf_llama.py --device cuda --blocks 4 -o "$out/hf_llama.json"
check recompute 100 python bench/recompute_memory.py -o "$out/recompute_memory.json"
check efficiency 400 python bench/gpu_efficiency.py --steps 12 --warmup 8 -o "$out/efficiency.json"
tail -n 3 "$out"/fp16.log
tail -n 12 "$out"/faults.log "$out"/hf_llama.log "$out"/recompute.log "$out"/efficiency.log
