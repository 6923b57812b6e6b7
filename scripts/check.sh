#!/usr/bin/env bash
# The whole check: set up, lint (ruff), type-check (mypy --strict, project config), run
# every test.
# This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check offload tests benchmarks
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest "$@"
