"""What bounds a decoder at batch 1, shared by the generation benchmarks: a decoded token reads every weight once,
so weight bytes per token over the memory bandwidth is the limit; and the peak resident memory of a probe process.

numpy at import and nothing else, so that a probe running in another environment (onnxruntime-genai's) imports it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): ru_maxrss would carry the parent's peak across fork+exec."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def memory_bandwidth_gb_s() -> float:
    """GB/s of a numpy sum over 256 MB of float32 (one core, best of 5): the figure the benchmarks printed first,
    kept for comparison. It understates what a 2-thread decoder reads twice over: one core reads less than two, and
    numpy's pairwise float32 sum is partly bound by its arithmetic (about 21 GB/s from a 4 MB buffer in cache,
    where numpy max runs at 50-65). On the 2-core EPYC host, quiet, it read 14 GB/s (median of 15 probes) where
    numpy max and onnxruntime's ReduceSum read 17 on one core, and with two threads numpy max 19 and ReduceSum 28.
    ``read_bandwidth`` measures what ``threads`` threads read."""
    data = np.ones(64 * 2**20, np.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


@dataclass(frozen=True)
class Bandwidth:
    """What ``threads`` threads read from memory: the best of several methods that each read every byte of a
    256 MB float32 buffer once (far beyond the last-level cache), and each method's own best."""

    gb_s: float  # the best method's: the batch-1 limit's bandwidth
    method: str  # which method read it
    threads: int
    one_core_gb_s: float  # memory_bandwidth_gb_s(): the numpy sum on one core, for comparison
    methods: dict[str, float] = field(default_factory=dict)  # GB/s per method, each its best of the rounds

    def line(self) -> str:
        others = "; ".join(f"{name} {value:.1f}" for name, value in self.methods.items())
        return (f"memory bandwidth: {self.gb_s:.1f} GB/s read by {self.threads} threads ({self.method}; over 256 MB, "
                f"best of each: {others}); one core's numpy sum: {self.one_core_gb_s:.1f} GB/s")

    def as_json(self) -> dict:
        return {"gb_s": self.gb_s, "method": self.method, "threads": self.threads,
                "one_core_gb_s": self.one_core_gb_s, "one_core_method": "numpy sum, one core", "methods": self.methods}


def read_bandwidth(threads: int, rounds: int = 9, megabytes: int = 256) -> Bandwidth:
    """GB/s that ``threads`` threads read from memory, the way a decoder of that many threads reads its weights.

    Two readers, each reading every byte once, the rounds interleaved so that a noisy moment hits both alike (best
    of ``rounds`` each):

    - numpy max over ``threads`` disjoint slices, one Python thread each (numpy releases the GIL in a reduction).
      max, not sum: its vectorised loop reads 50-65 GB/s from cache on one core of the EPYC host, so from memory it
      waits on memory;
    - onnxruntime's ReduceSum over rows of the buffer with ``threads`` intra-op threads: what onnxruntime's own
      kernels stream (skipped where onnxruntime or onnx does not import).

    The limit takes the larger: each is a floor on what ``threads`` threads can read, and a slower one measures its
    own overhead, not the memory (on the EPYC host, quiet, ReduceSum read a median 28 GB/s where the two numpy
    threads read 19: a round ends with the slower of their halves).
    """
    data = np.ones(megabytes * 2**18, np.float32)  # written once here, so no first-touch page faults are timed
    plural = "s" if threads > 1 else ""
    # The pool is started once: the rounds time the reads, not the threads' creation.
    with ThreadPoolExecutor(threads) as pool:
        readers = {f"numpy max, {threads} thread{plural}": _numpy_reader(data, threads, pool)}
        ort_reader = _onnxruntime_reader(data, threads)
        if ort_reader is not None:
            readers[f"onnxruntime ReduceSum, {threads} intra-op thread{plural}"] = ort_reader
        best = dict.fromkeys(readers, float("inf"))
        for _ in range(rounds):
            for name, read in readers.items():
                started = time.perf_counter()
                read()
                best[name] = min(best[name], time.perf_counter() - started)
    methods = {name: data.nbytes / seconds / 1e9 for name, seconds in best.items()}
    method = max(methods, key=methods.__getitem__)
    return Bandwidth(methods[method], method, threads, memory_bandwidth_gb_s(), methods)


def _numpy_reader(data: np.ndarray, threads: int, pool: ThreadPoolExecutor):
    parts = np.array_split(data, threads)

    def read() -> None:
        list(pool.map(np.max, parts))
    return read


def _onnxruntime_reader(data: np.ndarray, threads: int):
    try:
        import onnx
        import onnxruntime
    except ImportError:
        return None
    # Rows of 256 KB summed along axis 1, so that onnxruntime's threads share out the rows. The buffer is an input,
    # not an initializer, so the session holds no copy of it.
    rows = data.reshape(-1, 64 * 2**10)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "read",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(rows.shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [rows.shape[0]])],
        [onnx.helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    value = onnxruntime.OrtValue.ortvalue_from_numpy(rows)  # shares the buffer's memory: no copy per run
    session.run_with_ort_values(["y"], {"x": value})  # the first run allocates: untimed

    def read() -> None:
        session.run_with_ort_values(["y"], {"x": value})
    return read


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
