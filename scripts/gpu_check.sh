#!/usr/bin/env bash
# One prepared run for a lent GPU (see the device tool's README): environment, the CUDA
# test tier, the GPU benchmarks and the demo, in one call, from the tree (no install).
# The lent machine has torch with CUDA, attrs, pytest and hypothesis, no network.
# Usage: bash scripts/gpu_check.sh [--all]   (--all also runs the CPU tiers there)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.
# Without numpy, torch warns during compilation; the suite turns warnings into errors.
NUMPY_FILTER="ignore:Failed to initialize NumPy"
step() { echo; echo "=== $* ($(date +%T))"; }

step "versions"
python -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
step "offload env"
python -m offload env
step "GPU test tier"
python -m pytest -q -p no:cacheprovider -W "$NUMPY_FILTER" tests/gpu
step "bench_prefetch"
timeout 300 python benchmarks/bench_prefetch.py
if [ -f benchmarks/bench_uva.py ]; then
  step "bench_uva"
  timeout 300 python benchmarks/bench_uva.py
fi
step "demo on cuda"
python -m offload demo --device cuda --layers 16 --hidden 2048 --tokens 256
if [ "${1:-}" = "--all" ]; then
  step "CPU tiers on this machine's torch"
  python -m pytest -q -p no:cacheprovider -W "$NUMPY_FILTER" tests --ignore=tests/gpu
fi
