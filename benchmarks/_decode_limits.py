"""What bounds a decoder at batch 1, shared by the generation benchmarks: a decoded token reads every weight once,
so weight bytes per token over the memory bandwidth is the limit; and the peak resident memory of a probe process.

numpy at import and nothing else, so that a probe running in another environment (onnxruntime-genai's) imports it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): ru_maxrss would carry the parent's peak across fork+exec."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def memory_bandwidth_gb_s() -> float:
    """GB/s of a numpy sum over 256 MB of float32 (one core): what one decoding thread can read at best."""
    data = np.ones(64 * 2**20, np.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


# Where a table is only gathered from, a token reads one row of it: (op, input index) of such a read. ORT's
# GatherBlockQuantized (a quantized embedding) gathers rows of its data, scales and zero points alike.
_ROW_READS = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2), ("GatherBlockQuantized", 3)}


def weight_bytes_per_token(path: Path) -> int:
    """The bytes of stored weights one decoded token reads: every initializer (MatMulNBits' blocks, scales and zero
    points included, external data too), except a table only gathered from (an embedding), which gives one row per
    token."""
    import onnx

    from mha_deploy.onnx_nodes import all_nodes

    model = onnx.load(str(path))
    readers: dict[str, list] = {}
    for node in all_nodes(model.graph):
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, index))
    total = 0
    for tensor in model.graph.initializer:
        size = onnx.numpy_helper.to_array(tensor).nbytes
        uses = readers.get(tensor.name, [])
        gathered = uses and all(use in _ROW_READS for use in uses) and len(tensor.dims) >= 2
        total += size // tensor.dims[0] if gathered else size
    return total
