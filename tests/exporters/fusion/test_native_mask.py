"""native_mask: a contrib attention op's float ``attention_bias`` -> its key-padding input / causal flag."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.native_mask import native_mask_rules
from tests.exporters.fusion import hand_graphs as hg

BATCH, SEQ, HIDDEN, HEADS = 2, 4, 8, 2


def _bias(g: hg.Graph, mask: str, kv_len: int, padding_shape=None) -> str:
    """The float bias upstream's fusions hand the op: the mask's Where(..., hg.FILL, 0) Expanded to
    [BATCH, 1, SEQ, kv_len]; ``mask`` names its parts ("padding-causal"), "input" is a bias no rule reads."""
    if mask == "input":
        return g.input("attention_bias", np.float32, [BATCH, 1, SEQ, kv_len])
    parts = []
    if "padding" in mask:
        parts.append(hg.key_padding_mask(g, *(padding_shape or (BATCH, kv_len))))
    if "causal" in mask:
        parts.append(hg.causal_mask(g, SEQ))
    if "two-ranges" in mask:
        parts.append(hg.causal_mask(g, SEQ, kv_positions=hg.positions(g, SEQ)))
    combined = parts[0] if len(parts) == 1 else g.op("And", *parts)
    return hg.mask_bias(g, combined, expand_to=[BATCH, 1, SEQ, kv_len])


def _mha(mask: str, *, kv_len=SEQ, padding_input=False, unidirectional=0, padding_shape=None):
    """Contrib MultiHeadAttention, q [BATCH, SEQ, HIDDEN] and k/v [BATCH, kv_len, HIDDEN], masked by ``_bias``."""
    g = hg.Graph()
    q = g.input("query", np.float32, [BATCH, SEQ, HIDDEN])
    k = g.input("key", np.float32, [BATCH, kv_len, HIDDEN])
    v = g.input("value", np.float32, [BATCH, kv_len, HIDDEN])
    bias = _bias(g, mask, kv_len, padding_shape)
    padding = g.input("mask_index", np.int32, [BATCH, kv_len]) if padding_input else ""
    op_attributes = {"num_heads": HEADS, "unidirectional": unidirectional}
    g.output(g.op("MultiHeadAttention", q, k, v, "", padding, bias, domain="com.microsoft", **op_attributes))
    return g.model()


def _packed_attention(mask: str):
    """Contrib Attention (packed q/k/v weights, so self-attention) masked by ``_bias``."""
    g = hg.Graph()
    x = g.input("x", np.float32, [BATCH, SEQ, HIDDEN])
    bias = _bias(g, mask, SEQ)
    weights, biases = g.const(hg.normal((HIDDEN, 3 * HIDDEN), 1)), g.const(hg.normal((3 * HIDDEN,), 2))
    g.output(g.op("Attention", x, weights, biases, "", "", bias, domain="com.microsoft", num_heads=HEADS))
    return g.model()


def _feeds(model, seed=0):
    names = {i.name for i in model.graph.input}
    feeds = {name: hg.normal((BATCH, SEQ, HIDDEN), seed + i) for i, name in enumerate(("query", "key", "value", "x"))}
    feeds["key_padding_mask"] = hg.padding_feeds(BATCH, SEQ, seed)
    return {name: array for name, array in feeds.items() if name in names}


@pytest.mark.parametrize(
    ("build", "mask"),
    [
        (_mha, "padding"),
        (_mha, "causal"),
        (_mha, "padding-causal"),
        (_packed_attention, "padding"),
        (_packed_attention, "padding-causal"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.__name__.strip("_"),
)
def test_bias_becomes_native_mask_inputs(build, mask):
    model = build(mask)
    rewritten, count = hg.rewrite(model, native_mask_rules)
    assert count == 1
    op = hg.node(rewritten, "MultiHeadAttention" if build is _mha else "Attention")
    padding_index, bias_index = (4, 5) if build is _mha else (3, 5)
    inputs = list(op.input) + [""] * 6
    assert inputs[bias_index] == ""  # no float [batch, 1, q, kv] bias left
    assert (inputs[padding_index] != "") == ("padding" in mask)
    assert hg.attributes(op).get("unidirectional", 0) == ("causal" in mask)
    assert hg.attributes(op)["mask_filter_value"] == pytest.approx(hg.FILL)
    hg.assert_same_outputs(model, rewritten, _feeds(model))


def test_two_ranges_of_one_length_are_causal():
    """Key and query positions from two Ranges: the algebra cannot tell that they index one sequence, but over
    one length they do, and probing the bias (mask_probe) reads "key <= query"."""
    model = _mha("two-ranges")
    rewritten, count = hg.rewrite(model, native_mask_rules)
    assert count == 1
    assert hg.attributes(hg.node(rewritten, "MultiHeadAttention")).get("unidirectional") == 1
    hg.assert_same_outputs(model, rewritten, _feeds(model))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_mha("input"), "not a padding/causal mask", id="bias-is-an-input"),
        # One padding row for the whole batch: mask_index wants [batch, kv_len].
        pytest.param(_mha("padding", padding_shape=(1, SEQ)), "not a padding/causal mask", id="padding-not-per-batch"),
        pytest.param(_mha("padding", padding_input=True), "already has a key padding mask", id="padding-input-taken"),
        pytest.param(_mha("causal", unidirectional=1), "already unidirectional", id="already-causal"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = hg.rewrite(model, native_mask_rules)
    assert count == 0
    assert list(hg.node(rewritten, "MultiHeadAttention").input) == list(hg.node(model, "MultiHeadAttention").input)
    assert any(reason in why for why in hg.failed_checks(model, native_mask_rules))


@pytest.mark.parametrize("mask", ["padding", "padding-causal"])
def test_an_infinite_fill_becomes_a_finite_mask_filter_value(mask):
    # torch's masks and the reference form fill with -inf: as mask_filter_value, contrib MultiHeadAttention
    # gives NaN on a batch row whose keys are all padding (test_finite_bias pins it).
    g = hg.Graph()
    q, k, v = (g.input(name, np.float32, [BATCH, SEQ, HIDDEN]) for name in ("query", "key", "value"))
    parts = [hg.key_padding_mask(g, BATCH, SEQ)] + ([hg.causal_mask(g, SEQ)] if "causal" in mask else [])
    combined = parts[0] if len(parts) == 1 else g.op("And", *parts)
    bias = hg.mask_bias(g, combined, fill=-np.inf, expand_to=[BATCH, 1, SEQ, SEQ])
    g.output(g.op("MultiHeadAttention", q, k, v, "", "", bias, domain="com.microsoft", num_heads=HEADS))
    model = g.model()
    rewritten, count = hg.rewrite(model, native_mask_rules)
    assert count == 1
    fill = hg.attributes(hg.node(rewritten, "MultiHeadAttention"))["mask_filter_value"]
    assert fill == pytest.approx(float(np.finfo(np.float32).min) / 2)
    feeds = _feeds(model)
    feeds["key_padding_mask"][-1] = False  # a batch row that is all padding
    (output,) = hg.run(rewritten, feeds).values()
    assert np.isfinite(output).all()
