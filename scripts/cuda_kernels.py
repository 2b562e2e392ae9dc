"""Which attention kernel ORT's CUDA provider runs for each export target, dtype and mask (needs a GPU).

ORT prints the kernel it picks for each attention node (flash, memory-efficient,
cuDNN, TRT fused, unfused...) when ``ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1``
(``AttentionKernelDebugInfo`` in onnxruntime/contrib_ops/cuda/bert/: contrib
MultiHeadAttention and GroupQueryAttention). Each case runs in a fresh process
with that variable set, once with every key real and once with keys padded in
one row, and its printout is recorded: the evidence behind the README's
"what runs where on CUDA" table. An op that prints nothing (ONNX Attention in
some ORT versions, the plain graph) is recorded as such.

    python scripts/cuda_kernels.py OUT.json     # run by scripts/gpu-check.sh
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

D_MODEL, HEADS, SEQ = 512, 8, 512  # head size 64; 512 tokens clears the fp32 memory-efficient threshold
TARGETS, DTYPES = ("mha", "onnx", "none"), ("fp16", "fp32")
MASKS = ("none", "padding", "causal", "padding-causal")

# Runs one model on CUDA twice (no key padded, then some): ORT's debug lines go to this process's stdout.
_CHILD = """
import sys
import numpy as np
from mha_deploy.errors import MHADeployError
from mha_deploy.runtime import MHASession

path, seq = sys.argv[1], int(sys.argv[2])
try:
    session = MHASession(path, provider="cuda")
except MHADeployError as exc:
    print(f"REFUSED: {exc}", flush=True)
    raise SystemExit(0)
m = session.metadata
x = np.random.default_rng(0).standard_normal((2, seq, m.d_model)).astype(m.dtype)
for padded in (False, True):
    feeds = {"x": x}
    if m.signature.has_padding_mask:
        mask = np.ones((2, seq), bool)
        mask[1, seq // 2:] = not padded
        feeds["key_padding_mask"] = mask
    print(f"RUN padded={padded}", flush=True)
    session.run(feeds)
"""


def main(out: Path) -> None:
    import torch

    from mha_deploy.exporters import export_mha
    from mha_deploy.metadata import Signature
    from mha_deploy.models import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    env = {**os.environ, "ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO": "1"}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for fuse in TARGETS:
            for dtype in DTYPES:
                for mask in MASKS:
                    path = Path(tmp, f"{fuse}-{dtype}-{mask}.onnx")
                    export_mha(mha, path, Signature("self", mask), fuse=fuse, dtype=dtype)
                    child = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(SEQ)],
                                           capture_output=True, text=True, env=env, timeout=300)
                    lines = [line.strip() for line in child.stdout.splitlines() if line.strip()]
                    cases.append({"target": fuse, "dtype": dtype, "mask": mask, "exit": child.returncode,
                                  "printout": lines[:40], "stderr": child.stderr[-1000:]})
                    print(f"{fuse:<5} {dtype} {mask:<15} {' | '.join(lines)[:200]}", file=sys.stderr)
    out.write_text(json.dumps(cases, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
