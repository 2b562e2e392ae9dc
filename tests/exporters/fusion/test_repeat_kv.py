"""fusion.repeat_kv: Hugging Face's repeat_kv as torch traces it (Unsqueeze at 2, Expand, Reshape) read back to its
KV heads, and the look-alikes it must leave alone (a tile, a broadcast batch, a reshape that does not merge heads)."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mha_deploy.exporters.fusion.repeat_kv import repeated_heads

BATCH, KV_HEADS, SEQ, HEAD_DIM = 3, 2, 5, 4


def repeat_graph(axis: int = 2, groups: int = 2, source_batch: int = BATCH, out_shape=None) -> onnx.ModelProto:
    """x [source_batch, KV_HEADS, SEQ, HEAD_DIM] -> Unsqueeze(axis) -> Expand -> Reshape -> y, shapes inferred."""
    expanded = [BATCH, KV_HEADS, SEQ, HEAD_DIM]
    expanded.insert(axis, groups)
    out_shape = out_shape or [BATCH, KV_HEADS * groups, SEQ, HEAD_DIM]
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["unsqueezed"], name="repeat.unsqueeze"),
        helper.make_node("Expand", ["unsqueezed", "expanded_shape"], ["expanded"]),
        helper.make_node("Reshape", ["expanded", "out_shape"], ["y"]),
    ]
    initializers = [helper.make_tensor("axes", TensorProto.INT64, [1], [axis]),
                    helper.make_tensor("expanded_shape", TensorProto.INT64, [5], expanded),
                    helper.make_tensor("out_shape", TensorProto.INT64, [4], out_shape)]
    graph = helper.make_graph(nodes, "repeat", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [source_batch, KV_HEADS, SEQ, HEAD_DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def output_of(model: onnx.ModelProto) -> ir.Value:
    return ir.serde.deserialize_model(model).graph.outputs[0]


def test_hugging_faces_repeat_is_read_back_to_its_kv_heads_in_gqa_grouping():
    """Found with its source, first node and sizes; and run, query head h holds KV head h // groups, which is
    GroupQueryAttention's grouping (the claim the ragged layout rests on)."""
    model = repeat_graph(groups=3)
    found = repeated_heads(output_of(model))
    assert found is not None and (found.kv_heads, found.groups) == (KV_HEADS, 3)
    assert found.source.name == "x" and found.unsqueeze.name == "repeat.unsqueeze"
    x = np.random.default_rng(0).standard_normal((BATCH, KV_HEADS, SEQ, HEAD_DIM)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for head in range(KV_HEADS * 3):
        np.testing.assert_array_equal(y[:, head], x[:, head // 3])


@pytest.mark.parametrize("model", [
    # a tile (torch's .repeat over heads): head h holds KV head h % kv_heads, not GroupQueryAttention's grouping
    repeat_graph(axis=1),
    # the batch broadcast too: not a repeat of this batch's heads
    repeat_graph(source_batch=1),
    # the groups merged into the length, not the heads
    repeat_graph(out_shape=[BATCH, KV_HEADS, SEQ * 2, HEAD_DIM]),
    # one group: nothing is repeated
    repeat_graph(groups=1),
], ids=["tile", "broadcast-batch", "merged-into-length", "one-group"])
def test_look_alikes_are_not_read_as_a_repeat(model):
    assert repeated_heads(output_of(model)) is None
