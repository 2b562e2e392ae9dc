#!/usr/bin/env bash
# Sets up .venv, exports the built-in default model, and runs it over generated data.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-next
mkdir -p build
.venv/bin/mha-deploy export --mask padding -o build/mha.onnx
.venv/bin/python - <<'PY'
import numpy as np

rng = np.random.default_rng(0)
lengths = np.clip(rng.lognormal(4.0, 0.8, size=256).astype(int), 1, 512)
items = {f"item-{i:04d}": rng.standard_normal((n, 512), dtype=np.float32) for i, n in enumerate(lengths)}
np.savez("build/items.npz", **items)
print(f"generated build/items.npz: {len(items)} items, {lengths.sum()} tokens, d_model 512")
PY
.venv/bin/mha-deploy infer build/mha.onnx --input build/items.npz --output build/outputs.npz --max-batch-tokens 8192 --overwrite
.venv/bin/mha-deploy inspect build/mha.onnx
