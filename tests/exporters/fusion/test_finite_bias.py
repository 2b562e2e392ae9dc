"""finite_bias: a contrib attention op's float attention_bias bounded below, so that a query row with no visible
key is finite; and what ORT 1.31's CPU kernels return on such a row, pinned (the fills the fusion emits rely on
it)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from mha_deploy.exporters.fusion.finite_bias import fuse_finite_bias
from mha_deploy.exporters.fusion.mask_analysis import finite_fill
from tests.exporters.fusion import hand_graphs as hg

BATCH, SEQ, HIDDEN, HEADS = 2, 4, 16, 2  # head size 8: GroupQueryAttention's CPU kernel needs a multiple of 8
LOWEST = float(np.finfo(np.float32).min)
# Batch row 1, query rows 0 and 1 see no key.
HIDDEN_ROWS = ((1, 0), (1, 1))


def _pass(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    ir_model = ir.serde.deserialize_model(model)
    count = fuse_finite_bias(ir_model)
    return ir.serde.serialize_model(ir_model), count


def _qkv(seed=0) -> dict[str, np.ndarray]:
    return {name: hg.normal((BATCH, SEQ, HIDDEN), seed + i) for i, name in enumerate(("query", "key", "value"))}


def _bias(fill: float) -> np.ndarray:
    bias = np.zeros((BATCH, 1, SEQ, SEQ), np.float32)
    bias[1, 0, :, :2] = fill  # keys 0, 1 of batch row 1 hidden
    bias[1, 0, :2, :] = fill  # so are every key of its query rows 0, 1
    return bias


def test_bias_is_bounded_so_a_row_with_no_visible_key_is_finite():
    model = hg.contrib_mha(BATCH, SEQ, SEQ, HIDDEN, HEADS, attention_bias=True)
    feeds = {**_qkv(), "attention_bias": _bias(-np.inf)}
    (before,) = hg.run(model, feeds).values()
    assert all(np.isnan(before[row]).all() for row in HIDDEN_ROWS)  # why the pass exists
    bounded, count = _pass(model)
    assert count == 1 and "Max" in hg.op_types(bounded)
    (after,) = hg.run(bounded, feeds).values()
    assert np.isfinite(after).all()
    visible = np.ones((BATCH, SEQ), bool)
    visible[1, :2] = False
    np.testing.assert_array_equal(after[visible], before[visible])  # exp(fill - max) underflows to 0 either way


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no-bias", "bounded-already"])
def test_leaves_alone(attention_bias):
    model = hg.contrib_mha(BATCH, SEQ, SEQ, HIDDEN, HEADS, padding=True, attention_bias=attention_bias)
    if attention_bias:
        model, _ = _pass(model)
    _, count = _pass(model)
    assert count == 0


def test_finite_fill_bounds_what_is_below_half_the_lowest_value():
    assert finite_fill(-np.inf, np.float32) == LOWEST / 2
    assert finite_fill(-1e9, np.float32) == -1e9
    assert finite_fill(-np.inf, np.float16) == float(np.finfo(np.float16).min) / 2


def _op(op_type: str, inputs: list[str], domain="com.microsoft", **attributes) -> onnx.ModelProto:
    g = hg.Graph()
    for name in ("query", "key", "value"):
        g.input(name, np.float32, [BATCH, SEQ, HIDDEN])
    names = {"pad": (np.int32, [BATCH, SEQ]), "bias": (np.float32, [BATCH, 1, SEQ, SEQ]),
             "bool_mask": (bool, [BATCH, 1, SEQ, SEQ]), "seqlens_k": (np.int32, [BATCH]), "total": (np.int32, [])}
    for name in inputs:
        if name in names:
            g.input(name, *names[name])
    outputs = g.op(op_type, *inputs, domain=domain, outputs=3 if op_type == "GroupQueryAttention" else 1,
                   **attributes)
    g.output(outputs[0] if isinstance(outputs, list) else outputs)
    return g.model()


def _row_kind(output: np.ndarray, value: np.ndarray, row: tuple[int, int]) -> str:
    got = output[row]
    if np.isnan(got).any():
        return "nan"
    if np.allclose(got, 0):
        return "zeros"
    return "mean of values" if np.allclose(got, value[row[0]].mean(0), atol=1e-5) else "finite"


QKV = ["query", "key", "value"]
# What each kernel the fusion emits returns on a query row with no visible key, measured (docs/export.md's table).
# Every fill the fusion writes is finite_fill's or one a finite row comes out of; -inf (torch's and the reference
# form's fill) gives NaN on contrib MultiHeadAttention's key_padding_mask and attention_bias.
KERNELS = {
    "mha-key-padding-inf": (lambda: _op("MultiHeadAttention", [*QKV, "", "pad"], num_heads=HEADS,
                                        mask_filter_value=-np.inf), "pad-all", "nan"),
    "mha-key-padding-finite": (lambda: _op("MultiHeadAttention", [*QKV, "", "pad"], num_heads=HEADS,
                                           mask_filter_value=LOWEST / 2), "pad-all", "mean of values"),
    "mha-key-padding-causal-inf": (lambda: _op("MultiHeadAttention", [*QKV, "", "pad"], num_heads=HEADS,
                                               mask_filter_value=-np.inf, unidirectional=1), "pad-left", "finite"),
    "mha-key-padding-causal-finite": (lambda: _op("MultiHeadAttention", [*QKV, "", "pad"], num_heads=HEADS,
                                                  mask_filter_value=LOWEST / 2, unidirectional=1), "pad-left",
                                      "finite"),
    "mha-attention-bias-inf": (lambda: _op("MultiHeadAttention", [*QKV, "", "", "bias"], num_heads=HEADS),
                               "bias-inf", "nan"),
    "mha-attention-bias-finite": (lambda: _op("MultiHeadAttention", [*QKV, "", "", "bias"], num_heads=HEADS),
                                  "bias-finite", "mean of values"),
    "onnx-attention-bool": (lambda: _op("Attention", [*QKV, "bool_mask"], domain="", q_num_heads=HEADS,
                                        kv_num_heads=HEADS), "bool", "zeros"),
    "onnx-attention-float-inf": (lambda: _op("Attention", [*QKV, "bias"], domain="", q_num_heads=HEADS,
                                             kv_num_heads=HEADS), "bias-inf", "zeros"),
    "onnx-attention-float-finite": (lambda: _op("Attention", [*QKV, "bias"], domain="", q_num_heads=HEADS,
                                                kv_num_heads=HEADS), "bias-finite", "mean of values"),
    "onnx-attention-causal-float-inf": (lambda: _op("Attention", [*QKV, "bias"], domain="", q_num_heads=HEADS,
                                                    kv_num_heads=HEADS, is_causal=1), "bias-inf", "zeros"),
    "onnx-attention-causal-float-finite": (lambda: _op("Attention", [*QKV, "bias"], domain="", q_num_heads=HEADS,
                                                       kv_num_heads=HEADS, is_causal=1), "bias-finite", "finite"),
    # Padded query rows past a row's length (seqlens_k): causal_gqa compacts real tokens to the front, so
    # these are the only rows with padding there.
    "gqa-padded-queries": (lambda: _op("GroupQueryAttention", [*QKV, "", "", "seqlens_k", "total"],
                                       num_heads=HEADS, kv_num_heads=HEADS), "lengths", "finite"),
}


def _kernel_feeds(masks: str) -> tuple[dict, tuple]:
    feeds = _qkv(3)
    rows = HIDDEN_ROWS
    if masks == "pad-all":
        feeds["pad"] = np.array([[1] * SEQ, [0] * SEQ], np.int32)
    elif masks == "pad-left":  # under the causal flag, queries 0, 1 of batch row 1 see no key
        feeds["pad"] = np.array([[1] * SEQ, [0, 0, 1, 1]], np.int32)
    elif masks.startswith("bias"):
        feeds["bias"] = _bias(-np.inf if masks == "bias-inf" else LOWEST / 2)
    elif masks == "bool":
        feeds["bool_mask"] = ~np.isinf(_bias(-np.inf))
    else:  # batch row 1 holds 2 real tokens: queries 2, 3 are padding
        feeds["seqlens_k"], feeds["total"] = np.array([SEQ - 1, 1], np.int32), np.array(SEQ, np.int32)
        rows = ((1, 2), (1, 3))
    return feeds, rows


@pytest.mark.parametrize("name", list(KERNELS))
def test_ort_kernels_on_a_row_with_no_visible_key(name):
    build, masks, kind = KERNELS[name]
    feeds, rows = _kernel_feeds(masks)
    (output,) = hg.run(build(), feeds).values()
    value = feeds["value"]
    assert [_row_kind(output, value, row) for row in rows] == [kind] * len(rows)
