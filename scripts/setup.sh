#!/usr/bin/env bash
# Creates .venv (if missing) and installs mha-deploy with the export and dev extras, and .venv-genai with
# onnxruntime-genai (see below), then says what it
# installed and what to run next (--no-next: the summary only, for the scripts that call it first).
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
# onnxruntime-genai in an environment of its own: it brings its own onnxruntime (CPU), which would replace
# onnxruntime-gpu in .venv. The tests and benchmarks/generation.py run it there in a subprocess.
GENAI_PYTHON=${GENAI_PYTHON:-python3.11}
[ -x .venv-genai/bin/python ] || "$GENAI_PYTHON" -m venv .venv-genai
.venv-genai/bin/python -c "import onnxruntime_genai, numpy" 2>/dev/null \
  || .venv-genai/bin/python -m pip install --quiet "onnxruntime-genai==${GENAI_VERSION:-0.18.0}" numpy
.venv/bin/python - <<'PY'
import importlib.metadata as metadata
import platform


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


runtime = next((f"{name} {v}" for name in ("onnxruntime-gpu", "onnxruntime") if (v := version(name))), "no onnxruntime")
print(f"set up .venv: Python {platform.python_version()}, mha-deploy {version('mha-deploy')} (editable, with "
      f"every extra: export, serve, parquet, ray, bench, openvino, dev), torch {version('torch')}, {runtime}, "
      f"onnxscript {version('onnxscript')}")
PY
.venv-genai/bin/python -c "import importlib.metadata as m; print('set up .venv-genai: onnxruntime-genai',
m.version('onnxruntime-genai'), 'with onnxruntime', m.version('onnxruntime'))"
if [ "${1:-}" != "--no-next" ]; then
  cat <<'TXT'
next:
  scripts/demo.sh              export the built-in attention block and run it over generated data
  scripts/test.sh              ruff and the whole test suite
  source .venv/bin/activate    then mha-deploy --help (or call .venv/bin/mha-deploy)
TXT
fi
