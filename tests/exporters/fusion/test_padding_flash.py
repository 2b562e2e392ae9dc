"""padding_flash: contrib MHA with a key_padding_mask -> If(any key padded, cut keys (flash or masked), flash)."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.padding_flash import padding_flash_rules
from tests.exporters.fusion import hand_graphs as hg

BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS = 3, 4, 6, 8, 2


def _mha(*, padding=True, **options):
    """Contrib MHA with cross-attention shapes and a key padding mask (hand_graphs.contrib_mha)."""
    return hg.contrib_mha(BATCH, Q_LEN, KV_LEN, HIDDEN, HEADS, padding=padding, **options)


def _feeds(mask: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "query": hg.normal((BATCH, Q_LEN, HIDDEN), 1),
        "key": hg.normal((BATCH, KV_LEN, HIDDEN), 2),
        "value": hg.normal((BATCH, KV_LEN, HIDDEN), 3),
        "key_padding_mask": mask,
    }


def _op(graph):
    (node,) = graph.node
    return node


ALL_REAL = np.ones((BATCH, KV_LEN), bool)
PADDED = hg.padding_sides(BATCH, KV_LEN, "mixed", seed=2)
# Four real keys in every row, on different sides: a bucket padded to a fixed length.
EQUAL_COUNTS = np.array([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1]], bool)
# A row whose keys are all padding: the parity contract asks only that it stays finite.
EMPTY_ROW = hg.padding_sides(BATCH, KV_LEN, "empty-row", seed=2)
ALL_EMPTY = np.zeros((BATCH, KV_LEN), bool)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_masked_op_becomes_flash_unless_rows_hold_unequal_real_keys(bias):
    model = _mha(bias=bias)
    rewritten, count = hg.rewrite(model, padding_flash_rules)
    assert count == 1
    assert "com.microsoft.MultiHeadAttention" not in hg.op_types(rewritten)
    graphs = hg.padding_flash_graphs(rewritten)
    flash, cut_flash, cut_masked = (_op(graphs[role]) for role in ("flash", "cut_flash", "cut_masked"))
    assert {flash.op_type, cut_flash.op_type, cut_masked.op_type} == {"MultiHeadAttention"}
    assert list(flash.input[:3]) == ["query", "key", "value"] and len(flash.input) <= 4  # no mask: flash path
    assert len(cut_flash.input) <= 4
    assert len(cut_masked.input) == 5 and cut_masked.input[4]  # ... bias, key_padding_mask (of the cut)
    # Both cut ops read the gathered keys and values, not the model's.
    assert cut_flash.input[1:3] == cut_masked.input[1:3] and "key" not in cut_flash.input[1:3]
    assert [n.op_type for n in graphs["cut"].node].count("GatherND") == 2


@pytest.mark.parametrize(
    ("mask", "branch"),
    [(ALL_REAL, "flash"), (EQUAL_COUNTS, "cut_flash"), (PADDED, "cut_masked")],
    ids=["all-real-takes-flash", "equal-counts-take-flash-on-the-cut", "unequal-counts-take-masked-on-the-cut"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_each_branch_equals_the_masked_op(mask, branch, bias):
    model = _mha(bias=bias)
    rewritten, _ = hg.rewrite(model, padding_flash_rules)
    feeds = _feeds(mask)
    hg.assert_same_outputs(model, rewritten, feeds)
    assert hg.padding_flash_ran(rewritten, feeds) == {branch}


@pytest.mark.parametrize("mask", [EMPTY_ROW, ALL_EMPTY], ids=["one-row", "every-row"])
def test_rows_without_a_real_key_stay_finite(mask):
    model = _mha()
    rewritten, _ = hg.rewrite(model, padding_flash_rules)
    feeds = _feeds(mask)
    # Cross-attention: every query row of a batch row with real keys is compared, the others only checked finite.
    rows = np.repeat(mask.any(axis=1, keepdims=True), Q_LEN, axis=1)
    hg.assert_same_outputs(model, rewritten, feeds, rows=rows)


def test_rewriting_again_changes_nothing():
    # The branches hold the masked op again: the rule must not recurse into them.
    rewritten, _ = hg.rewrite(_mha(), padding_flash_rules)
    again, count = hg.rewrite(rewritten, padding_flash_rules)
    assert count == 0
    assert again.graph == rewritten.graph


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_mha(padding=False), "no key padding mask", id="no-mask"),
        # Causal ops have no flash path in either branch (causal_gqa handles them).
        pytest.param(_mha(unidirectional=1), "causal", id="causal"),
        pytest.param(_mha(attention_bias=True), "attention_bias", id="float-bias"),
        # A 1-D mask_index holds lengths, not a [batch, kv_len] mask.
        pytest.param(_mha(mask_index=True), "not int32 [batch, kv_len]", id="lengths-mask"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, padding_flash_rules)
    assert count == 0
    assert "If" not in hg.op_types(rewritten)
    assert any(reason in why for why in hg.failed_checks(model, padding_flash_rules))
