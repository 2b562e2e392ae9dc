"""The CUDA path as deployed, on a GPU: every target × mask × dtype, IO binding, CUDA graphs.

Skipped, with the reason, unless a tiny session lands on ORT's CUDA provider
(the ``on_cuda`` fixture asks ORT itself). ``scripts/gpu-check.sh`` runs this
file on a GPU host and reports every case in its JSON summary.

Tolerances, against the fp32 torch reference on real query rows:

- fp32: atol 1e-4, rtol 1e-3. TF32 is off in every CUDA session
  (``mha_deploy.runtime.providers.CUDA_OPTIONS``), so what remains is fp32 summed
  in other orders (cuBLAS, the attention kernels), ~1e-6 here. TF32 would round
  each GEMM input to 10 mantissa bits (relative 2^-11 ≈ 5e-4 per product, ~1e-3
  on these outputs) and fail it: the bound is what catches TF32 coming back.
- fp16: the fp16 export's own parity tolerance (atol = rtol = 5e-3,
  ``mha_deploy.exporters.precision``), checked on ORT's CPU at export: fp16
  storage (relative 2^-11 per value) with fp32 accumulation, which ORT's CUDA
  GEMMs and attention kernels also use.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.errors import ProviderUnavailableError
from mha_deploy.exporters.parity import check_parity
from mha_deploy.exporters.precision import FP16_ATOL, FP16_RTOL
from mha_deploy.inputs import InputCase, make_inputs
from mha_deploy.metadata import MASK_MODES, Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, signature_id

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("on_cuda")]

D = TEST_D_MODEL
TOLERANCES = {"fp32": (1e-4, 1e-3), "fp16": (FP16_ATOL, FP16_RTOL)}
TARGETS = ("mha", "onnx", "none")
SELF = [Signature("self", mask) for mask in MASK_MODES]


def refused_on_cuda(signature: Signature, fuse: str, dtype: str) -> str | None:
    """What MHASession must refuse on CUDA (``mha_deploy.runtime.cuda_support``), as a match pattern."""
    if fuse == "mha" and signature.is_causal and dtype == "fp32":
        return "GroupQueryAttention"
    return None


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("fuse", TARGETS)
@pytest.mark.parametrize("signature", [*SELF, Signature("cross", "padding")], ids=signature_id)
def test_parity_on_cuda(export_model, signature, fuse, dtype):
    """The export's parity cases (right, left and mixed padding, up to 300 tokens) on CUDA."""
    path, reference = export_model(signature, fuse, dtype)
    refusal = refused_on_cuda(signature, fuse, dtype)
    if refusal:
        with pytest.raises(ProviderUnavailableError, match=refusal):
            MHASession(path, provider="cuda")
        return
    session = MHASession(path, provider="cuda")
    assert session.provider == "cuda"
    atol, rtol = TOLERANCES[dtype]
    report = check_parity(reference, session, atol=atol, rtol=rtol)
    assert report.passed, report.summary() + "\n" + "\n".join(report.failures)


@pytest.mark.parametrize("fuse", ["none", "onnx"])
def test_returned_weights_on_cuda(export_model, fuse):
    """Unfused, the weights are a Softmax output and run on CUDA; through ONNX Attention they are refused."""
    signature = Signature("self", "padding", return_weights=True)
    path, reference = export_model(signature, fuse)
    if fuse == "onnx":
        with pytest.raises(ProviderUnavailableError, match="qk_matmul_output"):
            MHASession(path, provider="cuda")
        return
    report = check_parity(reference, MHASession(path, provider="cuda"), atol=1e-4, rtol=1e-3)
    assert report.passed, report.summary()


@pytest.mark.parametrize("fuse", ["mha", "onnx"])
@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("self", "padding-causal")],
                         ids=signature_id)
def test_io_binding_on_cuda_equals_plain_runs(export_model, signature, fuse):
    path, _ = export_model(signature, fuse, "fp16")
    plain = MHASession(path, provider="cuda")
    bound = MHASession(path, provider="cuda", io_binding=True, warmup=True)
    for seed, padding in enumerate(("none", "right", "left")):
        feeds = make_inputs(signature, D, InputCase(3, 37, 37, padding), seed, dtype="float16")
        # The same kernels on the same inputs: only where the output lands differs.
        np.testing.assert_array_equal(bound.run(feeds)["output"], plain.run(feeds)["output"])


@pytest.mark.parametrize(
    ("signature", "fuse"),
    [(Signature("self", "none"), "mha"), (Signature("self", "padding"), "onnx"),
     (Signature("self", "padding-causal"), "onnx")],
    ids=["none-mha", "padding-onnx", "padding-causal-onnx"],
)
def test_cuda_graph_replays_from_many_threads(export_model, signature, fuse):
    """Captured once on load, replayed from 8 threads: every call equals a plain CUDA run of the same inputs."""
    path, _ = export_model(signature, fuse, "fp16")
    graph = MHASession(path, provider="cuda", cuda_graph=(2, 16))
    plain = MHASession(path, provider="cuda")
    cases = [make_inputs(signature, D, InputCase(2, 16, 16, "right"), seed, dtype="float16") for seed in range(48)]
    with ThreadPoolExecutor(8) as pool:
        replayed = list(pool.map(lambda feeds: graph.run(feeds)["output"], cases))
    for feeds, got in zip(cases, replayed, strict=True):
        # Replay launches the captured kernels on copied-in inputs: the plain run's result, to fp16 rounding.
        np.testing.assert_allclose(got, plain.run(feeds)["output"], atol=1e-3, rtol=1e-3)


def test_cuda_graph_refuses_the_padding_if(export_model):
    path, _ = export_model(Signature("self", "padding"), "mha", "fp16")
    with pytest.raises(ProviderUnavailableError, match="CUDA graph"):
        MHASession(path, provider="cuda", cuda_graph=(2, 16))
