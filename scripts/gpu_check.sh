#!/usr/bin/env bash
# One prepared run for a lent GPU (see the device tool's README): environment, the CUDA
# test tier, the GPU benchmarks and the demo, in one call, from the tree (no install).
# The lent machine has torch with CUDA, attrs, pytest and hypothesis, no network.
# Usage: bash scripts/gpu_check.sh [--all]   (--all also runs the CPU tiers there)
# Everything is also written to $OUT/gpu_check.log (the tool returns only the tail).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
# Plugins the image may auto-load could emit warnings, which the suite turns into errors.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PY=${PYTHON:-python3}
LOG="${OUT:-/tmp}/gpu_check.log"
# Without numpy, torch warns during compilation; the suite turns warnings into errors.
NUMPY_FILTER="ignore:Failed to initialize NumPy"
step() { echo; echo "=== $* ($(date +%T))"; }

{
  step "versions"
  $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
  $PY -c "import numpy; print('numpy', numpy.__version__)" || echo "numpy: missing (UVA views need it)"
  step "offload env"
  $PY -m offload env
  step "GPU test tier"
  timeout 420 $PY -m pytest -q -rfE --durations=10 -p no:cacheprovider -W "$NUMPY_FILTER" tests/gpu
  step "bench_prefetch"
  timeout 300 $PY benchmarks/bench_prefetch.py
  step "bench_uva"
  timeout 300 $PY benchmarks/bench_uva.py
  step "demo on cuda"
  timeout 120 $PY -m offload demo --device cuda --layers 16 --hidden 2048 --tokens 256
  if [ "${1:-}" = "--all" ]; then
    step "CPU tiers on this machine's torch"
    timeout 600 $PY -m pytest -q -p no:cacheprovider -W "$NUMPY_FILTER" tests --ignore=tests/gpu
  fi
} 2>&1 | tee "$LOG"
