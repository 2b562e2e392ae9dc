"""cache_heads: contrib MHA over ``Reshape(Transpose(Concat(past, new)))`` -> the op reading the cache's
[batch, heads, kv_len, head_dim] layout as it is."""

from __future__ import annotations

import numpy as np
import pytest

from mha_deploy.exporters.fusion.cache_heads import cache_heads_rules
from tests.exporters.fusion.hand_graphs import (
    Graph,
    assert_same_outputs,
    failed_checks,
    node,
    normal,
    op_types,
    rewrite,
)

HEADS, HEAD_DIM = 4, 8
HIDDEN = HEADS * HEAD_DIM


def _cached_attention(*, from_cache=True, key_padding=False, heads=HEADS):
    """One step's attention over a cache: keys/values = Concat(past, new) along the length, handed to the op
    as [batch, kv_len, hidden] (what the fusion writes), with an additive attention_bias."""
    g = Graph()
    query = g.input("query", np.float32, ["batch", "seq", HIDDEN])
    bias = g.input("bias", np.float32, ["batch", 1, "seq", "total"])
    cached = []
    for kind in ("key", "value"):
        new = g.input(f"new_{kind}", np.float32, ["batch", HEADS, "seq", HEAD_DIM])
        past = g.input(f"past_{kind}", np.float32, ["batch", HEADS, "past", HEAD_DIM])
        grown = g.op("Concat", past, new, axis=2) if from_cache else g.op("Add", past, past)
        flat = g.op("Reshape", g.op("Transpose", grown, perm=[0, 2, 1, 3]), g.const([0, -1, HIDDEN], np.int64))
        cached.append(flat)
    inputs = [query, *cached, "", ""]
    if key_padding:
        inputs[4] = g.input("key_padding_mask", np.int32, ["batch", "total"])
    g.output(g.op("MultiHeadAttention", *inputs, bias, domain="com.microsoft", num_heads=heads))
    return g.model()


def _cross_attention(*, heads=HEADS):
    """One step's cross-attention over an encoder-decoder's cross cache: the keys/values graph inputs themselves
    ([batch, heads, source, head_dim], computed once by the encoder file), handed to the op as
    [batch, source, hidden]."""
    g = Graph()
    query = g.input("query", np.float32, ["batch", "seq", HIDDEN])
    flat = []
    for kind in ("key", "value"):
        cache = g.input(f"past_{kind}", np.float32, ["batch", HEADS, "source", HEAD_DIM])
        flat.append(g.op("Reshape", g.op("Transpose", cache, perm=[0, 2, 1, 3]), g.const([0, 0, -1], np.int64)))
    g.output(g.op("MultiHeadAttention", query, *flat, domain="com.microsoft", num_heads=heads, scale=0.25))
    return g.model()


def _feeds():
    batch, seq, past = 2, 1, 5
    total = past + seq
    bias = np.where(np.random.default_rng(3).random((batch, 1, seq, total)) < 0.3, -1e9, 0).astype(np.float32)
    feeds = {"query": normal((batch, seq, HIDDEN), 1), "bias": bias}
    for i, kind in enumerate(("key", "value")):
        feeds[f"new_{kind}"] = normal((batch, HEADS, seq, HEAD_DIM), 2 + i)
        feeds[f"past_{kind}"] = normal((batch, HEADS, past, HEAD_DIM), 4 + i)
    return feeds


def test_the_op_reads_the_cache_without_transposing_it():
    model = _cached_attention()
    rewritten, count = rewrite(model, cache_heads_rules)
    assert count == 1
    assert "Transpose" not in op_types(rewritten) and "Reshape" not in op_types(rewritten)
    attention = node(rewritten, "MultiHeadAttention")
    assert [n.op_type for n in rewritten.graph.node if n.output[0] in attention.input[1:3]] == ["Concat", "Concat"]
    # bit for bit on ORT's CPU provider: the same kernel over the same numbers, another layout
    assert_same_outputs(model, rewritten, _feeds(), atol=0, rtol=0)


def test_a_cross_cache_is_read_as_it_is():
    model = _cross_attention()
    rewritten, count = rewrite(model, cache_heads_rules)
    assert count == 1
    assert "Transpose" not in op_types(rewritten) and "Reshape" not in op_types(rewritten)
    assert list(node(rewritten, "MultiHeadAttention").input[1:3]) == ["past_key", "past_value"]
    feeds = {"query": normal((2, 3, HIDDEN), 1), "past_key": normal((2, HEADS, 7, HEAD_DIM), 2),
             "past_value": normal((2, HEADS, 7, HEAD_DIM), 3)}
    # Mask-free 3-D keys take ORT's tiled (flash) CPU path, 4-D ones the plain kernel: the same sums in another
    # order, so within float32 rounding (1.8e-7 measured) rather than bit for bit.
    assert_same_outputs(model, rewritten, feeds, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        pytest.param(_cached_attention(from_cache=False), "not a cache grown from a graph input", id="not-a-cache"),
        pytest.param(_cached_attention(key_padding=True), "key padding mask", id="key-padding-mask"),
        pytest.param(_cached_attention(heads=2), "are not [batch, 2 heads", id="other-heads"),
        pytest.param(_cross_attention(heads=2), "are not [batch, 2 heads", id="cross-other-heads"),
    ],
)
def test_leaves_alone(model, reason):
    rewritten, count = rewrite(model, cache_heads_rules)
    assert count == 0
    assert "Transpose" in op_types(rewritten)
    assert any(reason in why for why in failed_checks(model, cache_heads_rules))
