#!/usr/bin/env bash
# Creates .venv (if missing) and installs mha-deploy with the export and dev extras.
# torch is pinned first: an unpinned torch can pull a multi-GB CUDA build, and
# 2.13.0 is the version the parity figures in the README were measured with.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
