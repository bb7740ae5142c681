#!/usr/bin/env bash
# The test command: what the README gives and what CI runs (.ci/run calls this file), on a
# clean checkout of a CPU-only machine. Installs into .venv, runs the suite, builds the docs
# site (mkdocs --strict), then the tests that assert on wall-clock time (marked `timing`) in
# a step of their own: a shared or loaded machine can push one past its bounds, so failures
# there are retried once.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
# Not the vision extra: torchvision's wheels on the package index are built against CUDA
# torch and fail to load beside the CPU build (its tests skip without it).
pip install -q -e '.[dev,docs,tb,hf]'
# Two workers, one per core: on a 2-core VM a third made the suite slower (12:26 against
# 10:33 for the same clone), and so did starting the tests marked slow first (11:53).
python -m pytest -q -n 2
# The docs site: every page builds and every link between pages resolves (a few seconds).
NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q -d "$(mktemp -d)"
if ! python -m pytest -q -m "timing and not gpu"; then
  echo "timing tests failed; running the failed ones again, once" >&2
  python -m pytest -q -m "timing and not gpu" --last-failed
fi
