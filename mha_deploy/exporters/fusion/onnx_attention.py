"""``com.microsoft.MultiHeadAttention`` (as upstream fuses it) -> standard ONNX ``Attention`` (opset 23).

Why this rule exists: upstream fuses only to ORT contrib ops. Standard
``Attention`` runs on any ONNX runtime, and its ORT 1.31 CPU kernel is faster
on the attention core. The rule starts from upstream's MHA (3-D [batch, seq,
d_model] query/key/value, no folded bias: it runs before the bias fusion,
because ``Attention`` has no bias input) and maps its mask:

- causal -> ``is_causal=1`` (q_len == kv_len is checked, so alignment is moot);
- key padding -> additive float ``attn_mask`` (0 / fill) [batch, 1, q_len, kv_len].
  ORT 1.31's CPU kernel rejects a mask whose q_len axis is 1 ("inconsistent
  q_sequence_length (between attn_mask and Q)"), so the q axis has to be
  expanded. Float, not bool: with a bool mask a query row whose keys are all
  padding comes out as zeros, with the additive fill it is the uniform average
  the reference computes (measured on ORT 1.31 CPU); that row is a real one in
  cross-attention over an all-padding memory. Speed measured equal (within noise)
  for bool and float at (8,128), (1,1024), (32,64);
- an unrecognised mask -> the float bias as ``attn_mask`` (upstream already
  expanded it to [*, *, q_len, kv_len]).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.contrib_mha import ContribMHARule
from mha_deploy.exporters.fusion.mask_analysis import analyse_bias_for


def padding_attn_mask(op, real_keys: ir.Value, query_BSD: ir.Value, fill: float) -> ir.Value:
    """bool [batch, kv_len] (True = real, ``MaskParts.real_keys``) -> additive attn_mask [batch, 1, q_len, kv_len]:
    0 or ``fill``."""
    # [batch, kv_len] -> [batch, 1, 1, kv_len]
    real = op.Unsqueeze(real_keys, op.Constant(value_ints=[1, 2]))
    dtype = query_BSD.dtype.numpy()
    zero = op.Constant(value=ir.tensor(np.array(0, dtype=dtype)))
    bias = op.Where(real, zero, op.Constant(value=ir.tensor(np.array(fill, dtype=dtype))))
    # -> [batch, 1, q_len, kv_len]: ORT's CPU kernel needs the q axis explicit
    # (a 1 there is rejected, not broadcast).
    one = op.Constant(value_ints=[1])
    q_len = op.Shape(query_BSD, start=1, end=2)
    return op.Expand(bias, op.Concat(one, one, q_len, one, axis=0))


class OnnxAttentionFromMHA(ContribMHARule):
    def check(self, context, query, key, value, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        extra = list(node.inputs[3:])
        bias = extra[2] if len(extra) > 2 else None
        if len(node.outputs) != 1 or any(v is not None for i, v in enumerate(extra) if i != 2):
            return result.fail("only query/key/value and attention_bias are supported", node)
        if node.attributes.get_int("unidirectional", 0):
            return result.fail("the op is already unidirectional", node)
        for value_ in (query, key, value):
            if value_.shape is None or value_.shape.rank() != 3:
                return result.fail("query/key/value must be 3-D [batch, seq, hidden]", value_)
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        self._bias, self._parts = bias, None
        if bias is None:
            return result
        parts = analyse_bias_for(bias, batch, q_len, kv_len)
        if parts is not None and parts.bias_terms:
            # A position bias next to the mask (T5): attn_mask is one additive input, the bias as it is.
            parts = None
        if parts is None and (bias.shape is None or bias.shape.rank() != 4 or bias.shape[2] != q_len):
            return result.fail("attention_bias is neither recognised nor explicit on the q_len axis", bias)
        self._parts = parts
        return result

    def rewrite(self, op, query, key, value, attention, **_):
        node = attention.producer()
        num_heads = node.attributes.get_int("num_heads")
        attributes = {"q_num_heads": num_heads, "kv_num_heads": num_heads}
        if (scale := node.attributes.get_float("scale", None)) is not None:
            attributes["scale"] = scale
        mask = self._bias
        if self._parts is not None:
            mask = None
            if self._parts.causal:
                attributes["is_causal"] = 1
            if self._parts.key_padding is not None:
                mask = padding_attn_mask(op, self._parts.real_keys(op), query, self._parts.fill)
        inputs = [query, key, value] + ([mask] if mask is not None else [])
        return op.Attention(*inputs, **attributes)


onnx_attention_rules = pattern.RewriteRuleSet([OnnxAttentionFromMHA.rule()])


def fuse_onnx_attention(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites."""
    return onnx_attention_rules.apply_to_model(model)
