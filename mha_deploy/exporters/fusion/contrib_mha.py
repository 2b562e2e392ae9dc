"""What the rules rewriting ORT's contrib ``com.microsoft.MultiHeadAttention`` share: its inputs and its pattern.

The op's inputs are positional and trailing ones may be absent, so every rule
reads them by index through ``optional_input``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from mha_deploy.exporters.fusion.constant_values import constant_array

# Indices of MultiHeadAttention's inputs (com.microsoft schema).
KEY, VALUE = 1, 2
BIAS, KEY_PADDING_MASK, ATTENTION_BIAS, PAST_KEY, PAST_VALUE = 3, 4, 5, 6, 7


def optional_input(node: ir.Node, index: int) -> ir.Value | None:
    """Input ``index`` of ``node``, None when it is absent or empty."""
    return node.inputs[index] if index < len(node.inputs) else None


def has_inputs_from(node: ir.Node, first: int) -> bool:
    """Whether any input from index ``first`` on is given (e.g. attention_bias or past state)."""
    return any(optional_input(node, i) is not None for i in range(first, len(node.inputs)))


def split_bias(op, bias: ir.Value, hidden: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The op's ``bias`` [3 * hidden] as (b_q, b_k, b_v): Constants when it is a constant or a Concat of
    constants (as upstream's bias fusion leaves it), so that a later rule can fold them (output_bias);
    else the outputs of a Split."""
    array = constant_array(bias)
    producer = bias.producer()
    if array is None and producer is not None and producer.op_type == "Concat":
        parts = [constant_array(value) for value in producer.inputs]
        array = None if any(part is None for part in parts) else np.concatenate(parts)
    if array is not None and array.shape == (3 * hidden,):
        return tuple(op.Constant(value=ir.tensor(array[i * hidden : (i + 1) * hidden])) for i in range(3))
    return op.Split(bias, op.Constant(value=ir.tensor(np.array([hidden] * 3, np.int64))), axis=0, _outputs=3)


def move_bias_out(op, query: ir.Value, bias: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(query + b_q, b_v)`` for the op's projection ``bias`` [3 * hidden], to run the op without it.

    The key bias shifts each query's scores by one constant, ``(q + b_q) . b_k``, which a softmax ignores (a
    masked key's fill swamps the shift as well): dropped. The value bias passes through the attention (each
    row of probabilities sums to 1): the caller adds ``b_v`` to the op's output, where ``output_bias`` folds
    it into the output projection's bias. The biased query keeps the query's type and shape, which the rules
    rewriting the op later check."""
    query_bias, _, value_bias = split_bias(op, bias, query.shape[2])
    biased = op.Add(query, query_bias)
    biased.dtype, biased.shape = query.dtype, query.shape
    return biased, value_bias


class ContribMHARule(pattern.RewriteRuleClassBase):
    """A rule that starts from one contrib MultiHeadAttention with separate query, key and value."""

    def pattern(self, op, query, key, value):
        return op.MultiHeadAttention(
            query, key, value, _allow_other_inputs=True, _domain="com.microsoft", _outputs=["attention"]
        )
