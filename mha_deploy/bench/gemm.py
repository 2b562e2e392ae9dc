"""The machine's practical MatMul rate, as ORT itself reaches it on the bench's device and dtype.

The denominator of efficiency: a row's GFLOP/s over what ORT's own MatMul
reaches in the same run, on the same provider, in the same dtype.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from mha_deploy.bench.target import CPU_FP32, BenchTarget
from mha_deploy.bench.timing import time_calls
from mha_deploy.runtime.providers import check_providers, plan_providers

_ELEMENT_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}

# Square sizes tried for the practical limit: the best is not always the largest
# (measured here: 286 GFLOP/s at 512³, 189 at 4096³ with 2 threads on the CPU).
GEMM_SIZES = (512, 1024, 2048, 4096)


def matmul_model(n: int, dtype: str = "fp32") -> bytes:
    spec = [n, n]
    element = _ELEMENT_TYPES[dtype]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info(name, element, spec) for name in ("a", "b")],
        [helper.make_tensor_value_info("c", element, spec)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def peak_gemm_gflops(
    threads: int, target: BenchTarget = CPU_FP32, sizes=GEMM_SIZES, budget_s: float = 1.5
) -> tuple[float, int]:
    """The best MatMul rate ORT reaches on ``target`` over ``sizes``, and the size that reached it."""
    return max((gemm_gflops(threads, n, target, budget_s), n) for n in sizes)


def gemm_gflops(threads: int, n: int = 4096, target: BenchTarget = CPU_FP32, budget_s: float = 3.0) -> float:
    """GFLOP/s of an n³ MatMul in the target's dtype on its provider with ``threads`` threads."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    plan = plan_providers(target.provider)
    session = ort.InferenceSession(matmul_model(n, target.dtype), options, providers=plan.session_providers())
    check_providers(plan, session)  # never a CPU figure labelled CUDA
    rng = np.random.default_rng(0)
    # Operands and result stay on the device: the yardstick is the kernel's rate, not PCIe's.
    binding = session.io_binding()
    for name in ("a", "b"):
        array = rng.standard_normal((n, n), dtype=np.float32).astype(target.numpy_dtype)
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, target.provider, 0))
    binding.bind_output("c", target.provider)
    timing = time_calls(lambda: session.run_with_iobinding(binding), budget_s=budget_s, min_calls=3)
    return 2.0 * n**3 / (timing.median_ms * 1e-3) / 1e9
