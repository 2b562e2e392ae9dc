#!/usr/bin/env bash
# Creates .venv (if missing) and installs mha-deploy with the export and dev extras.
# torch is installed first and pinned: 2.13.0 is the version the README's figures
# were measured with (CI machines take a local CPU build of it), and an unpinned
# torch pulled in by the extras could fetch a newer multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev]"
