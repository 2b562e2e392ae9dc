"""onnx_attention: contrib ``MultiHeadAttention`` (as upstream fuses it) -> standard ONNX ``Attention``."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.onnx_attention import onnx_attention_rules
from tests.exporters.fusion import hand_graphs as hg

BATCH, SEQ, KV_LEN, HIDDEN, HEADS = 2, 3, 5, 8, 2


def _mha(mask="none", *, kv_len=KV_LEN, scale=None, unidirectional=0, padding_input=False, key_shape=None):
    """Contrib MultiHeadAttention, q [BATCH, SEQ, HIDDEN], k/v [BATCH, kv_len, HIDDEN]; the mask as upstream
    passes it: ``attention_bias`` Expanded to [BATCH, 1, SEQ, kv_len] (``bias-q1``: left at q axis 1)."""
    g = hg.Graph()
    q = g.input("query", np.float32, [BATCH, SEQ, HIDDEN])
    k = g.input("key", np.float32, list(key_shape or (BATCH, kv_len, HIDDEN)))
    v = g.input("value", np.float32, list(key_shape or (BATCH, kv_len, HIDDEN)))
    bias = ""
    if mask == "padding":
        bias = hg.mask_bias(g, hg.key_padding_mask(g, BATCH, kv_len), expand_to=[BATCH, 1, SEQ, kv_len])
    elif mask == "causal":
        bias = hg.mask_bias(g, hg.causal_mask(g, SEQ), expand_to=[BATCH, 1, SEQ, kv_len])
    elif mask == "bias":  # a mask no rule reads: passed on as the float attn_mask
        bias = g.input("attention_bias", np.float32, [BATCH, 1, SEQ, kv_len])
    elif mask == "bias-q1":
        bias = g.input("attention_bias", np.float32, [BATCH, 1, 1, kv_len])
    padding = g.input("mask_index", np.int32, [BATCH, kv_len]) if padding_input else ""
    inputs = [q, k, v]
    if bias or padding:
        inputs += ["", padding, bias]  # (no packed projection bias)
    optional = {"scale": scale} if scale is not None else {}
    out = g.op(
        "MultiHeadAttention",
        *inputs,
        domain="com.microsoft",
        num_heads=HEADS,
        unidirectional=unidirectional,
        **optional,
    )
    g.output(out)
    return g.model()


def _feeds(model, kv_len):
    rng = np.random.default_rng(3)
    feeds = {
        "query": hg.normal((BATCH, SEQ, HIDDEN), 1),
        "key": hg.normal((BATCH, kv_len, HIDDEN), 2),
        "value": hg.normal((BATCH, kv_len, HIDDEN), 3),
        "key_padding_mask": hg.padding_feeds(BATCH, kv_len),
        "attention_bias": np.where(rng.random((BATCH, 1, SEQ, kv_len)) < 0.3, -1e9, 0).astype(np.float32),
    }
    names = {i.name for i in model.graph.input}
    return {name: array for name, array in feeds.items() if name in names}


@pytest.mark.parametrize(
    ("mask", "kv_len", "scale", "expected"),
    [
        ("none", KV_LEN, None, {}),
        ("none", KV_LEN, 0.3, {"scale": 0.3}),
        ("padding", KV_LEN, None, {"attn_mask": "Expand"}),
        ("causal", SEQ, None, {"is_causal": 1}),
        ("bias", KV_LEN, None, {"attn_mask": "attention_bias"}),
    ],
    ids=["unmasked", "scaled", "padding", "causal", "unrecognised-bias"],
)
def test_mha_becomes_onnx_attention(mask, kv_len, scale, expected):
    model = _mha(mask, kv_len=kv_len, scale=scale)
    rewritten, count = hg.rewrite(model, onnx_attention_rules)
    assert count == 1
    assert "com.microsoft.MultiHeadAttention" not in hg.op_types(rewritten)
    op = hg.node(rewritten, "Attention")
    assert op.domain == ""
    attrs = hg.attributes(op)
    assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (HEADS, HEADS)
    assert attrs.get("is_causal", 0) == expected.get("is_causal", 0)
    if "scale" in expected:
        assert attrs["scale"] == pytest.approx(expected["scale"])
    else:  # the default 1/sqrt(head_size)
        assert "scale" not in attrs
    mask_input = op.input[3] if len(op.input) > 3 else None
    if "attn_mask" not in expected:
        assert mask_input is None
    elif expected["attn_mask"] == "Expand":  # built from the key padding mask, q axis explicit
        assert [n.op_type for n in rewritten.graph.node if mask_input in n.output] == ["Expand"]
    else:
        assert mask_input == expected["attn_mask"]
    hg.assert_same_outputs(model, rewritten, _feeds(model, kv_len))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        # ORT 1.31's Attention rejects a mask whose q axis is 1, and nothing says what it masks.
        pytest.param(_mha("bias-q1"), "neither recognised nor explicit", id="bias-with-q-axis-1"),
        pytest.param(_mha("none", padding_input=True), "only query/key/value", id="key-padding-input"),
        pytest.param(_mha("none", unidirectional=1), "already unidirectional", id="unidirectional"),
        # Keys already split into heads ([batch, heads, kv_len, head_size]).
        pytest.param(_mha(key_shape=(BATCH, HEADS, KV_LEN, HIDDEN // HEADS)), "must be 3-D", id="4d-key"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, onnx_attention_rules)
    assert count == 0
    assert hg.op_types(rewritten) == hg.op_types(model)
    assert any(reason in why for why in hg.failed_checks(model, onnx_attention_rules))
