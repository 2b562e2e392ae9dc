"""fusion.rotary_gqa and fusion.qkv_packing: a rotary decoder's ragged file rotates inside GroupQueryAttention
(do_rotary, cos/sin tables evaluated from the module's own ops) and feeds it one packed q/k/v projection.

The hand-built graphs pin the op's positions (from seqlens_k) against the module's own rotary (from position_ids)
on the ragged contract's calls; the exported Hugging Face decoders pin whole generations against transformers'."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mha_deploy.exporters.fusion import qkv_packing, rotary_gqa
from mha_deploy.exporters.fusion.qkv_packing import pack_qkv
from mha_deploy.exporters.fusion.rotary_gqa import (
    fuse_into_gqa,
    fuse_into_gqa_checked,
    fuse_rotary_into_gqa,
    gqa_notes,
)
from mha_deploy.exporters.last_token_logits import PREFIX as LAST_TOKEN_PREFIX
from mha_deploy.metadata import ModelMetadata, ParityReport
from tests.conftest import user_module

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
MAX_LENGTH = 64
# fp32 GroupQueryAttention rotating inside vs the same op fed pre-rotated heads: the same products in another
# order (observed 1e-6).
ATOL = 1e-5


def _ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def _attribute(node: onnx.NodeProto, name: str, default=0):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


# --- a hand-built attention: the module's rotary around GroupQueryAttention, as ragged_cache leaves it ----------


def _contract_inputs(cache: list) -> list[onnx.ValueInfoProto]:
    """x, position_ids, the past key/value of dims ``cache`` and GroupQueryAttention's lengths: what the test
    graphs take on the ragged contract's calls."""
    return [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]


