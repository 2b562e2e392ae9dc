"""Peak memory of one inference, measured in a fresh process so that earlier runs cannot inflate it.

The probe knows the model only through its file: it reads the mha-deploy
metadata (signature, d_model, dtype) and draws its inputs from the one data
loader, so self- and cross-attention, padding masks and fp16 models all work.
It runs on the bench's provider; on CUDA the figure is the host's RSS only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mha_deploy.errors import MHADeployError

# torch-free: mha_deploy.inputs, metadata and runtime.providers import numpy and onnxruntime only.
_PROBE = textwrap.dedent("""
    import json, resource, sys
    import onnxruntime as ort
    from mha_deploy.inputs import InputCase, make_inputs
    from mha_deploy.metadata import ModelMetadata
    from mha_deploy.runtime.providers import check_providers, plan_providers

    def peak_kb():
        # VmHWM belongs to this address space; ru_maxrss would carry the parent's peak across fork+exec.
        try:
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    path, provider = sys.argv[1], sys.argv[2]
    batch, seq, threads, arena = map(int, sys.argv[3:7])
    padded_pct = float(sys.argv[7])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = bool(arena)
    plan = plan_providers(provider)
    session = ort.InferenceSession(path, options, providers=plan.session_providers())
    check_providers(plan, session)
    metadata = ModelMetadata.from_props(session.get_modelmeta().custom_metadata_map, path)
    # The bench's inputs (MaskMode.inputs: every key real, or the last padded_pct of them padded) in the
    # model's dtype, built here without importing mha_deploy.bench, which imports torch.
    signature = metadata.signature
    feeds = make_inputs(signature, metadata.d_model, InputCase(batch, seq, seq, "none"), dtype=metadata.dtype)
    for name in signature.padding_masks:
        length = feeds[name].shape[1]
        feeds[name][:, max(1, length - round(length * padded_pct / 100)):] = False
    before = peak_kb()
    session.run(None, feeds)
    after = peak_kb()
    label = f"{signature.mask}-{padded_pct:g}%" if padded_pct else signature.mask
    print(json.dumps({"before_kb": before, "peak_kb": after, "mask": label}))
""")


@dataclass
class MemoryRow:
    backend: str
    mask: str
    batch: int
    seq: int
    arena: bool
    peak_rss_mb: float  # whole process, model and inputs included
    run_mb: float  # growth of the peak during the one run: what inference itself allocated


def measure_peak_rss(
    path: Path, backend: str, batch: int, seq: int, threads: int, arena: bool, provider: str = "cpu",
    padded_pct: float = 0.0,
) -> MemoryRow:
    """Peak RSS of loading a model file and running it once at (batch, seq), in a subprocess on ``provider``,
    with the last ``padded_pct`` percent of the keys padded (padding masks only)."""
    args = [sys.executable, "-c", _PROBE, str(path), provider, str(batch), str(seq), str(threads), str(int(arena)),
            str(padded_pct)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise MHADeployError(f"memory probe failed for {backend} at {batch}x{seq}: {result.stderr.strip()[-500:]}")
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    peak_mb, before_mb = probe["peak_kb"] / 1024, probe["before_kb"] / 1024
    return MemoryRow(backend, probe["mask"], batch, seq, arena, peak_mb, peak_mb - before_mb)
