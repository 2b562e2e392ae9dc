"""What the rules rewriting ORT's contrib ``com.microsoft.MultiHeadAttention`` share: its inputs and its pattern.

The op's inputs are positional and trailing ones may be absent, so every rule
reads them by index through ``optional_input``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

# Indices of MultiHeadAttention's inputs (com.microsoft schema).
KEY, VALUE = 1, 2
BIAS, KEY_PADDING_MASK, ATTENTION_BIAS, PAST_KEY, PAST_VALUE = 3, 4, 5, 6, 7


def optional_input(node: ir.Node, index: int) -> ir.Value | None:
    """Input ``index`` of ``node``, None when it is absent or empty."""
    return node.inputs[index] if index < len(node.inputs) else None


def has_inputs_from(node: ir.Node, first: int) -> bool:
    """Whether any input from index ``first`` on is given (e.g. attention_bias or past state)."""
    return any(optional_input(node, i) is not None for i in range(first, len(node.inputs)))


class ContribMHARule(pattern.RewriteRuleClassBase):
    """A rule that starts from one contrib MultiHeadAttention with separate query, key and value."""

    def pattern(self, op, query, key, value):
        return op.MultiHeadAttention(
            query, key, value, _allow_other_inputs=True, _domain="com.microsoft", _outputs=["attention"]
        )
