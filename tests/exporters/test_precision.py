"""--dtype fp16: half-precision weights and I/O, checked against the fp32 torch reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from mha_deploy.errors import ExportError, InputError
from mha_deploy.exporters import export_mha
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import ParityCase, check_parity
from mha_deploy.exporters.precision import FP16_ATOL, FP16_RTOL
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS, signature_id

SIGNATURES = [Signature("self", "padding-causal"), Signature("cross", "padding")]
UNSEEN = (ParityCase(1, 1, 1, "none"), ParityCase(3, 29, 29, "left"), ParityCase(2, 130, 130, "mixed"))


@pytest.mark.parametrize("fuse", ["none", "mha", "onnx"])
@pytest.mark.parametrize("signature", SIGNATURES, ids=signature_id)
def test_fp16_export_matches_fp32_reference(tmp_path, fuse, signature):
    torch.manual_seed(0)
    mha = MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()
    result = export_mha(mha, tmp_path / "h.onnx", signature, fuse=fuse, dtype="fp16")
    assert result.metadata.dtype == "float16" and result.fusion.fused == (fuse != "none")
    assert (result.parity.atol, result.parity.rtol) == (FP16_ATOL, FP16_RTOL)
    graph = onnx.load(result.path).graph
    for value in [*graph.input, *graph.output]:
        expected = onnx.TensorProto.BOOL if value.name == "key_padding_mask" else onnx.TensorProto.FLOAT16
        assert value.type.tensor_type.elem_type == expected, value.name

    # Shapes the export's own check did not use, through ORT without its graph optimisations.
    session = MHASession(result.path, provider="cpu", optimization="disabled")
    cases = UNSEEN
    if signature.attention == "cross":  # queries of their own length
        cases = tuple(ParityCase(c.batch, 7, c.kv_len, c.padding) for c in UNSEEN)
    report = check_parity(attention_graph(mha, signature), session, cases, atol=FP16_ATOL, rtol=FP16_RTOL, seed=3)
    assert report.passed, report.failures  # includes: every padded row finite


def test_fp16_session_wants_fp16_inputs(tmp_path):
    result = export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "h.onnx", Signature(), dtype="fp16")
    session = MHASession(result.path, provider="cpu")
    with pytest.raises(InputError, match=r"x must be float16, got float32 \(cast with .astype\(np.float16\)\)"):
        session.run({"x": np.zeros((1, 2, TEST_D_MODEL), np.float32)})
    assert session.run({"x": np.zeros((1, 2, TEST_D_MODEL), np.float16)})["output"].dtype == np.float16


def test_int8_and_fp16_do_not_mix(tmp_path):
    with pytest.raises(ExportError, match="--quantize int8-dynamic quantizes an fp32 model"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "h.onnx", dtype="fp16",
                   quantize="int8-dynamic")


@pytest.mark.parametrize("fuse", ["auto", "none"])
def test_fp16_kv_cache_decodes_within_the_fp16_budget(tmp_path, fuse):

    from mha_deploy.exporters.parity import CacheCase, check_cache_parity

    torch.manual_seed(0)
    mha = MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()
    signature = Signature("self", "padding-causal", kv_cache=True)
    path = export_mha(mha, tmp_path / "kv16.onnx", signature, fuse=fuse, dtype="fp16").path
    session = MHASession(path, provider="cpu")
    reference = attention_graph(mha, signature.cache_free)
    cases = (CacheCase(3, 13, 3, 2, "left"), CacheCase(2, 8, 2, 4, "mixed"))
    report = check_cache_parity(reference, session, cases, atol=FP16_ATOL, rtol=FP16_RTOL, seed=3)
    assert report.passed, report.failures
    decoder = session.decoder(capacity=32)
    decoder.prefill(np.zeros((1, 3, TEST_D_MODEL), np.float16))
    assert decoder.step(np.zeros((1, 1, TEST_D_MODEL), np.float16)).dtype == np.float16
    assert decoder.cache["past_key"].dtype == np.float16
