"""fusion.softcap: a soft-capped attention (Gemma-2) read from the graph as the module wrote it, and what is not one.
End to end (the ragged GroupQueryAttention with ``softcap``, tokens equal transformers'): tests/exporters/
test_llm_families.py."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from mha_deploy.exporters.fusion.softcap import as_capped_mha, softcapped_attention

HEADS, SEQ, DIM = 2, 3, 8


def _graph(inner: float = 50.0, outer: float = 50.0, divide: bool = True, masked: bool = True) -> onnx.ModelProto:
    """Gemma-2's eager attention: Softmax(tanh(q kᵀ * 0.25 / inner) * outer + mask) v, head-merged to 3-D."""
    def tensor(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    constants = [helper.make_tensor(name, TensorProto.FLOAT, [], [value]) for name, value in
                 (("scale", 0.25), ("inner", inner if divide else 1 / inner), ("outer", outer))]
    constants.append(helper.make_tensor("merged_shape", TensorProto.INT64, [3], [0, 0, HEADS * DIM]))
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
             helper.make_node("Div" if divide else "Mul", ["scaled", "inner"], ["divided"]),
             helper.make_node("Tanh", ["divided"], ["t"]), helper.make_node("Mul", ["t", "outer"], ["capped"])]
    if masked:
        nodes.append(helper.make_node("Add", ["capped", "mask"], ["biased"]))
    nodes += [helper.make_node("Softmax", ["biased" if masked else "capped"], ["probs"], axis=-1, name="sm"),
              helper.make_node("MatMul", ["probs", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["o_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o_t", "merged_shape"], ["out"])]
    inputs = [tensor(name, ["batch", HEADS, "seq", DIM]) for name in "qkv"]
    if masked:
        inputs.append(tensor("mask", ["batch", 1, "seq", "seq"]))
    graph = helper.make_graph(nodes, "g", inputs, [tensor("out", ["batch", "seq", HEADS * DIM])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    return onnx.shape_inference.infer_shapes(model)


def _softmax(graph: ir.Graph) -> ir.Node:
    return next(node for node in graph if node.op_type == "Softmax")


@pytest.mark.parametrize("divide", [True, False], ids=["div", "mul-by-inverse"])
def test_a_soft_capped_attention_is_read_with_its_scale_cap_and_mask(divide):
    graph = ir.serde.deserialize_model(_graph(divide=divide)).graph
    found = softcapped_attention(_softmax(graph))
    assert found is not None
    assert (found.scale, found.cap, found.bias.name) == (0.25, pytest.approx(50.0), "mask")


@pytest.mark.parametrize("change", [{"outer": 30.0}, {"inner": -50.0, "outer": -50.0}],
                         ids=["two-different-caps", "negative-cap"])
def test_a_tanh_that_is_not_a_cap_is_not_read_as_one(change):
    """tanh(s / 50) * 30 is not tanh(s / c) * c for any c: GroupQueryAttention's softcap would change it."""
    graph = ir.serde.deserialize_model(_graph(**change)).graph
    assert softcapped_attention(_softmax(graph)) is None


def test_the_attention_becomes_one_multi_head_attention_carrying_its_cap_beside_it():
    """The op reads the query, keys and values merged to [batch, seq, hidden], the mask as attention_bias, the
    scale as scale; its output replaces the module's head merge; the cap is returned, not written."""
    model = ir.serde.deserialize_model(_graph())
    caps = as_capped_mha(model.graph)
    (node, cap), = caps.items()
    assert (node.op_type, node.domain, cap) == ("MultiHeadAttention", "com.microsoft", pytest.approx(50.0))
    assert node.attributes.get_int("num_heads") == HEADS and node.attributes.get_float("scale") == 0.25
    assert "softcap" not in node.attributes
    assert node.inputs[5].name == "mask" and [value.shape.rank() for value in node.inputs[:3]] == [3, 3, 3]
    merged = node.inputs[0].producer()
    assert (merged.op_type, merged.inputs[0].producer().op_type) == ("Reshape", "Transpose")
    assert merged.inputs[0].producer().inputs[0] is model.graph.inputs[0]  # the module's own query
    assert [d if isinstance(d, int) else None for d in node.outputs[0].shape] == [None, None, HEADS * DIM]
