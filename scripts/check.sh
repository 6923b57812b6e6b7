#!/usr/bin/env bash
# The whole check: set up, type-check (mypy --strict, project config), run every test.
# This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest "$@"
