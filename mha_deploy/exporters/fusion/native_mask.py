"""Contrib attention op with a float ``attention_bias`` -> the same op with native mask inputs.

Why this rule exists: upstream's MHA fusion passes any additive mask as
``attention_bias`` and, for a [batch, 1, 1, kv_len] padding mask, inserts an
``Expand`` to [batch, 1, q_len, kv_len] (the contrib ops do not broadcast the
q_len axis): a float tensor of batch * q_len * kv_len is built on every call.
``com.microsoft.MultiHeadAttention`` has a ``key_padding_mask`` input (int32
[batch, kv_len], 0 = pad) and ``com.microsoft.Attention`` a ``mask_index``
input of the same form, and both have a ``unidirectional`` (causal) flag.
When ``mask_analysis`` recognises the bias as key padding and/or causal, the
bias is dropped for those. Measured on ORT 1.31 CPU (see tests): both give the
reference's result on every row with a visible key; rows with none (left
padding + causal, a batch row all padding) are finite: the fill is made finite
(``finite_fill``), with -inf key_padding_mask alone gives NaN there.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.contrib_mha import has_inputs_from, optional_input
from mha_deploy.exporters.fusion.mask_analysis import MaskParts, analyse_bias_for, finite_fill, holds_score_terms
from mha_deploy.exporters.fusion.mask_probe import window_constants
from mha_deploy.onnx_nodes import BIAS_PROP, POSITION_BIAS, SCORE_TERMS, WINDOW_MASK

# (op type, index of the key-padding input, index of attention_bias)
_MASK_INPUTS = {"MultiHeadAttention": (4, 5), "Attention": (3, 5)}


class NativeMask(pattern.RewriteRuleClassBase):
    def __init__(self, op_type: str):
        super().__init__(f"NativeMask_{op_type}")
        self._op_type = op_type
        self._padding_index, self._bias_index = _MASK_INPUTS[op_type]

    def pattern(self, op, query):
        return getattr(op, self._op_type)(
            query, _allow_other_inputs=True, _domain="com.microsoft", _outputs=["attention"]
        )

    def check(self, context, query, attention, **_):
        result = pattern.MatchResult()
        node = attention.producer()
        if len(node.outputs) != 1:
            return result.fail("the op also returns past/present state", node)
        if optional_input(node, self._padding_index) is not None:
            return result.fail("the op already has a key padding mask", node)
        if has_inputs_from(node, self._bias_index + 1):
            return result.fail("the op has past state inputs", node)
        if query.shape is None or query.shape.rank() != 3:
            return result.fail("query is not [batch, seq, hidden]", query)
        batch, q_len = query.shape[0], query.shape[1]
        # Packed Attention is self-attention: its keys are the query sequence.
        kv_len = q_len if self._op_type == "Attention" else _kv_len(node)
        if BIAS_PROP in node.metadata_props:
            return result.fail("the op's attention_bias was already read: a bias that masks nothing", node)
        parts = analyse_bias_for(optional_input(node, self._bias_index), batch, q_len, kv_len)
        if parts is None:
            return result.fail("attention_bias is not a padding/causal mask that fits this op", node)
        if parts.causal and node.attributes.get_int("unidirectional", 0):
            return result.fail("the op is already unidirectional", node)
        self._parts = parts
        return result

    def rewrite(self, op, attention, **_):
        node = attention.producer()
        parts: MaskParts = self._parts
        inputs = list(node.inputs[: self._bias_index + 1])
        inputs += [None] * (self._bias_index + 1 - len(inputs))
        # What masks nothing (a position bias) stays the op's bias, summed once when it has several terms.
        inputs[self._bias_index] = _sum(op, parts.bias_terms)
        if parts.key_padding is not None:
            inputs[self._padding_index] = op.Cast(parts.real_keys(op), to=ir.DataType.INT32)
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        if parts.key_padding is not None or parts.causal:
            attributes["mask_filter_value"] = finite_fill(parts.fill, node.inputs[0].dtype.numpy())
        if parts.causal:
            attributes["unidirectional"] = 1
        fused = getattr(op, self._op_type)(*inputs, _domain="com.microsoft", **attributes)
        if parts.bias_terms:
            fused.producer().metadata_props[BIAS_PROP] = POSITION_BIAS
        return fused


def _sum(op, terms: tuple[ir.Value, ...]) -> ir.Value | None:
    if not terms:
        return None
    total = terms[0]
    for term in terms[1:]:
        total = op.Add(total, term)
    return total


def _kv_len(node: ir.Node):
    key = node.inputs[1]
    return key.shape[1] if key is not None and key.shape is not None and key.shape.rank() == 3 else None


native_mask_rules = pattern.RewriteRuleSet([NativeMask.rule("MultiHeadAttention"), NativeMask.rule("Attention")])


def fuse_native_mask(model: ir.Model) -> int:
    """Apply the rule everywhere in ``model``; the number of rewrites. A bias it leaves that is what no native
    input can take is tagged for the report (``BIAS_PROP``): relative score terms with the mask (DeBERTa), a
    window mask (ModernBERT's local layers)."""
    count = native_mask_rules.apply_to_model(model)
    for node in model.graph.all_nodes():
        if node.domain != "com.microsoft" or node.op_type not in _MASK_INPUTS or BIAS_PROP in node.metadata_props:
            continue
        bias = optional_input(node, _MASK_INPUTS[node.op_type][1])
        if bias is None:
            continue
        if holds_score_terms(bias):
            node.metadata_props[BIAS_PROP] = SCORE_TERMS
        elif window_constants(bias):
            node.metadata_props[BIAS_PROP] = WINDOW_MASK
    return count
