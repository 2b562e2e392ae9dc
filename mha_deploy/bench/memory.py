"""Peak memory of one inference, measured in a fresh process so that earlier runs cannot inflate it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mha_deploy.errors import MHADeployError

_PROBE = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import onnxruntime as ort

    def peak_kb():
        # VmHWM belongs to this address space; ru_maxrss would carry the parent's peak across fork+exec.
        try:
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    path, batch, seq, threads, arena = sys.argv[1], *map(int, sys.argv[2:6])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = bool(arena)
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    d_model = session.get_inputs()[0].shape[-1]
    feeds = {"x": np.random.default_rng(0).standard_normal((batch, seq, d_model), dtype=np.float32)}
    if len(session.get_inputs()) > 1:
        feeds["key_padding_mask"] = np.ones((batch, seq), dtype=bool)
    before = peak_kb()
    session.run(None, feeds)
    after = peak_kb()
    print(json.dumps({"before_kb": before, "peak_kb": after}))
""")


@dataclass
class MemoryRow:
    backend: str
    batch: int
    seq: int
    arena: bool
    peak_rss_mb: float  # whole process, model and inputs included
    run_mb: float  # growth of the peak during the one run: what inference itself allocated


def measure_peak_rss(path: Path, backend: str, batch: int, seq: int, threads: int, arena: bool) -> MemoryRow:
    """Peak RSS of loading a self-attention model and running it once at (batch, seq), in a subprocess."""
    args = [sys.executable, "-c", _PROBE, str(path), str(batch), str(seq), str(threads), str(int(arena))]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise MHADeployError(f"memory probe failed for {backend} at {batch}x{seq}: {result.stderr.strip()[-500:]}")
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    peak_mb, before_mb = probe["peak_kb"] / 1024, probe["before_kb"] / 1024
    return MemoryRow(backend, batch, seq, arena, peak_mb, peak_mb - before_mb)
