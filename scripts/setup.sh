#!/usr/bin/env bash
# Create .venv (if missing) and install offload with its dev tools, the Hugging Face
# extra (transformers, for offload.hf and its tests) and the bench extra (diffusers and
# accelerate, the peers of benchmarks/bench_overhead.py and its smoke test) and the quant
# extra (torchao, for the quantised-weight tests) into it.
# torch is pinned to the CPU build first: an open range asked of pip with nothing installed
# would download a CUDA build of several GB. pyproject.toml itself only asks for torch>=2.4,
# which this install (or a user's own torch) satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,hf,diffusers,bench,quant]"
