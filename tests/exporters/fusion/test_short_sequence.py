"""short_sequence: contrib MHA, mask-free or with a key padding mask -> Add(If(short, standard Attention,
MultiHeadAttention), value bias), the long branch's masked op then rewritten by padding_flash;
output_bias: a constant bias before a projection folded into the projection's bias."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from mha_deploy.exporters.fusion.causal_gqa import causal_gqa_rules
from mha_deploy.exporters.fusion.output_bias import output_bias_rules
from mha_deploy.exporters.fusion.padding_flash import padding_flash_rules
from mha_deploy.exporters.fusion.short_sequence import (
    SHORT_KEYS_MAX,
    SHORT_SCORES_MAX_BYTES,
    short_sequence_rules,
    short_sequence_rules_with,
)
from mha_deploy.onnx_nodes import all_nodes
from tests.exporters.fusion import hand_graphs as hg

BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS = 3, 5, 7, 16, 2
SCORE_BYTES = BATCH * HEADS * Q_LEN * KV_LEN * 4


def _mha(**options):
    """Cross-attention contrib MHA with a projection bias (hand_graphs.contrib_mha), mask-free by default."""
    return hg.contrib_mha(BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS, bias=True, **options)


def _feeds(scale: float = 1.0, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    feeds = {
        "query": hg.normal((BATCH, Q_LEN, HIDDEN), 1) * scale,
        "key": hg.normal((BATCH, KV_LEN, HIDDEN), 2) * scale,
        "value": hg.normal((BATCH, KV_LEN, HIDDEN), 3),
    }
    return feeds if mask is None else {**feeds, "key_padding_mask": mask}


ALL_REAL = np.ones((BATCH, KV_LEN), bool)
PADDED = hg.padding_sides(BATCH, KV_LEN, "mixed", seed=2)
# Four real keys in every row, on different sides: a bucket padded to a fixed length.
EQUAL_COUNTS = np.array([[1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1]], bool)
EMPTY_ROW = hg.padding_sides(BATCH, KV_LEN, "empty-row", seed=2)


def _branch_ops(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """"short" (then) and "flash" (else) -> the attention op of that branch of the rule's If (its last node)."""
    graphs = hg.short_sequence_graphs(model)
    return {"short": graphs["short"].node[-1], "flash": graphs["long"].node[-1]}


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
        ({"attention_bias": True}, "the op has an attention_bias or past/present state"),
        # Cross-attention shapes: is_causal would align the queries with other keys.
        ({"unidirectional": 1}, "the op is causal over keys other than its queries' sequence"),
        ({"bias": False}, "bias is not [3 * hidden]"),
        # A 1-D mask_index holds lengths, not a [batch, kv_len] mask.
        ({"mask_index": True}, "key_padding_mask is not int32 [batch, kv_len]"),
    ],
    ids=["attention-bias", "causal", "no-bias", "lengths-mask"],
)
def test_ops_the_rule_leaves_alone(options, reason):
    model = hg.contrib_mha(BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS, **{"bias": True, **options})
    assert hg.rewrite(model, short_sequence_rules)[1] == 0
    assert any(reason in why for why in hg.failed_checks(model, short_sequence_rules))


def test_masked_op_becomes_standard_attention_with_an_additive_mask_and_stays_masked_beyond():
    model = _mha(padding=True)
    rewritten, count = hg.rewrite(model, short_sequence_rules)
    assert count == 1
    ops = _branch_ops(rewritten)
    assert (ops["short"].domain, ops["short"].op_type) == ("", "Attention")
    # attn_mask: the key padding mask made additive and expanded over the queries (ORT does not broadcast it).
    assert len(ops["short"].input) == 4 and ops["short"].input[:3] == ops["flash"].input[:3]
    producers = {out: n for n in hg.short_sequence_graphs(rewritten)["short"].node for out in n.output}
    assert producers[ops["short"].input[3]].op_type == "Expand"
    # The long branch keeps the mask for padding_flash, and no bias (query's added before, key's dropped).
    assert (ops["flash"].domain, ops["flash"].op_type) == ("com.microsoft", "MultiHeadAttention")
    assert ops["flash"].input[3] == "" and ops["flash"].input[4] == hg.node(model, "MultiHeadAttention").input[4]


@pytest.mark.parametrize("mask", [ALL_REAL, PADDED, EQUAL_COUNTS], ids=["all-real", "padded", "equal-counts"])
@pytest.mark.parametrize(("keys_max", "branch"), [(KV_LEN, "short"), (KV_LEN - 1, "flash")], ids=["short", "long"])
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["unit", "large-scores"])
def test_either_branch_equals_the_masked_op(mask, keys_max, branch, scale):
    model = _mha(padding=True)
    rewritten, _ = hg.rewrite(model, short_sequence_rules_with(keys_max, SCORE_BYTES))
    feeds = _feeds(scale, mask)
    hg.assert_same_outputs(model, rewritten, feeds)
    ran = hg.executed_nodes(rewritten, feeds)
    assert {role for role, node in _branch_ops(rewritten).items() if node.name in ran} == {branch}


