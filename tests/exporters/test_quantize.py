"""--quantize int8: projections quantized, attention kept fused, parity judged by a relative-error budget."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from mha_deploy.errors import ParityError
from mha_deploy.exporters import export_mha
from mha_deploy.exporters.export import INT8_REL_ERR_BUDGET
from mha_deploy.exporters.quantize import quantize_int8
from mha_deploy.metadata import Signature
from mha_deploy.model_report import describe_model
from mha_deploy.models import MultiHeadAttention
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS


@pytest.mark.parametrize("signature", [Signature("self", "padding-causal"), Signature("cross", "padding")])
def test_int8_export(tmp_path, signature):
    torch.manual_seed(0)
    result = export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "q.onnx", signature,
                        fuse="mha", quantize="int8")
    ops = {n.op_type for n in onnx.load(result.path).graph.node}
    assert "MatMulInteger" in ops and "MatMul" not in ops
    # The attention stays one float op (under an If for the padding mask's flash path).
    (attention,) = describe_model(result.path).attention_ops
    assert attention.op == ("com.microsoft::GroupQueryAttention" if signature.is_causal
                            else "com.microsoft::MultiHeadAttention")
    assert result.parity.passed and 0 < result.parity.rel_err <= INT8_REL_ERR_BUDGET
    assert result.parity.rel_budget == INT8_REL_ERR_BUDGET
    session = MHASession(result.path, provider="cpu")
    assert session.metadata.quantization == "int8"


def _quantize_and_break(model):
    """int8, then the output projection's weights scaled by 1.1: a broken model the budget must catch."""
    quantized = quantize_int8(model)
    out_proj_weights = [t for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    weight = out_proj_weights[-1]
    scaled = np.clip(np.round(onnx.numpy_helper.to_array(weight) * 1.1), -128, 127).astype(np.int8)
    weight.CopyFrom(onnx.numpy_helper.from_array(scaled, weight.name))
    return quantized


def test_int8_budget_catches_a_broken_model(tmp_path, monkeypatch):
    monkeypatch.setattr("mha_deploy.exporters.export.quantize_int8", _quantize_and_break)
    with pytest.raises(ParityError, match="relative error"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "q.onnx", Signature(), fuse="mha",
                   quantize="int8")
    assert list(tmp_path.iterdir()) == []


def _matmul_model() -> onnx.ModelProto:
    """x [2, 8] @ a constant [8, 8]: the smallest graph the quantizer quantizes."""
    weight = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])], [weight],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_the_quantizers_advice_stays_out_of_the_output(caplog):
    """onnxruntime.quantization logs "Please consider to run pre-processing before quantization" on the root
    logger: a user of --quantize int8 sees nothing of it, and the root logger's handlers are left as they were."""
    import logging

    root = logging.getLogger()
    handlers = list(root.handlers)
    with caplog.at_level(logging.DEBUG):
        quantized = quantize_int8(_matmul_model())
    assert "MatMulInteger" in {n.op_type for n in quantized.graph.node}
    assert not [r.getMessage() for r in caplog.records if "onnxruntime" in r.pathname], caplog.text
    assert root.handlers == handlers
