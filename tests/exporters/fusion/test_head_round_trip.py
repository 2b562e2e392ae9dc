"""fusion.head_round_trip on ``MultiHeadAttention`` (``drop_mha_round_trips``, run by the mha chain): the op's output
split into heads and merged back through a Reshape between two Transposes (ViT's permute, view, permute) is the op's
output, read as it is; a chain that moves elements, or one that is the graph's output, stays.

The graphs record their values' shapes as torch's export does (symbolic batch and seq): the pass reads them. Outputs
compared in ORT with graph optimizations off: only copies are removed, so they are equal (atol 0)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper
from onnx_ir.passes.common import RemoveUnusedNodesPass

from mha_deploy.exporters.fusion.head_round_trip import drop_mha_round_trips
from tests.exporters.fusion.hand_graphs import Graph, op_types, run

HEADS, HEAD_DIM = 2, 4
D = HEADS * HEAD_DIM


def _graph(second_perm=(0, 2, 1, 3), merged_is_output: bool = False) -> onnx.ModelProto:
    """x [batch, seq, D] -> MultiHeadAttention(x, x, x) -> Reshape [0, 0, heads, -1] -> Transpose(0, 2, 1, 3) ->
    Reshape to the shape it has -> Transpose(``second_perm``) -> Reshape [batch, seq, D] -> MatMul (the output
    projection) -> y; with ``merged_is_output`` the merged value is the graph's output instead."""
    g = Graph()
    x = g.input("x", np.float32, ["batch", "seq", D])
    out = g.op("MultiHeadAttention", x, x, x, domain="com.microsoft", num_heads=HEADS)
    split = g.op("Reshape", out, g.const([0, 0, HEADS, -1], np.int64))
    heads_first = g.op("Transpose", split, perm=[0, 2, 1, 3])
    viewed = g.op("Reshape", heads_first, g.const([0, 0, 0, 0], np.int64))  # the module's view to its own shape
    back = g.op("Transpose", viewed, perm=list(second_perm))
    merged_shape = g.op("Concat", g.op("Shape", x, end=2), g.const([D], np.int64), axis=0)
    merged = g.op("Reshape", back, merged_shape)
    if merged_is_output:
        g.output(merged)
    else:
        g.output(g.op("MatMul", merged, g.const(np.random.default_rng(0).standard_normal((D, D)))))
    model = g.model()
    # torch's export records these shapes; onnx's inference does not know the contrib op's output
    shapes = {split: ["batch", "seq", HEADS, HEAD_DIM], heads_first: ["batch", HEADS, "seq", HEAD_DIM],
              viewed: ["batch", HEADS, "seq", HEAD_DIM],
              back: ["batch", "seq", HEADS, HEAD_DIM] if tuple(second_perm) == (0, 2, 1, 3)
              else ["batch", HEADS, HEAD_DIM, "seq"],
              merged: ["batch", "seq", D]}
    del model.graph.value_info[:]
    model.graph.value_info.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
                                  for name, dims in shapes.items() if name not in {o.name for o in model.graph.output})
    return model


def _dropped(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    ir_model = ir.serde.deserialize_model(model)
    done = drop_mha_round_trips(ir_model)
    RemoveUnusedNodesPass()(ir_model)
    return ir.serde.serialize_model(ir_model), done


def _feeds():
    return {"x": np.random.default_rng(1).standard_normal((3, 5, D)).astype(np.float32)}


def test_the_split_and_merge_back_is_the_ops_output():
    model = _graph()
    dropped, done = _dropped(model)
    assert done == 1
    assert "Transpose" not in op_types(dropped) and "Reshape" not in op_types(dropped)
    attention = next(n for n in dropped.graph.node if n.op_type == "MultiHeadAttention")
    projection = next(n for n in dropped.graph.node if n.op_type == "MatMul")
    assert projection.input[0] == attention.output[0]
    (want,), (have,) = run(model, _feeds()).values(), run(dropped, _feeds()).values()
    np.testing.assert_allclose(have, want, rtol=0, atol=0)


def test_transposes_that_move_elements_stay():
    """(0, 2, 1, 3) then (0, 1, 3, 2): not the identity together, the merge reorders the context: kept."""
    model = _graph(second_perm=(0, 1, 3, 2))
    dropped, done = _dropped(model)
    assert done == 0 and op_types(dropped).count("Transpose") == 2


def test_a_merge_that_is_the_graphs_output_stays():
    dropped, done = _dropped(_graph(merged_is_output=True))
    assert done == 0 and op_types(dropped).count("Transpose") == 2