def test_a_row_without_a_real_key_averages_its_values_on_the_short_branch():
    # The reference's masked_fill gives such a row equal scores: the mean of its values (+ the value bias).
    # The additive fill swamps every score, so the standard Attention op does the same; the contrib op with
    # its mask need not (the parity contract asks only for finite rows there).
    model = _mha(padding=True)
    rewritten, _ = hg.rewrite(model, short_sequence_rules)
    feeds = _feeds(8.0, EMPTY_ROW)
    (output,) = hg.run(rewritten, feeds).values()
    value_bias = hg.normal((3 * HIDDEN,), 5)[2 * HIDDEN :]  # hand_graphs.contrib_mha's bias
    expected = feeds["value"][-1].mean(axis=0) + value_bias
    np.testing.assert_allclose(output[-1], np.broadcast_to(expected, (Q_LEN, HIDDEN)), atol=1e-5, rtol=1e-5)
    rows = np.repeat(EMPTY_ROW.any(axis=1, keepdims=True), Q_LEN, axis=1)
    hg.assert_same_outputs(model, rewritten, feeds, rows=rows)


@pytest.mark.parametrize(
    ("keys_max", "mask", "branch"),
    [
        (KV_LEN, PADDED, "short"),
        (KV_LEN - 1, ALL_REAL, "flash"),
        (KV_LEN - 1, EQUAL_COUNTS, "cut_flash"),
        (KV_LEN - 1, PADDED, "cut_masked"),
    ],
    ids=["short", "long-all-real", "long-equal-counts", "long-padded"],
)
def test_padding_flash_then_rewrites_the_masked_op_of_the_long_branch(keys_max, mask, branch):
    # The order of the pipeline: short_sequence, then padding_flash, which must rewrite the op in the long
    # branch once, and not the masked op of its own cut.
    model = _mha(padding=True)
    short, _ = hg.rewrite(model, short_sequence_rules_with(keys_max, SCORE_BYTES))
    rewritten, count = hg.rewrite(short, padding_flash_rules)
    assert count == 1
    assert hg.rewrite(rewritten, padding_flash_rules)[1] == 0
    feeds = _feeds(1.0, mask)
    hg.assert_same_outputs(model, rewritten, feeds)
    assert hg.padding_flash_ran(rewritten, feeds) == {branch}


# --- causal self-attention -----------------------------------------------------------------------


def _causal(padding: bool) -> onnx.ModelProto:
    """Causal self-attention contrib MHA (q_len = kv_len = KV_LEN) with a projection bias."""
    return hg.contrib_mha(BATCH, KV_LEN, KV_LEN, HIDDEN, HEADS, bias=True, unidirectional=1, padding=padding)


def _causal_feeds(mask: np.ndarray | None) -> dict[str, np.ndarray]:
    feeds = {name: hg.normal((BATCH, KV_LEN, HIDDEN), seed) for seed, name in enumerate(("query", "key", "value"))}
    return feeds if mask is None else {**feeds, "key_padding_mask": mask}


def test_causal_op_becomes_standard_attention_with_is_causal_and_stays_causal_beyond():
    rewritten, count = hg.rewrite(_causal(padding=False), short_sequence_rules)
    assert count == 1
    ops = _branch_ops(rewritten)
    assert (ops["short"].domain, ops["short"].op_type) == ("", "Attention")
    assert hg.attributes(ops["short"]).get("is_causal") == 1
    # The long branch: the causal op without its bias (query, key, value only), for causal_gqa.
    assert hg.attributes(ops["flash"]).get("unidirectional") == 1 and len(ops["flash"].input) == 3


@pytest.mark.parametrize("padding", [None, "right", "left", "mixed"])
@pytest.mark.parametrize(("keys_max", "branch"), [(KV_LEN, "short"), (KV_LEN - 1, "long")], ids=["short", "long"])
def test_causal_branches_equal_the_op_on_real_rows(padding, keys_max, branch):
    # As the pipeline runs them: short_sequence, then causal_gqa on the causal op of the long branch.
    model = _causal(padding=padding is not None)
    short, _ = hg.rewrite(model, short_sequence_rules_with(keys_max, SHORT_SCORES_MAX_BYTES))
    rewritten, count = hg.rewrite(short, causal_gqa_rules)
    assert count == 1
    mask = None if padding is None else hg.padding_sides(BATCH, KV_LEN, padding, seed=3)
    feeds = _causal_feeds(mask)
    # A padded query row is free under the parity contract (finite); the real ones must match.
    hg.assert_same_outputs(model, rewritten, feeds, rows=mask)
    ran = hg.executed_nodes(rewritten, feeds)
    graphs = hg.short_sequence_graphs(rewritten)
    assert (graphs["short"].node[-1].name in ran) == (branch == "short")
    long_ops = {n.op_type for n in all_nodes(graphs["long"]) if n.name in ran}
    assert ("GroupQueryAttention" in long_ops) == (branch == "long")


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
