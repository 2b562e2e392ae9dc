"""Read an attention mask back into "key padding" and "causal" parts, however the user's code built it.

Not a rewrite rule: the helper the ``native_mask`` and ``onnx_attention`` rules
share. They see the mask as the additive bias a fused op receives, e.g. after
``masked_fill_bias`` ``Where(Equal(Cast(M), 0), FILL, 0)``, or torch's own
``Where(Not(pad), -inf, zeros_like)``. Recognising its parts lets the fused op
take its native key-padding input and causal flag instead of a materialised
float [batch, 1, q_len, kv_len] bias. Anything else is reported as unrecognised
and the caller keeps the bias (still fused, just not lean).

``analyse_bias_for`` reads a mask by its ops first (the algebra below: exact on any
values, no graph run), then, when the algebra does not know the spelling (Hugging
Face's index-grid masks, ``(1 - mask) * fill``, a position bias added next to the
mask), by what it computes: ``mask_probe`` runs it on probe inputs.

A small algebra, not a list of graphs. A mask is read in one of two forms:
a *keep* mask (nonzero = attend) or a *blocked* mask (nonzero = masked out);
either is a conjunction of parts in keep terms:

    bias   Where(b, FILL, 0) -> blocked b     Where(k, 0, FILL) -> keep k
           Add(bias, bias)   -> both (a key is masked when either masks it)
    keep   And / Mul         -> both          blocked  Or -> both
    either Not(x), Equal(x, 0) -> x in the other form
           Cast to bool, or one that keeps nonzero nonzero (bool -> any, int -> float/int64, float -> double)
           Unsqueeze, Reshape that only inserts 1s, Expand: move the part's axes
    parts  Trilu(ones, 0, upper=0) (tril) or LessOrEqual(pos[None, :], pos[:, None]) of one Range
             as keep, Trilu(ones, 1, upper=1) (triu(., 1)) as blocked: causal, on the [q, kv] axes
           any other rank-2 value on the [batch, kv] axes: key padding (nonzero = real token when read
             as keep, = padded when read as blocked)

A part's axes are followed through every view and broadcast to the axes of the
[batch, heads, q_len, kv_len] scores it masks (counted from the right, as
broadcasting aligns them): a padding input unsqueezed to [batch, 1, kv_len, 1]
masks queries, not keys, and is not key padding. Every step is exact on any
values, so a recognised mask is the mask; at most one key padding and one causal
part are taken (two padding inputs need not be one mask).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from mha_deploy.exporters.fusion.constant_values import constant_array, scalar_constant
from mha_deploy.exporters.fusion.mask_probe import MIN_FILL_MAGNITUDE, probe_bias, reads_activations


def finite_fill(fill: float, dtype) -> float:
    """``fill`` for a fused op's masked scores, raised to half ``dtype``'s lowest value when below it (-inf, the
    fill torch's masks and the reference form use). A fused kernel adds it to every score of a row with no
    visible key: -inf there gives NaN (contrib MultiHeadAttention's key_padding_mask and attention_bias on ORT
    1.31 CPU, measured), a finite fill the average of the values. Half, so that adding it to a score or to a
    second fill cannot overflow."""
    return max(float(fill), float(np.finfo(dtype).min) / 2)


# Ops that broadcast their inputs (right-aligned) without changing which element masks which score.
_BROADCASTING = {"And", "Or", "Mul", "Add", "Where", "Equal", "Not", "Cast", "Expand"}
# Axes of the [batch, heads, q_len, kv_len] scores, counted from the right.
_BATCH, _QUERY, _KEY = -4, -2, -1
_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
_INTEGERS = {getattr(ir.DataType, f"{sign}INT{bits}") for sign in ("", "U") for bits in (8, 16, 32, 64)}


@dataclass(frozen=True)
class MaskParts:
    """What a recognised mask is made of."""

    fill: float
    # [batch, kv_len]; which tokens are real: see ``padding_marks_real``. None when no key is padded.
    key_padding: ir.Value | None = None
    # True: nonzero = real token (``pad.unsqueeze(1).unsqueeze(2)``); False: nonzero = padded
    # (torch's ``key_padding_mask``).
    padding_marks_real: bool = True
    # Lower-triangular (key position <= query position, diagonal included).
    causal: bool = False
    # The [q_len, kv_len] causal part, kept to check its dims against the op's (None when read by probes).
    causal_value: ir.Value | None = None
    # Summands of the bias that mask nothing (T5's relative position bias): the op keeps them as its bias.
    bias_terms: tuple[ir.Value, ...] = ()

    def real_keys(self, op) -> ir.Value:
        """bool [batch, kv_len], True = real token. The source is cast to bool, never to an integer type
        first, so that a float 0.5 stays a real token."""
        real = self.key_padding
        if real.dtype != ir.DataType.BOOL:
            real = op.Cast(real, to=ir.DataType.BOOL)
        return real if self.padding_marks_real else op.Not(real)


class _Unrecognised(Exception):
    """A step of the algebra does not apply: the mask is not (exactly) key padding and/or causal."""


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type not in op_types or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _ints(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    return None if array is None else [int(v) for v in array.reshape(-1)]


def _rank(value: ir.Value) -> int:
    if value is None or value.shape is None:
        raise _Unrecognised
    return value.shape.rank()


def _constant_fill(value: ir.Value | None) -> float | None:
    """The one value ``value`` holds everywhere: a scalar constant, ``Expand`` of one (``zeros_like``,
    ``ones``) or ``ConstantOfShape``."""
    if (node := _producer(value, "Expand")) is not None:
        value = node.inputs[0]
    if (node := _producer(value, "ConstantOfShape")) is not None:
        tensor = node.attributes.get_tensor("value", None)
        return 0.0 if tensor is None else float(tensor.numpy().reshape(-1)[0])
    array = constant_array(value)
    if array is None or array.size == 0 or not (array == array.reshape(-1)[0]).all():
        return None
    return float(array.reshape(-1)[0])


class _Reader:
    """Collects the parts of one mask while walking its graph from the mask to its sources."""

    def __init__(self) -> None:
        self.fills: list[float] = []
        self.key_padding: ir.Value | None = None
        self.padding_marks_real = True
        self.causal_value: ir.Value | None = None

    # -- axes: each axis of a value -> the scores axis it lies on (negative, from the right) --

    def _input_axes(self, node: ir.Node, value: ir.Value, axes: tuple[int, ...]) -> tuple[int, ...]:
        """The axes of ``value``, an input of ``node`` whose output lies on ``axes``."""
        rank = _rank(value)
        if node.op_type in _BROADCASTING:
            if rank > len(axes):
                raise _Unrecognised
            return axes[len(axes) - rank :]
        if node.op_type == "Unsqueeze":
            inserted = _ints(node.inputs[1])
            if inserted is None:
                raise _Unrecognised
            inserted = {axis % len(axes) for axis in inserted}
            kept = tuple(axis for i, axis in enumerate(axes) if i not in inserted)
            if len(kept) != rank:
                raise _Unrecognised
            return kept
        if node.op_type == "Reshape":
            return self._reshape_axes(value, node.outputs[0], axes)
        raise _Unrecognised

    @staticmethod
    def _reshape_axes(value: ir.Value, output: ir.Value, axes: tuple[int, ...]) -> tuple[int, ...]:
        """A Reshape that only inserts 1s (``pad.view(b, 1, 1, s)``), read as an Unsqueeze."""
        source = list(value.shape)
        target = list(output.shape) if output.shape is not None else []
        # Only dims that cannot be confused with an inserted 1, or with each other: ints other than 1, named dims.
        anonymous = any(isinstance(dim, ir.SymbolicDim) and dim.value is None for dim in source)
        if len(target) != len(axes) or anonymous or 1 in source:
            raise _Unrecognised
        kept = []
        for position, dim in enumerate(target):
            if len(kept) < len(source) and dim == source[len(kept)]:
                kept.append(axes[position])
            elif dim != 1:
                raise _Unrecognised
        if len(kept) != len(source):
            raise _Unrecognised
        return tuple(kept)

    # -- the forms --

    def bias(self, value: ir.Value, axes: tuple[int, ...]) -> None:
        """An additive float bias: 0 where attended, a masking fill where not."""
        node = _producer(value, "Expand", "Unsqueeze", "Reshape", "Add", "Where", "Cast")
        if node is None:
            raise _Unrecognised
        if node.op_type == "Where":
            condition, when_true, when_false = node.inputs
            true_fill, false_fill = _constant_fill(when_true), _constant_fill(when_false)
            if true_fill is not None and true_fill <= -MIN_FILL_MAGNITUDE and false_fill == 0:
                self.fills.append(true_fill)
                return self.mask(condition, "blocked", self._input_axes(node, condition, axes))
            if true_fill == 0 and false_fill is not None and false_fill <= -MIN_FILL_MAGNITUDE:
                self.fills.append(false_fill)
                return self.mask(condition, "keep", self._input_axes(node, condition, axes))
            raise _Unrecognised
        if node.op_type == "Add":
            for term in node.inputs:
                self.bias(term, self._input_axes(node, term, axes))
            return None
        if node.op_type == "Cast" and not (node.inputs[0].dtype in _FLOATS and value.dtype in _FLOATS):
            raise _Unrecognised
        return self.bias(node.inputs[0], self._input_axes(node, node.inputs[0], axes))

    def mask(self, value: ir.Value, form: str, axes: tuple[int, ...]) -> None:
        """A boolean or 0/1 mask read as ``form``: "keep" (nonzero = attend) or "blocked" (nonzero = masked)."""
        other = "blocked" if form == "keep" else "keep"
        node = _producer(
            value, "And", "Or", "Mul", "Not", "Equal", "Cast", "Unsqueeze", "Reshape", "Expand", "Trilu", "LessOrEqual"
        )
        if node is None:
            return self._key_padding(value, form, axes)
        op_type = node.op_type
        if (op_type in ("And", "Mul") and form == "keep") or (op_type == "Or" and form == "blocked"):
            # keep: attended where both attend; blocked: masked where either masks.
            for operand in node.inputs:
                self.mask(operand, form, self._input_axes(node, operand, axes))
            return None
        if op_type == "Not":
            return self.mask(node.inputs[0], other, self._input_axes(node, node.inputs[0], axes))
        if op_type == "Equal":
            for operand, zero in (node.inputs, node.inputs[::-1]):
                if scalar_constant(zero) == 0:
                    return self.mask(operand, other, self._input_axes(node, operand, axes))
            return self._key_padding(value, form, axes)
        if op_type == "Cast":
            if not _keeps_nonzero(node.inputs[0].dtype, value.dtype):
                raise _Unrecognised
            return self.mask(node.inputs[0], form, self._input_axes(node, node.inputs[0], axes))
        if op_type in ("Unsqueeze", "Reshape", "Expand"):
            return self.mask(node.inputs[0], form, self._input_axes(node, node.inputs[0], axes))
        if op_type == "Trilu":
            return self._triangle(node, form, axes)
        if op_type == "LessOrEqual" and form == "keep":
            return self._positions_causal(node, axes)
        return self._key_padding(value, form, axes)

    # -- the parts --

    def _causal(self, value: ir.Value, axes: tuple[int, ...]) -> None:
        if axes != (_QUERY, _KEY) or self.causal_value is not None:
            raise _Unrecognised
        self.causal_value = value

    def _triangle(self, node: ir.Node, form: str, axes: tuple[int, ...]) -> None:
        """``tril(ones)`` keeps key <= query; ``triu(ones, 1)`` blocks key > query: both are causal."""
        ones, diagonal = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        k = 0 if diagonal is None else scalar_constant(diagonal)
        upper = node.attributes.get_int("upper", 1)
        if _rank(ones) != 2 or _constant_fill(ones) != 1:
            raise _Unrecognised
        if (form, upper, k) not in (("keep", 0, 0), ("blocked", 1, 1)):
            raise _Unrecognised
        self._causal(node.outputs[0], axes)

    def _positions_causal(self, node: ir.Node, axes: tuple[int, ...]) -> None:
        """``kv_pos[None, :] <= q_pos[:, None]`` from one ``Range(0, n, 1)``: query i and key i are the same
        position, so it is the causal mask with the diagonal."""
        kv_pos, q_pos = _positions(node.inputs[0], 0), _positions(node.inputs[1], 1)
        if kv_pos is None or kv_pos is not q_pos:
            raise _Unrecognised
        self._causal(node.outputs[0], axes)

    def _key_padding(self, value: ir.Value, form: str, axes: tuple[int, ...]) -> None:
        if axes != (_BATCH, _KEY) or self.key_padding is not None:
            raise _Unrecognised
        self.key_padding, self.padding_marks_real = value, form == "keep"


def _keeps_nonzero(source: ir.DataType, target: ir.DataType) -> bool:
    """Whether a Cast from ``source`` to ``target`` maps zero to zero and nonzero to nonzero."""
    if target == ir.DataType.BOOL or source == ir.DataType.BOOL:
        return True
    if source in _INTEGERS:
        return target in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT64)
    return source == ir.DataType.FLOAT and target == ir.DataType.DOUBLE


def _positions(value: ir.Value, axis: int) -> ir.Value | None:
    """The Range behind ``Unsqueeze(Range(0, n, 1), axis)``, or None."""
    unsqueeze = _producer(value, "Unsqueeze")
    if unsqueeze is None or _ints(unsqueeze.inputs[1]) not in ([axis], [axis - 2]):
        return None
    arange = _producer(unsqueeze.inputs[0], "Range")
    if arange is None or scalar_constant(arange.inputs[0]) != 0 or scalar_constant(arange.inputs[2]) != 1:
        return None
    return arange.outputs[0]


def analyse_bias(bias: ir.Value | None) -> MaskParts | None:
    """Decompose an additive attention bias (0 = attend, a masking fill = masked); None when it is not
    exactly key padding and/or causal."""
    if bias is None or bias.shape is None or not 2 <= bias.shape.rank() <= 4:
        return None
    reader = _Reader()
    try:
        reader.bias(bias, (_BATCH, -3, _QUERY, _KEY)[4 - bias.shape.rank() :])
    except _Unrecognised:
        return None
    if reader.key_padding is None and reader.causal_value is None:
        return None
    return MaskParts(
        fill=float(min(reader.fills)),
        key_padding=reader.key_padding,
        padding_marks_real=reader.padding_marks_real,
        causal=reader.causal_value is not None,
        causal_value=reader.causal_value,
    )


def analyse_bias_for(bias: ir.Value | None, batch, q_len, kv_len) -> MaskParts | None:
    """What ``bias`` is for an op over [batch, q_len] queries and [batch, kv_len] keys: ``analyse_bias``'s
    reading when it fits the op, else what probing the bias finds (``mask_probe``); None when neither reads
    it as key padding and/or causal (plus terms that mask nothing)."""
    parts = _fitting(analyse_bias(bias), batch, q_len, kv_len)
    if parts is not None or bias is None or None in (batch, q_len, kv_len):
        return parts
    probed = probe_bias(bias, (batch, q_len, kv_len))
    if probed is None:
        return _with_computed_term(bias, batch, q_len, kv_len)
    return MaskParts(
        fill=probed.fill,
        key_padding=probed.key_padding,
        padding_marks_real=probed.padding_marks_real,
        causal=probed.causal,
        bias_terms=probed.bias_terms,
    )


def _with_computed_term(bias: ir.Value, batch, q_len, kv_len) -> MaskParts | None:
    """``Add(term, mask)`` where ``term`` is computed from the activations (DeBERTa's c2p + p2c, [batch, heads,
    q_len, kv_len]) and ``mask`` is read as key padding and/or causal: the mask's parts, ``term`` kept as the op's
    bias. A term computed from activations is the scores' own, not a mask to read: kept whole, it is exact."""
    if (node := _producer(bias, "Expand")) is not None:  # upstream's broadcast over heads; the term has them
        bias = node.inputs[0]
    node = _producer(bias, "Add")
    if node is None:
        return None
    computed = [term for term in node.inputs if reads_activations(term)]
    if len(computed) != 1:
        return None
    term, mask = computed[0], next(other for other in node.inputs if other is not computed[0])
    # attention_bias broadcasts batch and heads, not q and kv.
    if term.shape is None or term.shape.rank() != 4 or list(term.shape)[2:] != [q_len, kv_len]:
        return None
    parts = analyse_bias_for(mask, batch, q_len, kv_len)
    if parts is None or reads_activations(mask):
        return None
    return replace(parts, bias_terms=(term, *parts.bias_terms))


def holds_score_terms(bias: ir.Value | None) -> bool:
    """Whether ``bias`` adds a term computed from the activations to the scores (DeBERTa's c2p + p2c)."""
    if (node := _producer(bias, "Expand")) is not None:
        bias = node.inputs[0]
    node = _producer(bias, "Add")
    return node is not None and any(reads_activations(term) for term in node.inputs)


def _fitting(parts: MaskParts | None, batch, q_len, kv_len) -> MaskParts | None:
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
