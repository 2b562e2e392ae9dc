#!/usr/bin/env bash
# Proves the CUDA path on a machine with an NVIDIA GPU, in one command and one JSON file:
#   1. sets up .venv (scripts/setup.sh) and the CUDA 13 / cuDNN 9 wheels onnxruntime-gpu loads;
#   2. runs every CUDA test (tests/runtime/test_cuda.py: parity for every target x mask x dtype,
#      returned weights, IO binding, CUDA graphs; the bench's CUDA test), none of which may skip;
#   3. runs `mha-deploy bench --provider cuda` (fp16, torch on the same GPU, that GPU's GEMM rate
#      as yardstick) on every mask mode;
#   4. records which attention kernel ORT picks for every target x dtype x mask (scripts/cuda_kernels.py);
#      decodes a KV-cache GPT on CUDA and on the CPU: the same greedy tokens? (scripts/cuda_generation.py);
#   5. writes $OUT/summary.json: the GPU, versions, every test's outcome, the bench's rows, the kernels.
# Budget: under 10 minutes on one GPU (estimated, not yet timed on one: the tests ~2-4 min, mostly
# exports; the bench ~3 min; the kernel census ~2 min).
# Without a GPU it says so and exits 0, so CI can run it everywhere.
#
#   scripts/gpu-check.sh            sets up .venv and the CUDA wheels with pip (needs the package registry)
#   scripts/gpu-check.sh --here     uses the python3 it finds, as it is (a machine with no network where
#                                   onnxruntime-gpu, torch with CUDA and the project are already importable, e.g.
#                                   through PYTHONPATH): nothing is installed
#
# Environment: GPU_CHECK_OUT (default gpu-check), NVIDIA_SMI (default nvidia-smi), PYTHON (--here: default python3),
# GPU_CHECK_WORKERS (pytest-xdist workers for the tests; default 1, none), GPU_CHECK_PART_S (each part's time limit,
# default 900 s), GPU_CHECK_MASKS / GPU_CHECK_SHAPES / GPU_CHECK_BUDGET_S (the bench's).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu-check}
export NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
HERE=false
[ "${1:-}" = "--here" ] && HERE=true

if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1 || ! "$NVIDIA_SMI" -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu-check: no GPU here (no NVIDIA GPU listed by $NVIDIA_SMI): nothing to check, CUDA tests stay skipped"
    exit 0
fi

mkdir -p "$OUT"
echo "gpu-check: $("$NVIDIA_SMI" -L | head -n 1)"
if $HERE; then
    PY=${PYTHON:-python3}
else
    scripts/setup.sh --no-next
    PY=.venv/bin/python
    # CUDA and cuDNN from pip, the versions this onnxruntime-gpu was built against;
    # MHASession loads them with onnxruntime.preload_dlls (mha_deploy.runtime.providers).
    ORT_VERSION=$($PY -c "import onnxruntime; print(onnxruntime.__version__)")
    $PY -m pip install --quiet "onnxruntime-gpu[cuda,cudnn]==$ORT_VERSION"
fi
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'torch sees no CUDA device: install a CUDA build of torch (the bench runs torch on the GPU)')"
workers=()
[ "${GPU_CHECK_WORKERS:-1}" -gt 1 ] && workers=(-n "$GPU_CHECK_WORKERS" --dist load)

status=0
# The kernel ORT picks per target x dtype x mask, from its own debug printout: the README table's evidence.
# Exports on the CPU and one small run each: it runs beside the tests, before the bench has the machine alone.
timeout "${GPU_CHECK_PART_S:-900}" $PY scripts/cuda_kernels.py "$OUT/kernels.json" 2>"$OUT/kernels.log" &
kernels=$!
# A KV-cache GPT decoded greedily on CUDA and on the CPU: the same tokens, and new tokens/s on each.
timeout "${GPU_CHECK_PART_S:-900}" $PY scripts/cuda_generation.py "$OUT/generation.json" >"$OUT/generation.log" 2>&1 &
generation=$!
# -rs lists skip reasons; a skipped CUDA test here means the CUDA path did not come up.
timeout "${GPU_CHECK_PART_S:-900}" $PY -m pytest -q -rs -p no:cacheprovider "${workers[@]}" -m cuda tests/runtime/test_cuda.py \
    tests/bench/test_bench.py --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log" || status=1
wait $kernels || status=1
wait $generation || status=1
timeout "${GPU_CHECK_PART_S:-900}" $PY -m mha_deploy.cli bench --provider cuda --mask "${GPU_CHECK_MASKS:-none,padding,padding-25%,causal,padding-causal}" \
    --shapes "${GPU_CHECK_SHAPES:-8x128,1x1024,1x4096}" --memory-shapes 1x4096 --budget-s "${GPU_CHECK_BUDGET_S:-1}" \
    --json >"$OUT/bench.json" 2>"$OUT/bench.log" || status=1

$PY - "$OUT" "$status" <<'EOF'
"""One JSON summary of the run: where, with what, and what passed."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import onnxruntime
import torch

out, status = Path(sys.argv[1]), int(sys.argv[2])
query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
try:
    gpu = subprocess.run([os.environ.get("NVIDIA_SMI", "nvidia-smi"), *query], capture_output=True,
                         text=True).stdout.strip().splitlines()
except OSError as exc:
    gpu = [f"unknown: {exc}"]
tests = []
if (out / "cuda-tests.xml").exists():
    for case in ET.parse(out / "cuda-tests.xml").getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        detail = next((child.get("message", "") for child in case if child.tag == outcome), "")
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "detail": detail[:500]})
counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failure", "error", "skipped")}
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


bench, kernels, generation = load("bench.json"), load("kernels.json"), load("generation.json")
# Skips count as failures here: on a GPU host every CUDA test must run.
ok = (status == 0 and not (counts["failure"] or counts["error"] or counts["skipped"]) and tests and bench and kernels
      and generation)
summary = {
    "ok": bool(ok),
    "gpu": gpu,
    "versions": {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda},
    "tests": {"counts": counts, "cases": tests},
    "bench": bench,
    "kernels": kernels,
    "generation": generation,
}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(f"gpu-check: {'OK' if ok else 'FAILED'}: {counts} -> {out / 'summary.json'}")
sys.exit(0 if ok else 1)
EOF
