"""Contrib ``MultiHeadAttention`` whose ``attention_bias`` may lack its query or key axis -> Expanded to both.

Why this rule exists: upstream's MHA fusion broadcasts a mask's query axis (an
``Expand`` to [1, 1, q_len, 1]) but not its key axis. A mask that masks queries
instead of keys ([batch, 1, q_len, 1], e.g. a padding input unsqueezed on the
wrong axes) then reaches the op with a key axis of 1, which ORT rejects when the
model runs ("attention_bias dimension 3 should be same as
total_sequence_length"), as the CPU kernel of standard ``Attention`` does. The
fused model would be written and fail on its first call. Broadcasting the bias
to [*, *, q_len, kv_len] is what the plain graph's Where did; ``native_mask``
reads a mask through the Expand, so a recognised mask still leaves no bias.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.contrib_mha import ATTENTION_BIAS, ContribMHARule, optional_input


class ExplicitBiasAxes(ContribMHARule):
    def check(self, context, query, key, value, attention, **_):
        result = pattern.MatchResult()
        bias = optional_input(attention.producer(), ATTENTION_BIAS)
        if bias is None:
            return result.fail("the op has no attention_bias", attention.producer())
        for tensor in (query, key, bias):
            if tensor.shape is None:
                return result.fail(f"{tensor.name} has no known shape", tensor)
        if query.shape.rank() != 3 or key.shape.rank() != 3 or bias.shape.rank() != 4:
            return result.fail("query/key are not 3-D or attention_bias is not 4-D", attention.producer())
        if bias.shape[2] == query.shape[1] and bias.shape[3] == key.shape[1]:
            return result.fail("attention_bias is already explicit on the query and key axes", bias)
        return result

    def rewrite(self, op, query, key, value, attention, **_):
        node = attention.producer()
        bias = node.inputs[ATTENTION_BIAS]
        one = op.Constant(value_ints=[1])
        lengths = op.Shape(query, start=1, end=2), op.Shape(key, start=1, end=2)
        explicit = op.Expand(bias, op.Concat(one, one, *lengths, axis=0))
        # Set here, so that this rule does not match the rewritten op and the rules after it see the axes.
        explicit.dtype = bias.dtype
        explicit.shape = ir.Shape([bias.shape[0], bias.shape[1], query.shape[1], key.shape[1]])
        inputs = list(node.inputs)
        inputs[ATTENTION_BIAS] = explicit
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        return op.MultiHeadAttention(*inputs, _domain="com.microsoft", **attributes)


bias_axes_rules = pattern.RewriteRuleSet([ExplicitBiasAxes.rule()])


def fuse_bias_axes(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return bias_axes_rules.apply_to_model(model)
