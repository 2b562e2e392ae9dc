"""causal_gqa: causal contrib MultiHeadAttention -> If(scores small, GroupQueryAttention materialising,
GroupQueryAttention tiled); with a padding mask under If(any token padded, compacted and cut, as they are)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from mha_deploy.exporters.fusion.causal_gqa import MATERIALISE_MAX_BYTES, causal_gqa_rules, causal_gqa_rules_with
from mha_deploy.onnx_nodes import all_nodes
from tests.exporters.fusion import hand_graphs as hg

# GQA wants head sizes that are multiples of 8: 32 / 2 heads = 16.
BATCH, SEQ, HIDDEN, HEADS = 4, 9, 32, 2
# The [batch, heads, seq, seq] fp32 scores of these graphs: far below the default threshold.
SCORE_BYTES = BATCH * HEADS * SEQ * SEQ * 4


def _mha(*, kv_len=SEQ, hidden=HIDDEN, unidirectional=1, **options):
    """Causal contrib MHA over q [BATCH, SEQ, hidden] and k/v [BATCH, kv_len, hidden] (hand_graphs.contrib_mha)."""
    return hg.contrib_mha(BATCH, SEQ, kv_len, hidden, HEADS, unidirectional=unidirectional, **options)


def _graphs(model) -> dict[str, onnx.GraphProto]:
    """Where the size If sits: the model's graph ("top", no mask), else the padding If's "compacted" (then) and
    "full" (else) branches."""
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    graphs = {a.name: a.g for a in if_node.attribute}
    if all(len(g.node) == 1 for g in graphs.values()):
        return {"top": model.graph}
    return {"compacted": graphs["then_branch"], "full": graphs["else_branch"]}


def _branches(model, where: str | None = None) -> dict[str, onnx.NodeProto]:
    """"materialised" (then) and "tiled" (else) -> the GroupQueryAttention node that branch of the size If in
    ``where`` (see _graphs; default: the only one) runs."""
    graphs = _graphs(model)
    (if_node,) = [n for n in graphs[where or next(iter(graphs))].node if n.op_type == "If"]
    branches = {a.name: a.g for a in if_node.attribute}
    found = {}
    for branch, name in (("materialised", "then_branch"), ("tiled", "else_branch")):
        (gqa,) = branches[name].node
        assert gqa.op_type == "GroupQueryAttention"
        found[branch] = gqa
    return found


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
    branches = _branches(rewritten)
    materialised, tiled = branches["materialised"], branches["tiled"]
    for gqa in (materialised, tiled):
        attributes = hg.attributes(gqa)
        assert (attributes["num_heads"], attributes["kv_num_heads"]) == (HEADS, HEADS)
        assert attributes.get("scale") == (pytest.approx(options["scale"]) if "scale" in options else None)
    assert list(materialised.input) == list(tiled.input)  # the same op on the same values
    # present_key/value are unused; asking for them is what sends ORT's CPU kernel down its tiled path.
    assert len(materialised.output) == 1
    assert len(tiled.output) == 3 and all(tiled.output)
    assert _graphs(rewritten) == {"top": rewritten.graph}  # nothing to compact without a padding mask
    hg.assert_same_outputs(model, rewritten, _feeds(model))


@pytest.mark.parametrize(
    ("threshold", "branch"),
    [
        (MATERIALISE_MAX_BYTES, "materialised"),
        (SCORE_BYTES, "materialised"),  # "up to": equal is still small
        (SCORE_BYTES - 1, "tiled"),
    ],
    ids=["default", "at-threshold", "one-byte-over"],
)
@pytest.mark.parametrize(
    ("padding", "side", "where"),
    [(False, "right", "top"), (True, "all-real", "full"), (True, "right", "compacted")],
    ids=["no-mask", "nothing-padded", "padded"],
)
def test_the_score_size_chooses_the_branch_and_both_equal_the_op(threshold, branch, padding, side, where):
    model = _mha(padding=padding, bias=True)
    rewritten, count = hg.rewrite(model, causal_gqa_rules_with(threshold))
    assert count == 1
    feeds = _feeds(model, "right", seed=5)
    if padding:
        # Padded: every row at least one token short, so the cut is shorter than seq and its scores smaller.
        feeds["key_padding_mask"][:, -1] = side == "all-real"
        if side == "all-real":
            feeds["key_padding_mask"][:] = True
    hg.assert_same_outputs(model, rewritten, feeds, rows=feeds.get("key_padding_mask"))
    ran = hg.executed_nodes(rewritten, feeds)
    gqa_ran = {
        (graph, kind) for graph in _graphs(rewritten) for kind, gqa in _branches(rewritten, graph).items()
        if gqa.name in ran
    }
    if where == "compacted" and branch == "tiled" and threshold == SCORE_BYTES - 1:
        branch = "materialised"  # the cut's scores fit where the full ones did not
    assert gqa_ran == {(where, branch)}


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "padding"])
def test_without_materialising_every_gqa_asks_for_present_as_cuda_requires(padding):
    """ORT 1.31's CUDA GroupQueryAttention fails a GQA without present_key/present_value ("required unless
    borrowing a non-quantized KV cache", seen on an H200): with materialising off (fp16 exports, made for CUDA)
    there is no size If and every GQA has its three outputs; equal to the op on every real row."""
    model = _mha(padding=padding, bias=True)
    rewritten, count = hg.rewrite(model, causal_gqa_rules_with(0))
    assert count == 1
    gqas = [n for n in all_nodes(rewritten.graph) if n.op_type == "GroupQueryAttention"]
    assert len(gqas) == (2 if padding else 1)  # padding: the compacted and the as-they-are branch
    assert all(len(gqa.output) == 3 and all(gqa.output) for gqa in gqas)
    # Nor a cut to the longest row: its length, computed from the mask's values on the device, failed CUDA's GQA
    # as its total_sequence_length; the padded length comes from a Shape instead.
    producers = {output: n for n in all_nodes(rewritten.graph) for output in n.output}

    def chain(value: str) -> list[str]:
        ops = []
        while value in producers and len(ops) < 4:
            ops.append(producers[value].op_type)
            value = producers[value].input[0]
        return ops

    assert all(chain(gqa.input[6])[:3] == ["Cast", "Squeeze", "Shape"] for gqa in gqas)
    feeds = _feeds(model, "right", seed=5)
    hg.assert_same_outputs(model, rewritten, feeds, rows=feeds.get("key_padding_mask"))


@pytest.mark.parametrize("mask", ["causal", "padding-causal"])
def test_an_fp16_causal_export_runs_gqa_in_the_form_cuda_takes(tmp_path, mask):
    from mha_deploy.exporters import export_mha
    from mha_deploy.metadata import Signature
    from mha_deploy.models import MultiHeadAttention

    path = tmp_path / "mha.onnx"
    export_mha(MultiHeadAttention(32, 2).eval(), path, Signature("self", mask), fuse="mha", dtype="fp16")
    gqas = [n for n in all_nodes(onnx.load(path).graph) if n.op_type == "GroupQueryAttention"]
    assert gqas and all(len(gqa.output) == 3 for gqa in gqas)


def test_the_threshold_counts_half_precision_scores_at_two_bytes():
    # fp16 scores take half the bytes: the same shape stays under a threshold fp32 would exceed.
    model = _mha()
    rewritten, _ = hg.rewrite(model, causal_gqa_rules_with(SCORE_BYTES // 2))
    fp16 = onnx.ModelProto()
    fp16.CopyFrom(model)
    for value in (*fp16.graph.input, *fp16.graph.output, *fp16.graph.value_info):
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    rewritten16, _ = hg.rewrite(fp16, causal_gqa_rules_with(SCORE_BYTES // 2))
    feeds = _feeds(model)
    names32 = {name: gqa.name for name, gqa in _branches(rewritten).items()}
    names16 = {name: gqa.name for name, gqa in _branches(rewritten16).items()}
    assert names32["tiled"] in hg.executed_nodes(rewritten, feeds)
    feeds16 = {name: x.astype(np.float16) for name, x in feeds.items()}
    assert names16["materialised"] in hg.executed_nodes(rewritten16, feeds16)


@pytest.mark.parametrize("side", ["right", "left", "mixed", "empty-row"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_padding_is_compacted_for_any_side(side, bias):
    # Real query rows must equal MHA(key_padding_mask, unidirectional); padded rows only be finite
    # (a row with no real token at all included).
    model = _mha(padding=True, bias=bias)
    rewritten, count = hg.rewrite(model, causal_gqa_rules)
    assert count == 1
    graphs = _graphs(rewritten)
    # q, k, v to the compacted order, the output back; nothing gathered when no token is padded
    assert [n.op_type for n in graphs["compacted"].node].count("GatherND") == 4
    assert "GatherND" not in [n.op_type for n in graphs["full"].node]
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
