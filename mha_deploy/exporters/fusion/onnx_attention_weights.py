"""Reference MHA that also returns its softmax probabilities -> ONNX ``Attention`` with ``qk_matmul_output``.

Why this rule exists: when the model returns ``attn_weights`` the Softmax
output has a second use (a graph output), so upstream's SDPA fusion, which
replaces the whole chain, cannot match. Standard ``Attention`` can output the
probabilities itself (``qk_matmul_output`` with ``qk_matmul_output_mode=3``:
"after softmax"; ORT 1.31 CPU supports it, measured in the tests), so this
rule matches the head split, scores, mask bias (left by ``masked_fill_bias``),
softmax and head merge in one pattern and emits one op with two outputs. The
contrib ops have no such output (``com.microsoft.MultiHeadAttention``'s ``qk``
is the scores before softmax), so ``--fuse mha`` refuses weights instead.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.constant_values import scalar_constant
from mha_deploy.exporters.fusion.mask_analysis import analyse_bias_for
from mha_deploy.exporters.fusion.onnx_attention import padding_attn_mask

_QK_AFTER_SOFTMAX = 3


def _bind_dims(bindings: dict, value: ir.Value, names: list[str]) -> bool:
    """True when ``value``'s shape is known and agrees with ``names``; binds each new name to its dim."""
    if value.shape is None or value.shape.rank() != len(names):
        return False
    return all(bindings.setdefault(name, dim) == dim for name, dim in zip(names, value.shape, strict=True))


class OnnxAttentionWithWeights(pattern.RewriteRuleClassBase):
    def pattern(self, op, query_BSD, key_BSD, value_BSD, scale, bias):
        # [batch, seq, d_model] -> [batch, seq, heads, d_k] -> [batch, heads, seq, d_k]
        query = op.Transpose(op.Reshape(query_BSD, pattern.ANY_VALUE), perm=[0, 2, 1, 3], _outputs=["query_BHSD"])
        # key goes straight to [batch, heads, d_k, kv_len] (torch composes the two transposes)
        key = op.Transpose(op.Reshape(key_BSD, pattern.ANY_VALUE), perm=[0, 2, 3, 1])
        value = op.Transpose(op.Reshape(value_BSD, pattern.ANY_VALUE), perm=[0, 2, 1, 3])
        scores = op.MatMul(query, key)
        scores = pattern.OrValue(
            [op.Div(scores, scale), op.Mul(scores, scale)], tag_var="scaling", tag_values=["Div", "Mul"]
        )
        scores = pattern.OrValue([op.Add(scores, bias), scores], tag_var="has_bias", tag_values=[True, False])
        weights = op.Softmax(scores, axis=-1, _outputs=["weights"])
        context = op.MatMul(weights, value)
        # [batch, heads, q_len, d_k] -> [batch, q_len, d_model]
        output = op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), pattern.ANY_VALUE, _outputs=["output"])
        return output, weights

    def check(
        self, context, query_BSD, key_BSD, value_BSD, scale, query_BHSD, output, scaling, has_bias, bias=None, **_
    ):
        result = pattern.MatchResult()
        bindings: dict = {}
        for value, dims in (
            (query_BSD, ["B", "S", "D"]),
            (key_BSD, ["B", "T", "D"]),
            (value_BSD, ["B", "T", "D"]),
            (query_BHSD, ["B", "H", "S", "Dh"]),
            (output, ["B", "S", "D"]),
        ):
            if not _bind_dims(bindings, value, dims):
                return result.fail(f"{value.name} is not {dims}", value)
        heads, head_size, d_model = bindings["H"], bindings["Dh"], bindings["D"]
        if not all(isinstance(v, int) for v in (heads, head_size, d_model)) or heads * head_size != d_model:
            return result.fail("heads * head size must equal d_model, all known", query_BHSD)
        factor = scalar_constant(scale)
        if factor is None or factor == 0:
            return result.fail("the score scale is not a constant", scale)
        self._heads = heads
        self._scale = 1.0 / factor if scaling == "Div" else factor
        if math.isclose(self._scale, 1.0 / math.sqrt(head_size), rel_tol=1e-6):
            self._scale = None
        self._bias, self._parts = (bias if has_bias else None), None
        if not has_bias:
            return result
        parts = analyse_bias_for(bias, bindings["B"], bindings["S"], bindings["T"])
        if parts is None:
            return result.fail("the mask is not a recognised padding/causal mask", bias)
        # A position bias next to the mask (T5): attn_mask is one additive input, the bias as it is.
        self._parts = None if parts.bias_terms else parts
        return result

    def rewrite(self, op, query_BSD, key_BSD, value_BSD, **_):
        attributes = {
            "q_num_heads": self._heads,
            "kv_num_heads": self._heads,
            "qk_matmul_output_mode": _QK_AFTER_SOFTMAX,
        }
        if self._scale is not None:
            attributes["scale"] = self._scale
        mask = self._bias if self._parts is None else None
        if self._parts is not None:
            if self._parts.causal:
                attributes["is_causal"] = 1
            if self._parts.key_padding is not None:
                mask = padding_attn_mask(op, self._parts.real_keys(op), query_BSD, self._parts.fill)
        inputs = [query_BSD, key_BSD, value_BSD] + ([mask] if mask is not None else [])
        output, _, _, weights = op.Attention(*inputs, **attributes, _outputs=4)
        return output, weights


onnx_attention_weights_rules = pattern.RewriteRuleSet([OnnxAttentionWithWeights.rule()])


def fuse_onnx_attention_weights(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return onnx_attention_weights_rules.apply_to_model(model)
