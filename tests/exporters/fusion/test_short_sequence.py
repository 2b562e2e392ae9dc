"""short_sequence: mask-free contrib MHA -> Add(If(short, standard Attention, MultiHeadAttention), value bias);
output_bias: a constant bias before a projection folded into the projection's bias."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from mha_deploy.exporters.fusion.output_bias import output_bias_rules
from mha_deploy.exporters.fusion.short_sequence import (
    SHORT_KEYS_MAX,
    SHORT_SCORES_MAX_BYTES,
    short_sequence_rules,
    short_sequence_rules_with,
)
from tests.exporters.fusion import hand_graphs as hg

BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS = 3, 5, 7, 16, 2
SCORE_BYTES = BATCH * HEADS * Q_LEN * KV_LEN * 4


def _mha(**options):
    """Mask-free cross-attention contrib MHA with a projection bias (hand_graphs.contrib_mha)."""
    return hg.contrib_mha(BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS, bias=True, **options)


def _feeds(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "query": hg.normal((BATCH, Q_LEN, HIDDEN), 1) * scale,
        "key": hg.normal((BATCH, KV_LEN, HIDDEN), 2) * scale,
        "value": hg.normal((BATCH, KV_LEN, HIDDEN), 3),
    }


def _branch_ops(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """"short" (then) and "flash" (else) -> the one op of that branch of the rule's If."""
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    graphs = {a.name: a.g for a in if_node.attribute}
    found = {}
    for role, name in (("short", "then_branch"), ("flash", "else_branch")):
        (node,) = graphs[name].node
        found[role] = node
    return found


@pytest.mark.parametrize("options", [{}, {"scale": 0.3}], ids=["default-scale", "scale"])
def test_mask_free_op_becomes_standard_attention_on_short_sequences_and_flash_beyond(options):
    model = _mha(**options)
    rewritten, count = hg.rewrite(model, short_sequence_rules)
    assert count == 1
    ops = _branch_ops(rewritten)
    assert (ops["short"].domain, ops["short"].op_type) == ("", "Attention")
    assert (ops["flash"].domain, ops["flash"].op_type) == ("com.microsoft", "MultiHeadAttention")
    # Same inputs, and no bias input left: the key bias is dropped, the query's added before the If.
    assert ops["short"].input == ops["flash"].input and len(ops["flash"].input) == 3
    for node in ops.values():
        assert hg.attributes(node).get("scale") == pytest.approx(options.get("scale"))
    # The If's output gets the value bias, as a Constant that output_bias can fold (not a Split output).
    producers = {out: n for n in rewritten.graph.node for out in n.output}
    (if_node,) = [n for n in rewritten.graph.node if n.op_type == "If"]
    (add,) = [n for n in rewritten.graph.node if n.op_type == "Add" and if_node.output[0] in n.input]
    assert add.output[0] == rewritten.graph.output[0].name
    assert producers[next(i for i in add.input if i != if_node.output[0])].op_type == "Constant"


@pytest.mark.parametrize(
    ("keys_max", "scores_max", "branch"),
    [
        (SHORT_KEYS_MAX, SHORT_SCORES_MAX_BYTES, "short"),
        (KV_LEN, SCORE_BYTES, "short"),  # both bounds are inclusive
        (KV_LEN - 1, SCORE_BYTES, "flash"),
        (KV_LEN, SCORE_BYTES - 1, "flash"),
    ],
    ids=["default", "at-both-bounds", "one-key-over", "one-byte-over"],
)
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["unit", "large-scores"])
def test_either_branch_equals_the_op_with_its_bias(keys_max, scores_max, branch, scale):
    # Large scores make the dropped key bias shift them by a lot: the softmax must not care.
    model = _mha()
    rewritten, _ = hg.rewrite(model, short_sequence_rules_with(keys_max, scores_max))
    feeds = _feeds(scale)
    hg.assert_same_outputs(model, rewritten, feeds)
    ran = hg.executed_nodes(rewritten, feeds)
    assert {role for role, node in _branch_ops(rewritten).items() if node.name in ran} == {branch}


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"padding": True}, "the op has a mask, an attention_bias or past/present state"),
        ({"attention_bias": True}, "the op has a mask, an attention_bias or past/present state"),
        ({"unidirectional": 1}, "the op is causal"),
        ({"bias": False}, "bias is not [3 * hidden]"),
    ],
    ids=["key-padding-mask", "attention-bias", "causal", "no-bias"],
)
def test_ops_the_rule_leaves_alone(options, reason):
    model = hg.contrib_mha(BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS, **{"bias": True, **options})
    assert hg.rewrite(model, short_sequence_rules)[1] == 0
    assert reason in hg.failed_checks(model, short_sequence_rules)


def test_a_model_below_opset_23_keeps_its_op():
    model = _mha()
    model.opset_import[0].version = 21
    assert hg.rewrite(model, short_sequence_rules)[1] == 0
    assert "the model's opset is below 23 (no standard Attention)" in hg.failed_checks(model, short_sequence_rules)


# --- output_bias ----------------------------------------------------------------------------------


def _projection(*, constant_weight: bool = True) -> onnx.ModelProto:
    """(x + c) @ W + b with c [HIDDEN] a Constant node, as short_sequence leaves the value bias."""
    g = hg.Graph()
    x = g.input("x", np.float32, [BATCH, Q_LEN, HIDDEN])
    inner = g.op("Add", x, g.const(hg.normal((HIDDEN,), 4), as_node=True))
    weight = g.const(hg.normal((HIDDEN, 2 * HIDDEN), 5)) if constant_weight else g.input("w", np.float32, None)
    g.output(g.op("Add", g.op("MatMul", inner, weight), g.const(hg.normal((2 * HIDDEN,), 6))))
    return g.model()


def test_a_bias_before_a_projection_is_folded_into_its_bias():
    model = _projection()
    rewritten, count = hg.rewrite(model, output_bias_rules)
    assert count == 1
    assert sorted(t for t in hg.op_types(rewritten) if t != "Constant") == ["Add", "MatMul"]
    (matmul,) = [n for n in rewritten.graph.node if n.op_type == "MatMul"]
    assert matmul.input[0] == "x"
    hg.assert_same_outputs(model, rewritten, {"x": hg.normal((BATCH, Q_LEN, HIDDEN), 7)})


def test_a_projection_with_a_weight_fed_at_run_time_is_left_alone():
    model = _projection(constant_weight=False)
    assert hg.rewrite(model, output_bias_rules)[1] == 0
