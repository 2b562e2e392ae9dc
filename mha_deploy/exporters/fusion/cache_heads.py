"""Contrib MHA reading a KV cache through ``Reshape(Transpose(cache))`` -> the op reading the cache as it is.

Why this rule exists: a KV-cache model of a user's LM (``exporters.own_kv_cache``) keeps each attention's
cache as [batch, heads, total_seq, head_dim] (Optimum's layout), and upstream's MHA fusion hands the op its
keys and values as [batch, total_seq, hidden]: a Transpose and a Reshape of the whole cache, two copies of
it per layer on every step, while the step itself computes one token. ``com.microsoft.MultiHeadAttention``
also takes keys and values in that [batch, heads, kv_len, head_dim] layout (its "BNSH" key/value format,
as for a cross-attention's cached keys), so the op reads the cache directly. Measured on ORT 1.31 CPU: the
same output bit for bit with an attention_bias (tests/exporters/fusion/test_cache_heads.py).

Only a cache is rewritten: the 4-D keys and values grown by a ``Concat`` along their length axis from a
graph input, or a graph input themselves (an encoder-decoder's cross-attention cache, computed once by the
encoder file and fed back unchanged, ``exporters.own_seq2seq_cache``: there the Transposes copied the whole
source's keys and values per layer and step, 1500 positions for Whisper). On a cache-free graph the 3-D keys
are the projection's own output, and the op's mask-free flash path is not risked for them. The op must take
no projection bias, key padding mask or past state (each has its own layout rules with 4-D keys).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.contrib_mha import BIAS, KEY_PADDING_MASK, PAST_KEY, has_inputs_from, optional_input
from mha_deploy.exporters.fusion.repeat_kv import repeated_heads


class CacheHeads(pattern.RewriteRuleClassBase):
    def pattern(self, op, query, keys, values, key_shape, value_shape):
        key = op.Reshape(op.Transpose(keys, perm=[0, 2, 1, 3]), key_shape)
        value = op.Reshape(op.Transpose(values, perm=[0, 2, 1, 3]), value_shape)
        return op.MultiHeadAttention(
            query, key, value, _allow_other_inputs=True, _domain="com.microsoft", _outputs=["attention"]
        )

    def check(self, context, query, keys, values, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        heads = node.attributes.get_int("num_heads", 0)
        if len(node.outputs) != 1:
            return result.fail("the op also returns present state", node)
        for index, name in ((BIAS, "a projection bias"), (KEY_PADDING_MASK, "a key padding mask")):
            if optional_input(node, index) is not None:
                return result.fail(f"the op has {name}", node)
        if has_inputs_from(node, PAST_KEY):
            return result.fail("the op has past state", node)
        if query.shape is None or query.shape.rank() != 3:
            return result.fail("query is not [batch, q_len, hidden]", query)
        for value, role in ((keys, "keys"), (values, "values")):
            shape = value.shape
            if shape is None or shape.rank() != 4 or shape[1] != heads or not isinstance(shape[3], int):
                return result.fail(f"{role} are not [batch, {heads} heads, kv_len, head_dim]", value)
            if value.is_graph_input():  # a cross-attention's cache, fed as it is on every step
                continue
            grown = value.producer()
            repeat = repeated_heads(value)
            if repeat is not None:  # a grouped-query model's KV-head cache, repeated to the heads (fusion.repeat_kv)
                grown = repeat.source.producer()
            if grown is None or grown.op_type != "Concat" or grown.attributes.get_int("axis", 0) != 2 or \
                    not grown.inputs[0].is_graph_input():
                return result.fail(f"{role} are not a cache grown from a graph input, nor a graph input", value)
        return result

    def rewrite(self, op, keys, values, attention, **_):
        node = attention.producer()
        inputs = list(node.inputs)
        inputs[1], inputs[2] = keys, values
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        return op.MultiHeadAttention(*inputs, _domain="com.microsoft", **attributes)


cache_heads_rules = pattern.RewriteRuleSet([CacheHeads.rule()])


def fuse_cache_heads(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return cache_heads_rules.apply_to_model(model)
