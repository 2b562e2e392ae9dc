"""The machine's practical MatMul rate, as ORT itself reaches it on the bench's device and dtype.

The denominator of efficiency: a row's GFLOP/s over what ORT's own MatMul
reaches in the same run, on the same provider, in the same dtype. int8 rows
(dynamic int8 projections) are measured against ORT's int8 GEMM instead,
``MatMulInteger`` of uint8 activations and int8 weights, what their projections
run: against the float rate they would read as over 100%.
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
# int8: uint8 activations times int8 weights into int32, as DynamicQuantizeLinear + MatMulInteger compute them.
_INT8_TYPES = {"a": TensorProto.UINT8, "b": TensorProto.INT8, "c": TensorProto.INT32}

# Square sizes tried for the practical limit: the best is not always the largest
# (measured here: 286 GFLOP/s at 512³, 189 at 4096³ with 2 threads on the CPU).
GEMM_SIZES = (512, 1024, 2048, 4096)


def matmul_model(n: int, dtype: str = "fp32") -> bytes:
    spec = [n, n]
    types = _INT8_TYPES if dtype == "int8" else dict.fromkeys("abc", _ELEMENT_TYPES[dtype])
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger" if dtype == "int8" else "MatMul", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info(name, types[name], spec) for name in ("a", "b")],
        [helper.make_tensor_value_info("c", types["c"], spec)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def peak_gemm_gflops(
    threads: int, target: BenchTarget = CPU_FP32, sizes=GEMM_SIZES, budget_s: float = 1.5, dtype: str | None = None
) -> tuple[float, int]:
    """The best MatMul rate ORT reaches on ``target`` over ``sizes``, and the size that reached it.

    ``dtype`` "int8" measures ``MatMulInteger`` (GOP/s) instead of the target's float MatMul.
    """
    return max((gemm_gflops(threads, n, target, budget_s, dtype), n) for n in sizes)


def gemm_gflops(
    threads: int, n: int = 4096, target: BenchTarget = CPU_FP32, budget_s: float = 3.0, dtype: str | None = None
) -> float:
    """GFLOP/s (GOP/s for int8) of an n³ MatMul in ``dtype`` (default the target's) on the target's provider."""
    dtype = dtype or target.dtype
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    plan = plan_providers(target.provider)
    session = ort.InferenceSession(matmul_model(n, dtype), options, providers=plan.session_providers())
    check_providers(plan, session)  # never a CPU figure labelled CUDA
    rng = np.random.default_rng(0)
    # Operands and result stay on the device: the yardstick is the kernel's rate, not PCIe's.
    binding = session.io_binding()
    for name in ("a", "b"):
        if dtype == "int8":
            array = rng.integers(0, 256, (n, n), dtype=np.uint8) if name == "a" else rng.integers(
                -128, 128, (n, n), dtype=np.int8)
        else:
            array = rng.standard_normal((n, n), dtype=np.float32).astype(target.numpy_dtype)
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, target.provider, 0))
    binding.bind_output("c", target.provider)
    timing = time_calls(lambda: session.run_with_iobinding(binding), budget_s=budget_s, min_calls=3)
    return 2.0 * n**3 / (timing.median_ms * 1e-3) / 1e9
