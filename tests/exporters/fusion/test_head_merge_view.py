"""head_merge_view: heads merged straight into a shape other than [batch, seq, d] (GPT-2's Conv1D flattens them
to [batch * seq, d]) -> merged to [batch, seq, d] first, the flattening after it."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.head_merge_view import head_merge_view_rules
from tests.exporters.fusion.hand_graphs import Graph, assert_same_outputs, failed_checks, op_types, rewrite

BATCH, HEADS, SEQ, HEAD_DIM = 2, 3, 5, 4


def _head_merge(shape, perm=(0, 2, 1, 3)):
    """[batch, heads, seq, head_dim] -> Transpose(perm) -> Reshape(shape)."""
    g = Graph()
    x = g.input("x", np.float32, ["batch", HEADS, "seq", HEAD_DIM])
    g.output(g.op("Reshape", g.op("Transpose", x, perm=list(perm)), g.const(shape, np.int64)))
    return g.model()


def test_heads_flattened_to_rows_are_merged_to_batch_seq_d_first():
    model = _head_merge([-1, HEADS * HEAD_DIM])
    rewritten, count = rewrite(model, head_merge_view_rules)
    assert count == 1
    assert [op for op in op_types(rewritten) if op != "Constant"] == ["Transpose", "Reshape", "Reshape"]
    assert_same_outputs(model, rewritten, {"x": np.random.default_rng(0).normal(
        size=(BATCH, HEADS, SEQ, HEAD_DIM)).astype(np.float32)})


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        # The form upstream's MHA fusion reads already.
        pytest.param(_head_merge([0, 0, HEADS * HEAD_DIM]), "merged into [batch, seq, d]", id="batch-seq-d"),
        pytest.param(_head_merge([-1, HEADS * HEAD_DIM], perm=(0, 1, 3, 2)), "", id="not-a-head-merge"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = rewrite(model, head_merge_view_rules)
    assert count == 0 and op_types(rewritten) == op_types(model)
    if reason:
        assert any(reason in why for why in failed_checks(model, head_merge_view_rules))