def _rotary_graph(cos_reads: str | None = None, round_trip: bool = False, head_dim: int = HEAD_DIM,
                  rotary_dim: int | None = None, interleaved: bool = False,
                  halves_tables: bool = False) -> onnx.ModelProto:
    """x [batch, seq, 64] -> q/k/v projections, heads split, q and k rotated (x * cos + rotate_half(x) * sin,
    cos/sin from position_ids), merged back -> GroupQueryAttention over a cache. ``cos_reads``: an input whose
    value also scales the angles (cos/sin then depend on more than positions). ``round_trip``: the op's output
    split into heads and merged back (as the module's graph around upstream's fusion leaves it), then projected.
    ``rotary_dim``: a partial rotary, as Phi-4-mini's and GPT-NeoX's: only each head's first ``rotary_dim`` dims
    rotated, Concat(rotated, x[..., rotary_dim:]) (None: the whole head). ``interleaved``: GLM's and GPT-J's pairs
    (2i, 2i + 1), as torch writes them: each angle repeated twice side by side (repeat_interleave), and
    rotate_half(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2); ``halves_tables``: those pairs rotated by
    tables laid out in halves nonetheless (no model's rotary: a negative case)."""
    rotary = rotary_dim or head_dim
    rng = np.random.default_rng(0)
    inits = [
        helper.make_tensor(name, TensorProto.FLOAT, array.shape, array.ravel())
        for name, array in (("wq", rng.standard_normal((HIDDEN, HEADS * head_dim)).astype(np.float32) * 0.3),
                            ("wk", rng.standard_normal((HIDDEN, KV_HEADS * head_dim)).astype(np.float32) * 0.3),
                            ("wv", rng.standard_normal((HIDDEN, KV_HEADS * head_dim)).astype(np.float32) * 0.3),
                            ("inv_freq", (1.0 / 100.0 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)))
    ]
    ints = {"q_split": [0, 0, HEADS, head_dim], "kv_split": [0, 0, KV_HEADS, head_dim],
            "q_merge": [0, 0, HEADS * head_dim], "kv_merge": [0, 0, KV_HEADS * head_dim], "zero": [0],
            "half": [rotary // 2], "end": [head_dim], "rotary": [rotary], "last": [3], "one": [1], "two": [2],
            "split": [0, 0, HEADS, -1], "same": [0, 0, 0, 0], "new_last": [-1], "step2": [2],
            "rows": [0, 0, rotary], "heads_rows": [0, 0, 0, rotary]}
    inits += [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in ints.items()]
    nodes = [
        helper.make_node("Cast", ["position_ids"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["posf", "two"], ["posf3"]),
        helper.make_node("Mul", ["posf3", "inv_freq"], ["freqs"]),
    ]
    angles = "freqs"
    if cos_reads:
        nodes.append(helper.make_node("Mul", ["freqs", cos_reads], ["freqs_scaled"]))
        angles = "freqs_scaled"
    if interleaved and not halves_tables:  # each angle twice, side by side: [b, s, r / 2, 2] flattened to [b, s, r]
        nodes += [helper.make_node("Unsqueeze", [angles, "new_last"], ["angles4"]),
                  helper.make_node("Concat", ["angles4", "angles4"], ["pairs"], axis=-1),
                  helper.make_node("Reshape", ["pairs", "rows"], ["emb"])]
    else:
        nodes.append(helper.make_node("Concat", [angles, angles], ["emb"], axis=-1))
    nodes += [
        helper.make_node("Cos", ["emb"], ["cos3"]), helper.make_node("Sin", ["emb"], ["sin3"]),
        helper.make_node("Unsqueeze", ["cos3", "one"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin3", "one"], ["sin"]),
    ]
    for role, split, merge in (("q", "q_split", "q_merge"), ("k", "kv_split", "kv_merge")):
        heads = f"{role}_h"
        nodes += [
            helper.make_node("MatMul", ["x", f"w{role}"], [f"{role}_proj"]),
            helper.make_node("Reshape", [f"{role}_proj", split], [f"{role}_bsnh"]),
            helper.make_node("Transpose", [f"{role}_bsnh"], [heads], perm=[0, 2, 1, 3]),
        ]
        if rotary_dim:  # the rotated part a Slice of the heads, the rest passed on by another
            nodes += [helper.make_node("Slice", [heads, "zero", "rotary", "last"], [f"{role}_r"]),
                      helper.make_node("Slice", [heads, "rotary", "end", "last"], [f"{role}_pass"])]
            heads = f"{role}_r"
        if interleaved:
            nodes += [
                helper.make_node("Slice", [heads, "one", "rotary", "last", "step2"], [f"{role}_odd"]),
                helper.make_node("Neg", [f"{role}_odd"], [f"{role}_neg"]),
                helper.make_node("Unsqueeze", [f"{role}_neg", "new_last"], [f"{role}_neg4"]),
                helper.make_node("Slice", [heads, "zero", "rotary", "last", "step2"], [f"{role}_even"]),
                helper.make_node("Unsqueeze", [f"{role}_even", "new_last"], [f"{role}_even4"]),
                helper.make_node("Concat", [f"{role}_neg4", f"{role}_even4"], [f"{role}_stack"], axis=-1),
                helper.make_node("Reshape", [f"{role}_stack", "heads_rows"], [f"{role}_half"]),
            ]
        else:
            nodes += [
                helper.make_node("Slice", [heads, "half", "rotary", "last"], [f"{role}_x2"]),
                helper.make_node("Neg", [f"{role}_x2"], [f"{role}_neg"]),
                helper.make_node("Slice", [heads, "zero", "half", "last"], [f"{role}_x1"]),
                helper.make_node("Concat", [f"{role}_neg", f"{role}_x1"], [f"{role}_half"], axis=-1),
            ]
        nodes += [
            helper.make_node("Mul", [heads, "cos"], [f"{role}_c"]),
            helper.make_node("Mul", ["sin", f"{role}_half"], [f"{role}_s"]),  # operands in either order
            helper.make_node("Add", [f"{role}_s", f"{role}_c"], [f"{role}_rot"]),
        ]
        if rotary_dim:
            nodes.append(helper.make_node("Concat", [f"{role}_rot", f"{role}_pass"], [f"{role}_full"], axis=-1))
        nodes += [
            helper.make_node("Transpose", [f"{role}_full" if rotary_dim else f"{role}_rot"], [f"{role}_back"],
                             perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{role}_back", merge], [f"{role}_in"]),
        ]
    nodes += [
        helper.make_node("MatMul", ["x", "wv"], ["v_in"]),
        helper.make_node("GroupQueryAttention", ["q_in", "k_in", "v_in", "past_key", "past_value", "seqlens_k",
                                                 "total_sequence_length"],
                         ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=HEADS,
                         kv_num_heads=KV_HEADS, name="attention"),
    ]
    value_info = []
    if round_trip:
        inits.append(helper.make_tensor("wo", TensorProto.FLOAT, [HIDDEN, HIDDEN],
                                        rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32).ravel() * 0.3))
        nodes += [
            helper.make_node("Reshape", ["out", "split"], ["o_split"]),
            helper.make_node("Transpose", ["o_split"], ["o_heads"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["o_heads", "same"], ["o_view"]),
            helper.make_node("Transpose", ["o_view"], ["o_back"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["o_back", "q_merge"], ["o_merged"]),
            helper.make_node("MatMul", ["o_merged", "wo"], ["y"]),
        ]
        # The module's shapes, as torch's export records them (the contrib op's output has none).
        value_info = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in (
            ("o_heads", ["batch", HEADS, "seq", HEAD_DIM]), ("o_view", ["batch", HEADS, "seq", HEAD_DIM]),
            ("o_back", ["batch", "seq", HEADS, HEAD_DIM]), ("o_merged", ["batch", "seq", HIDDEN]))]
    cache = ["batch", KV_HEADS, "past", head_dim]
    inputs = _contract_inputs(cache)
    if cos_reads:
        inputs.append(helper.make_tensor_value_info(cos_reads, TensorProto.FLOAT, [1]))
    outputs = [helper.make_tensor_value_info("y" if round_trip else "out", TensorProto.FLOAT,
                                             ["batch", "seq", HIDDEN]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache)]
    graph = helper.make_graph(nodes, "rotary", inputs, outputs, inits, value_info=value_info)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _contract_calls(session: ort.InferenceSession, rng, head_dim: int = HEAD_DIM) -> list[np.ndarray]:
    """The ragged contract's calls, each fed position_ids = n_r - seq + arange(seq): a first call of rows 7, 3
    and 5 tokens right-padded, three one-token steps of those rows; then batch 1: a first call of 4 tokens and a
    chunk of 5 more. Every output of every call (padded queries' rows dropped)."""
    results = []
    for first, steps in (((7, 3, 5), (1, 1, 1)), ((4,), (5,))):
        batch = len(first)
        n = np.zeros(batch, np.int64)
        past = [np.zeros((batch, KV_HEADS, 0, head_dim), np.float32)] * 2
        for call, real in enumerate([np.array(first), *(np.full(batch, seq) for seq in steps)]):
            seq = int(real.max())
            total = n + real
            feeds = {"x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
                     "position_ids": (n[:, None] + np.arange(seq)[None]).astype(np.int64),
                     "past_key": past[0], "past_value": past[1],
                     "seqlens_k": (total - 1).astype(np.int32),
                     # the mask's width: a first call's padded length, later the longest row's tokens so far
                     "total_sequence_length": np.array(seq if call == 0 else total.max(), np.int32)}
            out, key, value = session.run(None, feeds)
            results += [out[row, :count] for row, count in enumerate(real)]
            results += [key[row, :, :total[row]] for row in range(batch)]
            past, n = [key, value], total
    return results


def test_rotary_moves_into_group_query_attention_with_the_same_outputs_on_the_ragged_contracts_calls():
    """The op's rotary, at the positions it derives from seqlens_k, equals the module's at position_ids = n_r - seq +
    arange(seq): a right-padded first call, one-token steps of ragged rows, a chunk after a past (outputs and the
    rotated keys written to the cache, atol 1e-5); no Cos, Sin, Neg or Slice is left."""
    model = _rotary_graph()
    fused, report = fuse_rotary_into_gqa(model, MAX_LENGTH)
    assert (report.done, report.refused) == (1, [])
    attention = next(node for node in fused.graph.node if node.op_type == "GroupQueryAttention")
    assert _attribute(attention, "do_rotary") == 1 and _attribute(attention, "rotary_interleaved") == 0
    assert not {"Cos", "Sin", "Neg", "Slice", "Transpose", "Reshape"} & set(_ops(fused))
    expected = _contract_calls(_session(model), np.random.default_rng(1))
    got = _contract_calls(_session(fused), np.random.default_rng(1))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


def test_a_partial_rotary_moves_into_the_op_with_tables_as_wide_as_half_its_rotated_dims():
    """Phi-4-mini's and GPT-NeoX's form: only each head's first 16 of 32 dims rotated, the rest concatenated after
    as they were. The op's cos/sin caches are [max length, 8] (half the rotated dims: ONNX Runtime rotates the
    first 2 x their width of each head and passes the rest through); the same outputs and cached keys on the
    ragged contract's calls (atol 1e-5), no Cos, Sin, Neg, Slice or Concat left."""
    model = _rotary_graph(head_dim=32, rotary_dim=16)
    fused, report = fuse_rotary_into_gqa(model, MAX_LENGTH)
    assert (report.done, report.refused) == (1, [])
    attention = next(node for node in fused.graph.node if node.op_type == "GroupQueryAttention")
    assert _attribute(attention, "do_rotary") == 1 and _attribute(attention, "rotary_interleaved") == 0
    tables = {init.name: list(init.dims) for init in fused.graph.initializer}
    assert [tables[name] for name in attention.input[7:9]] == [[MAX_LENGTH, 8]] * 2
    assert not {"Cos", "Sin", "Neg", "Slice", "Concat"} & set(_ops(fused))
    expected = _contract_calls(_session(model), np.random.default_rng(6), head_dim=32)
    got = _contract_calls(_session(fused), np.random.default_rng(6), head_dim=32)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("rotary_dim", [None, 16], ids=["whole-head", "partial"])
def test_an_interleaved_rotary_moves_into_the_op_as_rotary_interleaved(rotary_dim):
    """GLM's form (GPT-J's too): pairs (2i, 2i + 1) rotated, over the whole head of 32 or its first 16 dims:
    rotary_interleaved=1 and cos/sin caches one column per pair ([max length, 16] or [max length, 8]); the same
    outputs and cached keys on the ragged contract's calls (atol 1e-5), no Cos, Sin or Neg left."""
    model = _rotary_graph(head_dim=32, rotary_dim=rotary_dim, interleaved=True)
    fused, report = fuse_rotary_into_gqa(model, MAX_LENGTH)
    assert (report.done, report.refused) == (1, [])
    attention = next(node for node in fused.graph.node if node.op_type == "GroupQueryAttention")
    assert _attribute(attention, "do_rotary") == 1 and _attribute(attention, "rotary_interleaved") == 1
    tables = {init.name: list(init.dims) for init in fused.graph.initializer}
    assert [tables[name] for name in attention.input[7:9]] == [[MAX_LENGTH, (rotary_dim or 32) // 2]] * 2
    assert not {"Cos", "Sin", "Neg"} & set(_ops(fused))
    expected = _contract_calls(_session(model), np.random.default_rng(7), head_dim=32)
    got = _contract_calls(_session(fused), np.random.default_rng(7), head_dim=32)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


def test_interleaved_pairs_rotated_by_a_halves_table_keep_the_modules_rotary():
    """Pairs (2i, 2i + 1) rotated with tables laid out in halves (Concat(freqs, freqs)): a rotary the op does not
    compute (pair i would take angle 2i mod d/2, not i); its tables' even and odd columns differ, so the attention
    keeps the module's ops and the line says why."""
    model = _rotary_graph(head_dim=32, interleaved=True, halves_tables=True)
    fused, report = fuse_rotary_into_gqa(model, MAX_LENGTH)
    assert fused is model and report.done == 0
    assert len(report.refused) == 1 and "even and odd columns differ" in report.refused[0]


def test_a_partial_rotary_the_op_cannot_take_keeps_the_modules_rotary_and_says_why():
    """8 of 16 dims rotated: the op's rotary takes multiples of 16 (its cos/sin caches' width a multiple of 8,
    ONNX Runtime's check), so the attention keeps the module's ops, and the line says so."""
    model = _rotary_graph(rotary_dim=8)
    fused, report = fuse_rotary_into_gqa(model, MAX_LENGTH)
    assert fused is model and report.done == 0
    assert len(report.refused) == 1 and "rotates 8 dims of each head (partial)" in report.refused[0]
    assert "multiples of 16" in report.refused[0]


def test_packing_gives_one_projection_and_the_same_outputs():
    """After the rotary moved in, q/k/v are three MatMuls of x: one MatMul with the weights side by side feeds the
    op's packed query, key and value inputs empty; same outputs (atol 1e-5)."""
    model, _ = fuse_rotary_into_gqa(_rotary_graph(), MAX_LENGTH)
    packed, report = pack_qkv(model)
    assert (report.done, report.refused) == (1, [])
    assert _ops(packed).count("MatMul") == 1
    attention = next(node for node in packed.graph.node if node.op_type == "GroupQueryAttention")
    assert list(attention.input[1:3]) == ["", ""]
    expected = _contract_calls(_session(model), np.random.default_rng(2))
    got = _contract_calls(_session(packed), np.random.default_rng(2))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


def _projected_attention_model(name: str, nodes: list, inits: list, qkv: list[str], heads: int,
                               extra_outputs: tuple = ()) -> onnx.ModelProto:
    """``nodes`` (computing the op's query, key and value ``qkv`` from x) then GroupQueryAttention at ``heads`` over
    KV_HEADS, the ragged contract's cache and lengths as inputs; shapes inferred, as torch's export records them."""
    nodes = [*nodes, helper.make_node("GroupQueryAttention", [*qkv, "past_key", "past_value", "seqlens_k",
                                                              "total_sequence_length"],
                                      ["out", "present_key", "present_value"], domain="com.microsoft",
                                      num_heads=heads, kv_num_heads=KV_HEADS, name="attention")]
    cache = ["batch", KV_HEADS, "past", HEAD_DIM]
    inputs = _contract_inputs(cache)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", heads * HEAD_DIM]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache), *extra_outputs]
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _per_head_graph(also_read: bool = False) -> onnx.ModelProto:
    """GPT-NeoX's q/k/v as its export leaves them around GroupQueryAttention: one projection of x (+ a bias),
    [batch, seq, 2 * 3 * 16], viewed as [batch, seq, 2 heads, q k v of 16 side by side], transposed heads first,
    split in three on the last axis, each transposed back and merged to [batch, seq, 32]; the op at 2 heads, each
    its own key/value head. ``also_read``: the projection is an output too (read at every position)."""
    rng = np.random.default_rng(5)
    width = 3 * KV_HEADS * HEAD_DIM
    arrays = {"w": rng.standard_normal((HIDDEN, width)).astype(np.float32) * 0.3,
              "b": rng.standard_normal(width).astype(np.float32)}
    inits = [helper.make_tensor(name, TensorProto.FLOAT, array.shape, array.ravel()) for name, array in arrays.items()]
    for name, values in (("view", [0, 0, KV_HEADS, 3 * HEAD_DIM]), ("merge", [0, 0, KV_HEADS * HEAD_DIM])):
        inits.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["proj"]),
             helper.make_node("Add", ["proj", "b"], ["linear"]),
             helper.make_node("Reshape", ["linear", "view"], ["viewed"]),
             helper.make_node("Transpose", ["viewed"], ["heads"], perm=[0, 2, 1, 3]),
             helper.make_node("Split", ["heads"], ["q_h", "k_h", "v_h"], axis=3, num_outputs=3)]
    for role in "qkv":
        nodes += [helper.make_node("Transpose", [f"{role}_h"], [f"{role}_back"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"{role}_back", "merge"], [f"{role}_in"])]
    extra = (helper.make_tensor_value_info("linear", TensorProto.FLOAT, ["batch", "seq", width]),) if also_read else ()
    # the view's [batch, seq, 2, 48] inferred, as torch's export records it
    return _projected_attention_model("per_head", nodes, inits, ["q_in", "k_in", "v_in"], KV_HEADS, extra)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int4"])
def test_a_projection_laid_out_per_head_packs_with_its_columns_reordered(quantized):
    """GPT-NeoX's one projection, q, k and v of each head side by side: its weight columns (int4: its rows of blocks,
    scales and zero points) and bias reordered into [q heads | k heads | v heads] feed the op's packed query, the
    view, split and merges gone; the same outputs over the ragged contract's calls (atol 1e-6; observed equal: each
    column is the same product). Read at every position too, the projection is left as it was, saying why."""
    from mha_deploy.exporters.quantize import Quantization

    model = _per_head_graph()
    if quantized:
        model = Quantization.of("int4").apply(model)
    packed, report = pack_qkv(model)
    assert (report.done, report.refused) == (1, [])
    assert {"Split", "Transpose", "Reshape"}.isdisjoint(_ops(packed))
    attention = next(node for node in packed.graph.node if node.op_type == "GroupQueryAttention")
    assert list(attention.input[1:3]) == ["", ""]
    expected = _contract_calls(_session(model), np.random.default_rng(6))
    got = _contract_calls(_session(packed), np.random.default_rng(6))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=1e-6)
    kept, refused = pack_qkv(_per_head_graph(also_read=True))
    assert refused.done == 0 and "is not a projection" in refused.refused[0]
    assert _ops(kept).count("Split") == 1


def test_the_ops_output_split_into_heads_and_merged_back_is_the_ops_output():
    """Reshape to heads, Transpose, a Reshape to the same shape, Transpose back, Reshape to [batch, seq, hidden]:
    removed, the output projection reads the op's output; same outputs (atol 1e-5)."""
    model = _rotary_graph(round_trip=True)
    fused, reports = fuse_into_gqa(model, MAX_LENGTH)
    assert [(report.done, report.refused) for report in reports] == [(1, [])] * 3 and gqa_notes(reports) == []
    assert _ops(fused).count("Reshape") == 0 and _ops(fused).count("Transpose") == 0
    attention = next(node for node in fused.graph.node if node.op_type == "GroupQueryAttention")
    projection = next(node for node in fused.graph.node if node.output[0] == "y")
    assert projection.input[0] == attention.output[0]
    expected = _contract_calls(_session(model), np.random.default_rng(4))
    got = _contract_calls(_session(fused), np.random.default_rng(4))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


def test_cos_sin_reading_more_than_positions_keep_the_modules_rotary_and_say_why():
    """Angles scaled by another input: the tables cannot be evaluated from positions alone; the graph is returned
    as it was, the reason naming the input, and nothing is packed (the query is still rotated outside)."""
    model = _rotary_graph(cos_reads="temperature")
    fused, reports = fuse_into_gqa(model, MAX_LENGTH)
    assert fused is model
    notes = gqa_notes(reports)
    assert len(notes) == 2
    assert "rotary in the op (do_rotary): 0 of 1 GroupQueryAttention" in notes[0] and "temperature" in notes[0]
    assert "q/k/v packed into one MatMul: 0 of 1 GroupQueryAttention; left as it was" in notes[1]


def test_no_max_length_keeps_the_modules_rotary():
    """The op's tables need the longest sequence the file takes: without one nothing is fused, and it says so."""
    model = _rotary_graph()
    fused, report = fuse_rotary_into_gqa(model, None)
    assert fused is model and "max length" in report.refused[0]


def _shifted_tables(monkeypatch) -> None:
    """A broken rotary pass: its cos/sin tables one position late (each half still equal, so nothing refuses)."""
    read = rotary_gqa._Tables.read
    monkeypatch.setattr(rotary_gqa._Tables, "read",
                        lambda self, rotated: tuple(np.roll(table, 1, axis=0) for table in read(self, rotated)))


def _key_and_value_swapped(monkeypatch) -> None:
    """A broken packing pass: the key's and the value's weights packed in each other's place."""
    projections = qkv_packing._projections
    monkeypatch.setattr(qkv_packing, "_projections",
                        lambda node: (lambda found: [found[0], found[2], found[1]])(projections(node)))


@pytest.mark.parametrize(("breaks", "left_out", "kept"), [
    (_shifted_tables, "rotary in the op (do_rotary): the file failed parity with it",
     "; nor q/k/v packed into one MatMul, which then applied to no attention"),
    (_key_and_value_swapped, "q/k/v packed into one MatMul: the file failed parity with it", ""),
], ids=["rotary", "packing"])
def test_a_pass_that_breaks_parity_is_left_out_and_the_others_kept(monkeypatch, breaks, left_out, kept):
    """fuse_into_gqa_checked with one pass broken: the file with every pass fails the check (outputs of the
    ragged contract's calls against the file before the passes, atol 1e-5), the file without any passes it; each
    pass is then added back in order and kept where the check still passes: the broken one is left out (the
    packing, which needs the rotary inside the op, with it), the rest kept, and one note names what was left out.
    Four checks with the rotary broken (all, none, + rotary, + round trips), five with the packing."""
    model = _rotary_graph(round_trip=True)
    expected = _contract_calls(_session(model), np.random.default_rng(5))
    checked = []

    def check(candidate: onnx.ModelProto) -> ParityReport:
        got = _contract_calls(_session(candidate), np.random.default_rng(5))
        error = max(float(np.abs(have - want).max()) for want, have in zip(expected, got, strict=True))
        checked.append(error <= ATOL)
        return ParityReport(passed=error <= ATOL, atol=ATOL, rtol=0.0, max_abs_err=error, required_atol=error,
                            required_rtol=0.0, failures=[] if error <= ATOL else [f"max abs err {error:.3g}"])

    breaks(monkeypatch)
    fused, report, notes = fuse_into_gqa_checked(model, MAX_LENGTH, check)
    assert report.passed and checked[:2] == [False, True] and len(checked) == (4 if kept else 5)
    assert len(notes) == 1 and notes[0].startswith(f"ragged layout without {left_out} (max abs err ")
    assert notes[0].endswith(f"){kept}")
    attention = next(node for node in fused.graph.node if node.op_type == "GroupQueryAttention")
    rotated = breaks is _key_and_value_swapped
    assert _attribute(attention, "do_rotary") == rotated and list(attention.input[1:3]) != ["", ""]
    assert ("Cos" in _ops(fused)) != rotated
    projection = next(node for node in fused.graph.node if node.output[0] == "y")
    assert projection.input[0] == attention.output[0]  # the round trip, removed either way


def test_a_ragged_file_that_fails_without_any_pass_is_returned_as_it_is():
    """The ragged rewrite itself wrong (the check fails whatever): two checks, the file without the passes and its
    failed report returned, no note (the caller keeps the holes layout and says why)."""
    model = _rotary_graph()
    failed = ParityReport(passed=False, atol=ATOL, rtol=0.0, max_abs_err=1.0, required_atol=1.0, required_rtol=0.0,
                          failures=["wrong"])
    checked = []
    fused, report, notes = fuse_into_gqa_checked(model, MAX_LENGTH, lambda candidate: checked.append(candidate)
                                                 or failed)
    assert (fused, report, notes) == (model, failed, []) and len(checked) == 2 and checked[1] is model


# --- exported Hugging Face decoders ------------------------------------------------------------------------------


def test_the_tiny_llamas_default_file_rotates_in_the_op_and_packs_qkv(lm_cache):
    """hf_llama's default --kv-cache file: each layer one GroupQueryAttention with do_rotary, fed one packed MatMul
    (key and value empty); no Cos, Sin or Neg left; 5 MatMuls a layer (qkv, o, gate, up, down) + the LM head."""
    llama = user_module("hf_llama")
    path, output = lm_cache("hf_llama")
    model = onnx.load(path)
    assert ModelMetadata.from_props({p.key: p.value for p in model.metadata_props}).cache_layout == "ragged"
    attentions = [node for node in model.graph.node if node.op_type == "GroupQueryAttention"]
    assert len(attentions) == llama.LAYERS
    assert all(_attribute(node, "do_rotary") == 1 for node in attentions)
    assert all(list(node.input[1:3]) == ["", ""] for node in attentions)
    ops = _ops(model)
    # (the last-token logits pass negates the call's length to slice the mask's last columns: not a rotary's Neg)
    assert not {"Cos", "Sin", "Neg"} & {node.op_type for node in model.graph.node
                                        if not node.name.startswith(LAST_TOKEN_PREFIX)}
    assert ops.count("MatMul") == 5 * llama.LAYERS + 1
    assert "rotary in the op" not in output  # nothing refused: no note


def test_quantized_projections_pack_into_one_matmulnbits_with_the_same_outputs():
    """--quantize int4 quantizes before the ragged rewrite: the three MatMulNBits (blocks along K, a row of blocks
    per output column) stack into one of N = 128, the same numbers (atol 1e-5: the same blocks, scales and zero
    points, each activation block quantized the same)."""
    from mha_deploy.exporters.quantize import Quantization

    quantized = Quantization.of("int4").apply(_rotary_graph())
    fused, reports = fuse_into_gqa(quantized, MAX_LENGTH)
    assert gqa_notes(reports) == []
    nbits = [node for node in fused.graph.node if node.op_type == "MatMulNBits"]
    assert len(nbits) == 1 and _attribute(nbits[0], "N") == (HEADS + 2 * KV_HEADS) * HEAD_DIM
    expected = _contract_calls(_session(quantized), np.random.default_rng(3))
    got = _contract_calls(_session(fused), np.random.default_rng(3))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=ATOL)


def test_onnxruntime_genai_generates_our_tokens_from_the_rotary_packed_file(lm_cache, tmp_path):
    """onnxruntime-genai (an oracle written elsewhere, .venv-genai) runs the tiny Llama's default file as it is
    (GroupQueryAttention rotating from its tables, packed q/k/v, position_ids fed but read by no node): its greedy
    tokens for two right-padded prompts of different lengths equal ours (12 each)."""
    import shutil

    from mha_deploy.bench.genai import genai_python, run_genai_greedy
    from mha_deploy.runtime.genai_config import write_genai_config
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    if genai_python() is None:
        pytest.skip("no .venv-genai: scripts/setup.sh installs onnxruntime-genai there")
    source, _ = lm_cache("hf_llama")
    path = tmp_path / "model.onnx"
    shutil.copy(source, path)
    write_genai_config(path)
    prompts = [[15, 27, 9, 41, 33, 8], [44, 12]]  # neither reaches eos within 12 tokens (asserted)
    width, new = 6, 12
    ids = np.array([p + [0] * (width - len(p)) for p in prompts], np.int64)
    mask = (np.arange(width) < np.array([[len(p)] for p in prompts])).astype(np.int64)
    ours = generate(KVCacheStepper(path), ids, mask, max_new_tokens=new).tokens
    theirs = run_genai_greedy(tmp_path, ids.tolist(), width + new).new_tokens(width)
    for row, (mine, genai) in enumerate(zip(ours, theirs, strict=True)):
        mine = mine.tolist()
        assert len(mine) == new, f"row {row} ended at eos: choose prompts that do not"
        assert genai == mine, f"row {row}: onnxruntime-genai {genai}, ours {mine}"


def _sliced_graph(cut: str = "slice", bias: bool = False, order: str = "qkv") -> onnx.ModelProto:
    """Phi-3's q/k/v as its export leaves them around GroupQueryAttention: one projection of x (+ a bias) laid out
    [q heads | k heads | v heads], [batch, seq, (4 + 2 + 2) * 16], cut on its last axis into q [0, 64), k [64, 96),
    v [96, end) by three Slices (as torch writes them: axis 2, the last one ending at INT64_MAX) or one Split of
    sizes 64, 32, 32; the op at 4 heads over 2 key/value heads. ``order``: which part each of the op's query, key and
    value inputs reads ("kqv": the query reads the key's columns and the key the query's, a negative case)."""
    rng = np.random.default_rng(8)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    width = q + 2 * kv
    arrays = {"w": rng.standard_normal((HIDDEN, width)).astype(np.float32) * 0.3}
    if bias:
        arrays["b"] = rng.standard_normal(width).astype(np.float32)
    inits = [helper.make_tensor(name, TensorProto.FLOAT, array.shape, array.ravel()) for name, array in arrays.items()]
    bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, np.iinfo(np.int64).max)}
    ints = {"axis": [2], "step": [1], "sizes": [q, kv, kv], **{f"{part}_start": [bounds[part][0]] for part in "qkv"},
            **{f"{part}_end": [bounds[part][1]] for part in "qkv"}}
    inits += [helper.make_tensor(name, TensorProto.INT64, [len(v)], v) for name, v in ints.items()]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["proj"])]
    if bias:
        nodes.append(helper.make_node("Add", ["proj", "b"], ["linear"]))
    linear = "linear" if bias else "proj"
    if cut == "split":
        nodes.append(helper.make_node("Split", [linear, "sizes"], ["q", "k", "v"], axis=-1))
    else:
        nodes += [helper.make_node("Slice", [linear, f"{part}_start", f"{part}_end", "axis", "step"], [part])
                  for part in "qkv"]
    # the projection's [batch, seq, 128] inferred, as torch's export records it
    return _projected_attention_model("sliced", nodes, inits, list(order), HEADS)


