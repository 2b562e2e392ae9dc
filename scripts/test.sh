#!/usr/bin/env bash
# Sets up .venv, then runs ruff and the whole test suite (CPU; CUDA tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-next
# Every extra the tests exercise must be installed: a missing one fails here, by name,
# instead of letting its tests skip.
.venv/bin/python -c "import xdist, torch, onnxscript, starlette, uvicorn, prometheus_client, orjson, pyarrow, ray.data, \
ray.serve, tritonclient.grpc, tritonclient.http, matplotlib, openvino"
# kserve on its own: its protobuf messages clash with tritonclient's in one process (the tests run it apart).
.venv/bin/python -c "import kserve"
# onnxruntime-genai in its own environment (scripts/setup.sh): the tests that compare with it need it.
.venv-genai/bin/python -c "import onnxruntime_genai"
.venv/bin/ruff check mha_deploy tests benchmarks
# Two workers, each test file on one of them (its module fixtures built once): one pytest process keeps one
# core busy, exports and tracing being single-threaded. MHA_TEST_WORKERS=0 runs in one process.
.venv/bin/python -m pytest -q -n "${MHA_TEST_WORKERS:-2}" --dist loadfile "$@"
