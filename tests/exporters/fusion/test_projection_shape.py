"""projection_shape: ``Shape(Add(MatMul(x, W), b), start, end)`` -> ``Shape(x, start, end)`` on leading axes."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.projection_shape import projection_shape_rules
from tests.exporters.fusion.hand_graphs import Graph, assert_same_outputs, failed_checks, node, normal, rewrite

D_IN, D_OUT = 8, 6


def _projection_shape(
    start=1, end=2, *, x_shape=("batch", "seq", D_IN), weight_shape=(D_IN, D_OUT), bias_shape=(D_OUT,)
):
    """The projection (kept alive as an output, as the attention op reads it) and a Shape of it."""
    g = Graph()
    x = g.input("x", np.float32, list(x_shape) if x_shape is not None else None)
    projected = g.op("Add", g.op("MatMul", x, g.const(normal(weight_shape, 1))), g.const(normal(bias_shape, 2)))
    g.output(projected)
    attributes = {"start": start} | ({"end": end} if end is not None else {})
    g.output(g.op("Shape", projected, **attributes), np.int64)
    return g.model()


@pytest.mark.parametrize(("start", "end"), [(0, 1), (1, 2), (0, 2)])
def test_shape_of_leading_axes_reads_the_projection_input(start, end):
    model = _projection_shape(start, end)
    rewritten, count = rewrite(model, projection_shape_rules)
    assert count == 1
    assert list(node(rewritten, "Shape").input) == ["x"]
    # The projection stays: only the extra use that kept the Add alive goes.
    assert [n.op_type for n in rewritten.graph.node if n.op_type in ("MatMul", "Add")] == ["MatMul", "Add"]
    assert_same_outputs(model, rewritten, {"x": normal((2, 5, D_IN))})


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_projection_shape(0, None), "reaches the projected axis", id="whole-shape"),
        pytest.param(_projection_shape(1, 3), "reaches the projected axis", id="end-is-rank"),
        pytest.param(_projection_shape(-2, 2), "reaches the projected axis", id="negative-start"),
        # A batched weight broadcasts the leading axes: [1, seq, d] @ [2, d, e] is [2, seq, e].
        pytest.param(
            _projection_shape(0, 1, x_shape=(1, "seq", D_IN), weight_shape=(2, D_IN, D_OUT)),
            "not a projection",
            id="batched-weight",
        ),
        # A bias with a seq axis may broadcast it too.
        pytest.param(_projection_shape(0, 1, bias_shape=(1, 5, D_OUT)), "not a vector", id="bias-not-a-vector"),
        pytest.param(_projection_shape(0, 1, x_shape=None), "not a projection", id="unknown-rank"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = rewrite(model, projection_shape_rules)
    assert count == 0
    assert node(rewritten, "Shape").input[0] == node(model, "Shape").input[0]
    assert any(reason in why for why in failed_checks(model, projection_shape_rules))
