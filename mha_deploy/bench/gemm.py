"""The machine's practical fp32 limit, as ORT's own MatMul reaches it: the denominator of efficiency."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from mha_deploy.bench.timing import time_calls


def matmul_model(n: int) -> bytes:
    spec = [n, n]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, spec) for name in ("a", "b")],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, spec)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


# Square sizes tried for the practical limit: the best is not always the largest
# (measured here: 286 GFLOP/s at 512³, 189 at 4096³ with 2 threads).
GEMM_SIZES = (512, 1024, 2048, 4096)


def peak_gemm_gflops(threads: int, sizes=GEMM_SIZES, budget_s: float = 1.5) -> tuple[float, int]:
    """The best fp32 MatMul rate ORT reaches here over ``sizes``, and the size that reached it."""
    return max((gemm_gflops(threads, n, budget_s), n) for n in sizes)


def gemm_gflops(threads: int, n: int = 4096, budget_s: float = 3.0) -> float:
    """GFLOP/s of an n³ fp32 MatMul on ORT's CPU provider with ``threads`` threads."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(matmul_model(n), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    timing = time_calls(lambda: session.run(None, {"a": a, "b": b}), warmup=1, min_runs=3, budget_s=budget_s)
    return 2.0 * n**3 / (timing.median_ms * 1e-3) / 1e9
