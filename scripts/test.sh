#!/usr/bin/env bash
# Sets up .venv, then runs ruff and the whole test suite (CPU; CUDA tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check mha_deploy tests benchmarks
.venv/bin/python -m pytest -q "$@"
