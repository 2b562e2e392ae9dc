"""Read a boolean attention mask back into "key padding" and "causal" parts.

Not a rewrite rule: the helper the ``native_mask`` and ``onnx_attention`` rules
share. After ``masked_fill_bias`` the fused op receives an additive bias

    [Expand(] Where(Equal(Cast(M), 0), FILL, 0) [, shape)]

where ``M`` (True = attend) is what the export wrappers build
(``graphs.build_attention_mask``): ``Unsqueeze(key_padding_mask, [1, 2])``
([batch, 1, 1, kv_len]), ``LessOrEqual(kv_pos[None, :], q_pos[:, None])`` from one
``Range(0, seq, 1)`` ([q_len, kv_len]), or ``And`` of the two. Recognising those
lets the fused op take its native key-padding input and causal flag instead of
a materialised float [batch, 1, q_len, kv_len] bias. Anything else is reported
as unrecognised and the caller keeps the bias (still fused, just not lean).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from mha_deploy.exporters.fusion.constant_values import constant_array, scalar_constant


@dataclass(frozen=True)
class MaskParts:
    """What a recognised mask is made of."""

    fill: float
    # [batch, kv_len], nonzero/True = real token; None when no key is padded.
    key_padding: ir.Value | None = None
    # Lower-triangular (key position <= query position, diagonal included).
    causal: bool = False
    # The [q_len, kv_len] causal comparison, kept to check its dims against the op's.
    causal_value: ir.Value | None = None


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _ints(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    return None if array is None else [int(v) for v in array.reshape(-1)]


def _is_scalar(value: ir.Value | None, expected: float) -> bool:
    return scalar_constant(value) == expected


def _positions(value: ir.Value, axis: int) -> ir.Value | None:
    """The Range behind ``Unsqueeze(Range(0, n, 1), axis)``, or None."""
    unsqueeze = _producer(value, "Unsqueeze")
    if unsqueeze is None or _ints(unsqueeze.inputs[1]) not in ([axis], [axis - 2]):
        return None
    arange = _producer(unsqueeze.inputs[0], "Range")
    if arange is None or not _is_scalar(arange.inputs[0], 0) or not _is_scalar(arange.inputs[2], 1):
        return None
    return arange.outputs[0]


def _decompose(mask: ir.Value, parts: dict) -> bool:
    """Fill ``parts`` with the pieces of the boolean mask ``mask``; False if any piece is unknown."""
    if (node := _producer(mask, "And")) is not None:
        return _decompose(node.inputs[0], parts) and _decompose(node.inputs[1], parts)
    if (node := _producer(mask, "Cast")) is not None and node.attributes.get_int("to") == ir.DataType.BOOL:
        return _decompose(node.inputs[0], parts)
    if (node := _producer(mask, "Unsqueeze")) is not None:
        # [batch, kv_len] -> [batch, 1, 1, kv_len]
        source = node.inputs[0]
        if _ints(node.inputs[1]) not in ([1, 2], [-3, -2]) or source.shape is None or source.shape.rank() != 2:
            return False
        if "key_padding" in parts:
            return False
        parts["key_padding"] = source
        return True
    if (node := _producer(mask, "LessOrEqual")) is not None:
        kv_pos, q_pos = _positions(node.inputs[0], 0), _positions(node.inputs[1], 1)
        # One Range for both axes: query i and key i are the same position,
        # so "key <= query" is the causal mask with the diagonal.
        if kv_pos is None or kv_pos is not q_pos or "causal" in parts:
            return False
        parts["causal"] = True
        parts["causal_value"] = node.outputs[0]
        return True
    return False


def analyse_bias(bias: ir.Value | None) -> MaskParts | None:
    """Decompose the additive bias built by ``masked_fill_bias``; None when it is anything else."""
    expand = _producer(bias, "Expand")
    where = _producer(expand.inputs[0] if expand is not None else bias, "Where")
    if where is None or not _is_scalar(where.inputs[2], 0):
        return None
    fill = scalar_constant(where.inputs[1])
    equal = _producer(where.inputs[0], "Equal")
    if fill is None or equal is None or not _is_scalar(equal.inputs[1], 0):
        return None
    cast = _producer(equal.inputs[0], "Cast")
    mask = cast.inputs[0] if cast is not None else equal.inputs[0]
    if mask is None or mask.dtype != ir.DataType.BOOL:
        return None
    parts: dict = {}
    if not _decompose(mask, parts):
        return None
    return MaskParts(fill=float(fill), **parts)


def analyse_bias_for(bias: ir.Value | None, batch, q_len, kv_len) -> MaskParts | None:
    """``analyse_bias``, and only if its parts fit an op over [batch, q_len] queries and [batch, kv_len] keys."""
    parts = analyse_bias(bias)
    if parts is None:
        return None
    if parts.key_padding is not None and not dims_match(parts.key_padding, [batch, kv_len]):
        return None
    # The causal flags mean "key <= query" only when both index one sequence,
    # so alignment (top-left vs bottom-right) never comes into play.
    if parts.causal and (q_len != kv_len or not dims_match(parts.causal_value, [q_len, kv_len])):
        return None
    return parts


def dims_match(value: ir.Value | None, dims: list) -> bool:
    """True when ``value``'s shape is known and equals ``dims`` (ints or symbolic dims)."""
    if value is None or value.shape is None or value.shape.rank() != len(dims):
        return False
    return all(actual == expected for actual, expected in zip(value.shape, dims, strict=True))
