"""padding_flash: contrib MHA with a key_padding_mask -> If(any key padded, masked op, mask-free op)."""

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


def _branch_ops(model) -> dict[str, list]:
    """Each If branch's op types and inputs."""
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    return {a.name: [(n.op_type, list(n.input)) for n in a.g.node] for a in if_node.attribute}


def _branch_op_names(model) -> dict[str, str]:
    """"masked" (then) and "flash" (else) -> the name of the op that branch runs."""
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    graphs = {a.name: a.g for a in if_node.attribute}
    return {"masked": graphs["then_branch"].node[0].name, "flash": graphs["else_branch"].node[0].name}


ALL_REAL = np.ones((BATCH, KV_LEN), bool)
PADDED = hg.padding_sides(BATCH, KV_LEN, "mixed", seed=2)
# A query whose keys are all padding: the reference's uniform average over the values, kept by the masked branch.
EMPTY_ROW = hg.padding_sides(BATCH, KV_LEN, "empty-row", seed=2)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_masked_op_goes_under_an_if_with_a_mask_free_branch(bias):
    model = _mha(bias=bias)
    rewritten, count = hg.rewrite(model, padding_flash_rules)
    assert count == 1
    assert "com.microsoft.MultiHeadAttention" not in hg.op_types(rewritten)
    branches = _branch_ops(rewritten)
    masked, flash = branches["then_branch"], branches["else_branch"]
    assert [op for op, _ in masked] == [op for op, _ in flash] == ["MultiHeadAttention"]
    assert len(masked[0][1]) == 5 and masked[0][1][4]  # ... bias, key_padding_mask
    assert len(flash[0][1]) <= 4  # no key_padding_mask: the flash path


@pytest.mark.parametrize(
    ("mask", "branch"),
    [(ALL_REAL, "flash"), (PADDED, "masked"), (EMPTY_ROW, "masked")],
    ids=["all-real-takes-flash", "padded-takes-masked", "empty-row-takes-masked"],
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_each_branch_equals_the_masked_op(mask, branch, bias):
    model = _mha(bias=bias)
    rewritten, _ = hg.rewrite(model, padding_flash_rules)
    feeds = _feeds(mask)
    hg.assert_same_outputs(model, rewritten, feeds)
    ran = hg.executed_nodes(rewritten, feeds)
    names = _branch_op_names(rewritten)
    assert names[branch] in ran
    assert names["masked" if branch == "flash" else "flash"] not in ran


def test_rewriting_again_changes_nothing():
    # The masked branch holds the masked op again: the rule must not recurse into it.
    rewritten, _ = hg.rewrite(_mha(), padding_flash_rules)
    again, count = hg.rewrite(rewritten, padding_flash_rules)
    assert count == 0
    assert _branch_ops(again) == _branch_ops(rewritten)


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
