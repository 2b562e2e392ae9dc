"""causal_gqa: causal contrib MultiHeadAttention -> GroupQueryAttention, padding compacted to the front."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.causal_gqa import causal_gqa_rules
from tests.exporters.fusion import hand_graphs as hg

# GQA wants head sizes that are multiples of 8: 32 / 2 heads = 16.
BATCH, SEQ, HIDDEN, HEADS = 4, 9, 32, 2


def _mha(*, kv_len=SEQ, hidden=HIDDEN, unidirectional=1, **options):
    """Causal contrib MHA over q [BATCH, SEQ, hidden] and k/v [BATCH, kv_len, hidden] (hand_graphs.contrib_mha)."""
    return hg.contrib_mha(BATCH, SEQ, kv_len, hidden, HEADS, unidirectional=unidirectional, **options)


def _feeds(model, side="right", seed=0):
    names = {i.name: i for i in model.graph.input}
    feeds = {}
    for i, name in enumerate(("query", "key", "value")):
        dims = [d.dim_value for d in names[name].type.tensor_type.shape.dim]
        feeds[name] = hg.normal(dims, seed + i)
    if "key_padding_mask" in names:
        feeds["key_padding_mask"] = hg.padding_sides(BATCH, SEQ, side, seed)
    return feeds


@pytest.mark.parametrize(
    "options",
    [{}, {"bias": True}, {"scale": 0.3}, {"bias": True, "scale": 0.3}],
    ids=["plain", "bias", "scale", "bias-scale"],
)
def test_causal_becomes_group_query_attention(options):
    model = _mha(**options)
    rewritten, count = hg.rewrite(model, causal_gqa_rules)
    assert count == 1
    assert "com.microsoft.MultiHeadAttention" not in hg.op_types(rewritten)
    gqa = hg.node(rewritten, "GroupQueryAttention")
    attributes = hg.attributes(gqa)
    assert (attributes["num_heads"], attributes["kv_num_heads"]) == (HEADS, HEADS)
    # present_key/value are unused, but without them ORT's CPU kernel leaves its flash path.
    assert len(gqa.output) == 3 and all(gqa.output)
    assert attributes.get("scale") == (pytest.approx(options["scale"]) if "scale" in options else None)
    assert "GatherND" not in hg.op_types(rewritten)  # nothing to compact without a padding mask
    hg.assert_same_outputs(model, rewritten, _feeds(model))


@pytest.mark.parametrize("side", ["right", "left", "mixed", "empty-row"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_padding_is_compacted_for_any_side(side, bias):
    # Real query rows must equal MHA(key_padding_mask, unidirectional); padded rows only be finite
    # (a row with no real token at all included).
    model = _mha(padding=True, bias=bias)
    rewritten, count = hg.rewrite(model, causal_gqa_rules)
    assert count == 1
    ops = hg.op_types(rewritten)
    assert ops.count("GatherND") == 4  # q, k, v to the compacted order, the output back
    feeds = _feeds(model, side, seed=3)
    hg.assert_same_outputs(model, rewritten, feeds, rows=feeds["key_padding_mask"])


def test_compaction_is_exact_on_every_real_row_of_many_random_masks():
    model = _mha(padding=True, bias=True)
    rewritten, _ = hg.rewrite(model, causal_gqa_rules)
    rng = np.random.default_rng(1)
    for seed in range(5):
        feeds = _feeds(model, seed=seed)
        feeds["key_padding_mask"] = rng.random((BATCH, SEQ)) < 0.6  # holes anywhere, not only at one side
        hg.assert_same_outputs(model, rewritten, feeds, rows=feeds["key_padding_mask"])


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_mha(unidirectional=0), "not causal", id="not-causal"),
        pytest.param(_mha(padding=True, attention_bias=True), "attention_bias", id="float-bias"),
        # Keys of another length: no single sequence for "key <= query".
        pytest.param(_mha(kv_len=SEQ + 2), "not self-attention", id="cross-attention"),
        pytest.param(_mha(hidden=3 * HEADS * 4), "not a multiple of 8", id="head-size-12"),
        # One mask row for the whole batch: not one per sequence.
        pytest.param(_mha(padding=True, mask_shape=(1, SEQ)), "key_padding_mask is not", id="mask-not-per-batch"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, causal_gqa_rules)
    assert count == 0
    assert "com.microsoft.GroupQueryAttention" not in hg.op_types(rewritten)
    assert any(reason in why for why in hg.failed_checks(model, causal_gqa_rules))
