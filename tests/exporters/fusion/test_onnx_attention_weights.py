"""onnx_attention_weights: reference MHA that returns its probabilities -> ``Attention`` with ``qk_matmul_output``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mha_deploy.exporters.fusion.onnx_attention_weights import onnx_attention_weights_rules
from tests.exporters.fusion import hand_graphs as hg

BATCH, SEQ, KV_LEN, D_MODEL, HEADS = 2, 3, 5, 8, 2
HEAD_SIZE = D_MODEL // HEADS


def _attention_with_weights(mask="none", *, kv_len=KV_LEN, scaling="Div", factor=None, axis=-1, v_width=D_MODEL):
    """The core of the exported reference MHA over projected q/k/v [batch, seq, d_model], returning
    ``output`` [batch, q_len, d_model] and ``weights`` [batch, heads, q_len, kv_len]."""
    g = hg.Graph()
    query = g.input("query", np.float32, [BATCH, SEQ, D_MODEL])
    key = g.input("key", np.float32, [BATCH, kv_len, D_MODEL])
    value = g.input("value", np.float32, [BATCH, kv_len, v_width])

    def heads(x, width, perm):  # [batch, seq, width] -> [batch, heads, ...] per perm
        return g.op("Transpose", g.op("Reshape", x, g.const([0, -1, HEADS, width // HEADS], np.int64)), perm=perm)

    scores = g.op("MatMul", heads(query, D_MODEL, [0, 2, 1, 3]), heads(key, D_MODEL, [0, 2, 3, 1]))
    if scaling == "input":
        scale = g.input("scale", np.float32, [])
        scaling = "Div"
    else:
        default = math.sqrt(HEAD_SIZE) if scaling == "Div" else 1 / math.sqrt(HEAD_SIZE)
        scale = g.const(factor if factor is not None else default)
    scores = g.op(scaling, scores, scale)
    if mask == "padding":
        scores = g.op("Add", scores, hg.mask_bias(g, hg.key_padding_mask(g, BATCH, kv_len)))
    elif mask == "padding-causal":
        both = g.op("And", hg.key_padding_mask(g, BATCH, kv_len), hg.causal_mask(g, SEQ))
        scores = g.op("Add", scores, hg.mask_bias(g, both))
    elif mask == "bias":
        scores = g.op("Add", scores, g.input("bias", np.float32, [BATCH, 1, SEQ, kv_len]))
    weights = g.op("Softmax", scores, axis=axis)
    context = g.op("MatMul", weights, heads(value, v_width, [0, 2, 1, 3]))
    output = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), g.const([0, -1, v_width], np.int64))
    g.output(output)
    g.output(weights)
    return g.model()


def _feeds(model, kv_len):
    feeds = {
        "query": hg.normal((BATCH, SEQ, D_MODEL), 1),
        "key": hg.normal((BATCH, kv_len, D_MODEL), 2),
        "value": hg.normal((BATCH, kv_len, D_MODEL), 3),
        "key_padding_mask": hg.padding_feeds(BATCH, kv_len),
    }
    names = {i.name for i in model.graph.input}
    return {name: array for name, array in feeds.items() if name in names}


@pytest.mark.parametrize(
    ("mask", "kv_len", "scaling", "factor", "expected"),
    [
        ("none", KV_LEN, "Div", None, {}),
        ("none", KV_LEN, "Mul", None, {}),
        ("none", KV_LEN, "Mul", 0.3, {"scale": 0.3}),
        ("none", KV_LEN, "Div", 2.5, {"scale": 0.4}),
        ("padding", KV_LEN, "Div", None, {"attn_mask": True}),
        ("padding-causal", SEQ, "Div", None, {"attn_mask": True, "is_causal": 1}),
    ],
    ids=["unmasked", "mul-default", "mul-0.3", "div-2.5", "padding", "padding-causal"],
)
def test_becomes_one_attention_with_weights_output(mask, kv_len, scaling, factor, expected):
    model = _attention_with_weights(mask, kv_len=kv_len, scaling=scaling, factor=factor)
    rewritten, count = hg.rewrite(model, onnx_attention_weights_rules)
    assert count == 1
    assert [t for t in hg.op_types(rewritten) if t in ("Attention", "Softmax", "MatMul")] == ["Attention"]
    op = hg.node(rewritten, "Attention")
    attrs = hg.attributes(op)
    assert (attrs["q_num_heads"], attrs["kv_num_heads"], attrs["qk_matmul_output_mode"]) == (HEADS, HEADS, 3)
    assert attrs.get("is_causal", 0) == expected.get("is_causal", 0)
    if "scale" in expected:
        assert attrs["scale"] == pytest.approx(expected["scale"])
    else:  # the default 1/sqrt(head_size)
        assert "scale" not in attrs
    assert (len(op.input) > 3) == expected.get("attn_mask", False)
    # The model's outputs are the op's output and its after-softmax scores.
    assert [o.name for o in rewritten.graph.output] == [op.output[0], op.output[3]]
    hg.assert_same_outputs(model, rewritten, _feeds(model, kv_len))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_attention_with_weights(scaling="input"), "scale is not a constant", id="scale-is-an-input"),
        pytest.param(_attention_with_weights("bias"), "not a recognised padding/causal mask", id="unknown-mask"),
        # Values narrower than queries: the rule assumes one d_model for query, key, value and output.
        pytest.param(_attention_with_weights(v_width=4), "is not ['B', 'T', 'D']", id="value-width-differs"),
        pytest.param(_attention_with_weights(axis=2), None, id="softmax-not-over-keys"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, onnx_attention_weights_rules)
    assert count == 0
    assert hg.op_types(rewritten) == hg.op_types(model)
    if reason is not None:
        assert any(reason in why for why in hg.failed_checks(model, onnx_attention_weights_rules))
