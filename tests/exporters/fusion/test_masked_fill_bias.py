"""masked_fill_bias: ``Softmax(Where(cond, FILL, scores))`` -> ``Softmax(Add(scores, Where(cond, FILL, 0)))``."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from mha_deploy.exporters.fusion.masked_fill_bias import masked_fill_bias_rules
from tests.exporters.fusion.hand_graphs import FILL, Graph, assert_same_outputs, failed_checks, op_types, rewrite

SCORES = [2, 3, 4]  # [batch, q_len, kv_len]


def _masked_softmax(fill=FILL, *, fill_as_node=False, fill_as_input=False, scores_dtype=np.float32, axis=-1):
    """``Softmax(Where(masked, fill, scores))`` as torch exports ``scores.masked_fill(mask == 0, fill)``."""
    g = Graph()
    masked = g.input("masked", bool, [2, 1, 4])  # True = hidden from the query
    scores = g.input("scores", scores_dtype, SCORES)
    fill = g.input("fill", np.float32, []) if fill_as_input else g.const(fill, scores_dtype, as_node=fill_as_node)
    g.output(g.op("Softmax", g.op("Where", masked, fill, scores), axis=axis), scores_dtype)
    return g.model()


def _feeds(seed=0):
    rng = np.random.default_rng(seed)
    masked = rng.random((2, 1, 4)) < 0.5
    masked[..., 0] = False  # every query sees a key: where replace and add agree
    return {"masked": masked, "scores": rng.standard_normal(SCORES).astype(np.float32)}


@pytest.mark.parametrize("fill", [FILL, -1e4, float("-inf"), float(np.finfo(np.float32).min)])
@pytest.mark.parametrize("fill_as_node", [False, True], ids=["initializer", "constant-node"])
def test_masked_fill_becomes_an_additive_bias(fill, fill_as_node):
    model = _masked_softmax(fill, fill_as_node=fill_as_node)
    rewritten, count = rewrite(model, masked_fill_bias_rules)
    assert count == 1
    assert op_types(rewritten) == ["Where", "Add", "Softmax"]
    assert_same_outputs(model, rewritten, _feeds())


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        # A soft penalty, not a mask: adding it is not the same as replacing the score with it.
        pytest.param(_masked_softmax(-1.0), "fill -1.0 is not a masking value", id="fill-minus-one"),
        pytest.param(_masked_softmax([FILL] * 4), "not a scalar constant", id="non-scalar-fill"),
        pytest.param(_masked_softmax(fill_as_input=True), "not a scalar constant", id="fill-is-an-input"),
        pytest.param(_masked_softmax(FILL, scores_dtype=np.int32), "not floating point", id="integer-scores"),
        pytest.param(_masked_softmax(axis=1), None, id="softmax-not-over-keys"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = rewrite(model, masked_fill_bias_rules)
    assert count == 0
    assert op_types(rewritten) == op_types(model)
    if reason is not None:
        assert any(reason in why for why in failed_checks(model, masked_fill_bias_rules))


def test_fill_in_the_else_branch_is_left_alone():
    # Where(cond, scores, FILL) keeps the score where cond holds: the pattern's "fill" is then
    # the scores tensor, which is no constant.
    g = Graph()
    keep = g.input("keep", bool, [2, 1, 4])
    scores = g.input("scores", np.float32, SCORES)
    g.output(g.op("Softmax", g.op("Where", keep, scores, g.const(FILL)), axis=-1))
    model = g.model()
    assert rewrite(model, masked_fill_bias_rules)[1] == 0
    assert any("not a scalar constant" in why for why in failed_checks(model, masked_fill_bias_rules))


def test_default_initializer_is_not_a_constant_fill():
    # An initializer that is also a graph input is a default the caller may override.
    model = _masked_softmax()
    fill_name = model.graph.initializer[0].name
    model.graph.input.append(helper.make_tensor_value_info(fill_name, TensorProto.FLOAT, []))
    assert rewrite(model, masked_fill_bias_rules)[1] == 0
