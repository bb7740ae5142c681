#!/usr/bin/env bash
# The multi-stage schedules against another torch (the GPU machine's 2.11): torch's
# pipelining API as dynpipe drives it (gloo ranks on CPU, bit-identical to one process,
# with a repartition and an evaluation), the plan checks and the schedule simulator over
# that torch's action lists. Writes $OUT/schedules-torch-check.txt.
#   bash bench/schedules_torch_check.sh
set -u
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
{
  python -c "import torch, torch.distributed.pipelining as p; print('torch', torch.__version__); print([n for n in ('ScheduleInterleaved1F1B','ScheduleInterleavedZeroBubble','ScheduleZBVZeroBubble','ScheduleDualPipeV') if hasattr(p, n)])"
  PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/test_schedules.py \
    tests/test_schedules_plan.py tests/test_schedules_sim.py 2>&1 | tail -30
  PYTHONPATH=$PWD python -m dynpipe plan --model mlp --stages 4 --microbatches 8 2>&1 | tail -9
} 2>&1 | tee "$OUT/schedules-torch-check.txt"
