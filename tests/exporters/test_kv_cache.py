"""prefill_or_decode: one file, the prefill graph when the cache is empty, the decode graph otherwise."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mha_deploy.errors import ExportError
from mha_deploy.exporters.kv_cache import decode_on_mha, prefill_or_decode

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
    # Both graphs name an intermediate "h": the branches must not collide.
    prefill = _model([helper.make_node("Add", ["x", "w"], ["h"]), helper.make_node("Identity", ["h"], ["output"])],
                     [x], [output])
    new = numpy_helper.from_array(np.array([1, 1, 1, 3], np.int64), "shape")
    decode = _model(
        [
            helper.make_node("Mul", ["x", "w"], ["h"]),
            helper.make_node("Identity", ["h"], ["output"]),
            # The same Add as the prefill's: the prefill branch must compute it once.
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
    assert len(combined.graph.initializer) == 2, "the weight both graphs hold is stored once"
    session = ort.InferenceSession(combined.SerializeToString())
    x = np.ones((1, 3), np.float32)
    output, present = session.run(None, {"x": x, "past": np.zeros((1, 1, 0, 3), np.float32)})
    np.testing.assert_array_equal(output, x + 2)
    np.testing.assert_array_equal(present, (x + 2).reshape(1, 1, 1, 3))  # from the decode graph's nodes
    then_branch = next(a.g for a in combined.graph.node[-1].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node].count("Add") == 1, "repeated nodes are merged"
    output, present = session.run(None, {"x": x, "past": present})
    np.testing.assert_array_equal(output, x * 2)
    np.testing.assert_array_equal(present[0, 0, 1], (x + 2)[0])


def test_decode_fusion_names_what_it_did_not_find():
    """A present that no Concat produces is not the plain KV-cache graph: refused, saying where it looked."""
    _, decode = _pair()
    for node in decode.graph.node:
        if node.op_type == "Concat":
            node.op_type = "Sum"
    with pytest.raises(ExportError, match="expected Concat producing present, found Sum"):
        decode_on_mha(decode, 1, None, -1e9)