@pytest.mark.parametrize(("cut", "bias", "quantized"), [("slice", True, False), ("split", False, False),
                                                         ("slice", True, True)],
                         ids=["slices-bias-fp32", "split-fp32", "slices-bias-int4"])
def test_a_projection_laid_out_q_k_v_and_cut_in_the_graph_is_the_ops_packed_query_as_it_is(cut, bias, quantized):
    """Phi-3's qkv_proj, [q heads | k heads | v heads] cut into q, k and v (three Slices or one Split): the op reads
    the projection (its MatMul or MatMulNBits, + the bias) whole as its packed query, key and value empty, the cuts
    gone and no weight added or changed; the same outputs over the ragged contract's calls (atol 1e-6; observed
    equal: the op reads the same columns). Cut in another order, it is left as it was, saying why."""
    from mha_deploy.exporters.quantize import Quantization

    model = _sliced_graph(cut, bias)
    if quantized:
        model = Quantization.of("int4").apply(model)
    packed, report = pack_qkv(model)
    assert (report.done, report.refused) == (1, [])
    assert {"Slice", "Split"}.isdisjoint(_ops(packed))
    projection = next(node for node in packed.graph.node if node.op_type in ("MatMul", "MatMulNBits"))
    attention = next(node for node in packed.graph.node if node.op_type == "GroupQueryAttention")
    bias_add = next((node for node in packed.graph.node if node.op_type == "Add"), None)
    assert list(attention.input[:3]) == [bias_add.output[0] if bias else projection.output[0], "", ""]
    weights = {init.name: onnx.numpy_helper.to_array(init) for init in model.graph.initializer}
    kept = {init.name: onnx.numpy_helper.to_array(init) for init in packed.graph.initializer}
    assert set(kept) <= set(weights) and all(np.array_equal(kept[name], weights[name]) for name in kept)
    expected = _contract_calls(_session(model), np.random.default_rng(9))
    got = _contract_calls(_session(packed), np.random.default_rng(9))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=0, atol=1e-6)
    swapped = _sliced_graph(cut, bias, order="kqv")
    kept_model, refused = pack_qkv(swapped)
    assert kept_model is swapped and refused.done == 0
    assert "not [q | k | v] of 4 and 2 heads" in refused.refused[0]
