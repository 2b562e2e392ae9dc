"""prefill_or_decode: one file, the prefill graph when the cache is empty, the decode graph otherwise; the caches
attached to the fused first call; the decode graph on contrib MultiHeadAttention."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from mha_deploy.errors import ExportError
from mha_deploy.exporters import export_mha, export_stack
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.kv_cache import decode_on_mha, prefill_or_decode
from mha_deploy.exporters.parity import CacheCase
from mha_deploy.exporters.torch_export import export_onnx
from mha_deploy.models import Decoder, MultiHeadAttention
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.signature import Signature

WEIGHT = numpy_helper.from_array(np.full(3, 2.0, np.float32), "w")


def _model(nodes, inputs, outputs, initializers=(WEIGHT,)):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _tensor(name, *dims):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _pair():
    x, past, output, present = _tensor("x", "b", 3), _tensor("past", "b", 1, "p", 3), _tensor("output", "b", 3), \
        _tensor("present", "b", 1, "t", 3)
    new = numpy_helper.from_array(np.array([1, 1, 1, 3], np.int64), "shape")
    # Both graphs name an intermediate "h": the branches must not collide.
    prefill = _model(
        [
            helper.make_node("Add", ["x", "w"], ["h"]),
            helper.make_node("Identity", ["h"], ["output"]),
            # The prefill's present repeats the Add its output computes: merged, computed once.
            helper.make_node("Add", ["x", "w"], ["xw"]),
            helper.make_node("Reshape", ["xw", "shape"], ["present"]),
        ],
        [x], [output, present], (WEIGHT, new),
    )
    decode = _model(
        [
            helper.make_node("Mul", ["x", "w"], ["h"]),
            helper.make_node("Identity", ["h"], ["output"]),
            helper.make_node("Add", ["x", "w"], ["xw"]),
            helper.make_node("Reshape", ["xw", "shape"], ["x4"]),
            helper.make_node("Concat", ["past", "x4"], ["present"], axis=2),
        ],
        [x, past], [output, present], (WEIGHT, new),
    )
    return prefill, decode


def test_the_cache_length_chooses_the_branch():
    prefill, decode = _pair()
    combined = prefill_or_decode(prefill, decode, "past")
    onnx.checker.check_model(combined, full_check=True)
    assert [t.name for t in combined.graph.initializer].count("prefill/w") == 1
    assert len(combined.graph.initializer) == 2, "the weights both graphs hold are stored once"
    session = ort.InferenceSession(combined.SerializeToString())
    x = np.ones((1, 3), np.float32)
    output, present = session.run(None, {"x": x, "past": np.zeros((1, 1, 0, 3), np.float32)})
    np.testing.assert_array_equal(output, x + 2)
    np.testing.assert_array_equal(present, (x + 2).reshape(1, 1, 1, 3))
    then_branch = next(a.g for a in combined.graph.node[-1].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node].count("Add") == 1, "repeated nodes are merged"
    output, present = session.run(None, {"x": x, "past": present})
    np.testing.assert_array_equal(output, x * 2)
    np.testing.assert_array_equal(present[0, 0, 1], (x + 2)[0])


def test_the_branches_must_return_the_same_outputs():
    prefill, decode = _pair()
    del prefill.graph.output[1]
    with pytest.raises(ValueError, match="same outputs"):
        prefill_or_decode(prefill, decode, "past")


def test_decode_fusion_names_what_it_did_not_find():
    """A present that no Concat produces is not the plain KV-cache graph: refused, saying where it looked."""
    signature = Signature("self", "causal", kv_cache=True)
    decode = export_onnx(attention_graph(MultiHeadAttention(16, 2), signature), signature, 16, heads=2)
    for node in decode.graph.node:
        if node.op_type == "Concat" and node.output[0] == "present_key":
            node.op_type = "Sum"
    with pytest.raises(ExportError, match="expected Concat producing present_key, found Sum"):
        decode_on_mha(decode, 2, -1e9, attentions=1)


def test_decode_fusion_counts_the_attentions_it_rewrites():
    _, decode = _pair()  # no attention at all
    with pytest.raises(ExportError, match="found 0 attentions, expected 1"):
        decode_on_mha(decode, 1, -1e9, attentions=1)


# Small decodings: these exports are about the graph, the parity tests are elsewhere.
QUICK_CASES = (CacheCase(1, 3, 1, 2, "none", memory=2), CacheCase(2, 5, 1, 2, "left", memory=3))


def _first_call(path) -> onnx.GraphProto:
    node = next(n for n in onnx.load(path).graph.node if n.op_type == "If")
    return next(a.g for a in node.attribute if a.name == "then_branch")


@pytest.mark.parametrize("model", ["mha", "decoder"])
def test_first_call_keeps_its_fused_kernel_at_d_model_512(tmp_path, model):
    """At d_model 512 torch's exporter shares a key projection computed beside the attention with the
    attention's own, and a shared projection kept the fusion off (a masked MultiHeadAttention instead of
    GroupQueryAttention). The caches are attached after fusion: the first call runs GroupQueryAttention for
    each causal self-attention, and each projection once."""
    torch.manual_seed(0)
    path = tmp_path / "kv.onnx"
    if model == "mha":
        export_mha(MultiHeadAttention(512, 8), path, Signature("self", "padding-causal", kv_cache=True),
                   parity_cases=QUICK_CASES)
        layers, projections = 1, 4  # q, k, v, o
    else:
        export_stack(Decoder(2, 512, 8, 1024), path, "padding", kv_cache=True, parity_cases=QUICK_CASES)
        layers, projections = 2, 2 * 10  # per layer: 4 self-attention, 4 cross-attention, 2 feed-forward
    first_call = _first_call(path)
    assert Counter(n.op_type for n in first_call.node)["MatMul"] == projections
    nodes = list(all_nodes(first_call))  # causal_gqa's If on the size nests the op
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    causal_mha = [n for n in nodes if n.op_type == "MultiHeadAttention" and "unidirectional" in str(n.attribute)]
    assert len(gqa) >= layers and not causal_mha
