"""Each ``GroupQueryAttention`` whose query, key and value are three projections of one input, on one MatMul
with the three weights side by side, feeding the op's packed ``query`` (its key and value inputs empty).

Why: one [hidden, (heads + 2 kv_heads) * head_dim] MatMul reads the input once and is one kernel launch instead of
three (and, quantized, one MatMulNBits); the op splits the packed rows itself (its ``query`` input: "packed QKV with
shape (batch_size, sequence_length, d) where d is (num_heads * head_size + 2 * kv_num_heads * head_size)").

What is rewritten, found structurally: the op's query, key and value each ``MatMul(x, W)`` with the same ``x`` and a
constant 2-D ``W``, optionally + a constant 1-D bias (Qwen2's projections), each read by nothing but the op, their
widths heads * head_dim, kv_heads * head_dim twice. Where one is not (a norm per head between the projection and
the op, Qwen3's q/k norms; a rotary outside the op, ``fusion.rotary_gqa`` not applied) the op keeps its three
inputs, with one line saying why. The same products, summed in the same order, so the numbers are the same.

A projection laid out per head (GPT-NeoX's ``query_key_value``: [q k v] of each head side by side, split in the
graph after a view into heads) packs too: its weight columns and bias are reordered once, at export, into
[q heads | k heads | v heads], and the view, split and merges go (``_projection_per_head``).

A projection already laid out [q heads | k heads | v heads] and cut into q, k and v in the graph (Phi-3's and
Phi-4-mini's ``qkv_proj``: three Slices or one Split of its output on the last axis, contiguous, in that order,
heads * head_dim, kv_heads * head_dim twice wide) is the packed query as it is: the op reads it whole and the cuts
go, no weight touched (``_sliced_packed``). What produced it does not matter (a MatMul, + a bias, a MatMulNBits):
the op splits those columns exactly where the cuts were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from mha_deploy.exporters.fusion.attention_rewrite import AttentionRewriteReport, rewritten
from mha_deploy.exporters.fusion.constant_values import constant_array

_PREFIX = "qkv."
_DOMAIN = "com.microsoft"
REWRITE = "q/k/v packed into one MatMul"  # how a line names this pass


class _Refused(Exception):
    """Why one attention keeps three projections (one line)."""


@dataclass
class _Projection:
    """One projection: its MatMul or MatMulNBits, ``weight`` [hidden, width] (MatMulNBits: its constant inputs after
    the activation, each with the output width first), the bias added after it."""

    matmul: ir.Node
    weight: np.ndarray | list[np.ndarray | None]
    bias: np.ndarray | None
    width: int


def pack_qkv(model: onnx.ModelProto) -> tuple[onnx.ModelProto, AttentionRewriteReport]:
    """``model`` with each ``GroupQueryAttention``'s three projections packed into one (the module docstring), and
    what was done; ``model`` itself where nothing was."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    attentions = [node for node in graph if node.op_type == "GroupQueryAttention" and node.domain == _DOMAIN]
    report = AttentionRewriteReport(REWRITE, attentions=len(attentions))
    for node in attentions:
        try:
            packed = _sliced_packed(node)
            if packed is not None:
                _read_packed(node, packed)
                report.done += 1
                continue
            projections = _projections(node)
        except _Refused as exc:
            report.refused.append(f"{node.name}: {exc}")
            continue
        _pack(graph, node, projections)
        report.done += 1
    return rewritten(model, ir_model, report)


def _projections(node: ir.Node) -> list[_Projection]:
    heads = node.attributes.get_int("num_heads", 0)
    kv_heads = node.attributes.get_int("kv_num_heads", 0)
    if len(node.inputs) < 3 or any(value is None for value in node.inputs[:3]):
        raise _Refused("its query, key and value are not three inputs (packed already?)")
    try:
        found = [_projection(value, role) for value, role in zip(node.inputs[:3], ("query", "key", "value"),
                                                                  strict=True)]
    except _Refused:
        per_head = _projection_per_head(node.inputs[:3])
        if per_head is None:
            raise
        if heads != kv_heads:  # each head's q, k and v are one width: the op must read as many kv heads as heads
            raise _Refused(f"its one projection holds q, k and v per head but it reads {kv_heads} of {heads} "
                           "heads as key/value heads") from None
        return [per_head]
    source = found[0].matmul.inputs[0]
    if any(p.matmul.inputs[0] is not source for p in found):
        raise _Refused("its query, key and value are projections of different inputs")
    widths = [p.width for p in found]
    if widths[1] != widths[2] or widths[0] * kv_heads != widths[1] * heads:
        raise _Refused(f"its projections are {widths} wide, not {heads} and {kv_heads} heads of one head size")
    if len({p.matmul.op_type for p in found}) != 1:
        raise _Refused("its projections are not all MatMul or all MatMulNBits")
    if found[0].matmul.op_type == "MatMul":
        if len({p.weight.shape[0] for p in found}) != 1 or len({p.weight.dtype for p in found}) != 1:
            raise _Refused("its projections' weights differ in rows or type")
    else:
        # Quantized: blocks along K, one row of blocks per output column, so the rows of the three stack.
        kept = {name: {p.matmul.attributes.get_int(name, -1) for p in found}
                for name in ("K", "bits", "block_size", "accuracy_level")}
        present = {tuple(array is None for array in p.weight) for p in found}
        if any(len(values) != 1 for values in kept.values()) or len(present) != 1:
            raise _Refused("its quantized projections differ in K, bits, block size, accuracy or inputs")
    return found


def _projection(value: ir.Value, role: str) -> _Projection:
    """``value`` read as MatMul(x, W) [+ b], each step read by the op only."""
    if value.is_graph_output() or len(value.uses()) != 1:
        raise _Refused(f"its {role} is read by more than the op")
    producer = value.producer()
    bias = None
    if producer is not None and producer.op_type == "Add" and len(producer.inputs) == 2:
        for product, addend in (producer.inputs, producer.inputs[::-1]):
            array = constant_array(addend)
            inner = product.producer()
            # the bias an Add after the product, quantized or not (GPT-NeoX's int4 query_key_value)
            if array is not None and array.ndim == 1 and inner is not None \
                    and (inner.op_type == "MatMul" or (inner.op_type == "MatMulNBits" and inner.domain == _DOMAIN)) \
                    and len(product.uses()) == 1 and not product.is_graph_output():
                bias, producer = array, inner
                break
    if producer is not None and producer.op_type == "MatMulNBits" and producer.domain == _DOMAIN:
        return _quantized(producer, bias, role)
    if producer is None or producer.op_type != "MatMul":
        raise _Refused(f"its {role} is not a projection (MatMul, + a bias) of the layer's input (a norm between?)")
    weight = constant_array(producer.inputs[1])
    if weight is None or weight.ndim != 2 or (bias is not None and bias.shape != (weight.shape[1],)):
        raise _Refused(f"its {role}'s projection weight is not a constant [hidden, width] (with a bias of width)")
    return _Projection(producer, weight, bias, weight.shape[1])


def _projection_per_head(values: list[ir.Value]) -> _Projection | None:
    """``values`` (query, key, value) read as one projection laid out per head, GPT-NeoX's ``query_key_value``
    ([q k v] of each head side by side): proj [batch, seq, heads * 3 * head_dim] viewed as [batch, seq, heads,
    3 * head_dim], transposed to [batch, heads, seq, 3 * head_dim], split in three equal parts on the last axis, each
    transposed back and merged to [batch, seq, heads * head_dim]. Returns that projection with its weight columns
    (and bias) reordered once into [q heads | k heads | v heads], the packed query's layout (each column the same
    product as before, so the numbers are the same); None where ``values`` are not that."""
    split = None
    for index, value in enumerate(values):
        merge = _single_reader_producer(value, "Reshape")
        shape = constant_array(merge.inputs[1]) if merge is not None and len(merge.inputs) == 2 else None
        # [0, 0, width]: batch and seq copied (allowzero 0), the last two axes merged
        if shape is None or shape.tolist()[:2] != [0, 0] or len(shape) != 3 \
                or merge.attributes.get_int("allowzero", 0) != 0:
            return None
        back = _single_reader_producer(merge.inputs[0], "Transpose")
        if back is None or list(back.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
            return None
        part = back.inputs[0]
        producer = _single_reader_producer(part, "Split")
        if producer is None or part.index() != index or (split is not None and producer is not split):
            return None
        split = producer
    sizes = constant_array(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
    equal = (sizes is not None and len(set(sizes.tolist())) == 1) or (
        sizes is None and split.attributes.get_int("num_outputs", 0) == 3)
    if len(split.outputs) != 3 or split.attributes.get_int("axis", 0) not in (3, -1) or not equal:
        return None
    heads_first = _single_reader_producer(split.inputs[0], "Transpose")
    if heads_first is None or list(heads_first.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    view = _single_reader_producer(heads_first.inputs[0], "Reshape")
    if view is None:
        return None
    projected, viewed = view.inputs[0], view.outputs[0]
    # [batch, seq, width] -> [batch, seq, heads, 3 * head_dim]: the two last axes known, the first two kept
    if viewed.shape is None or projected.shape is None or viewed.shape.rank() != 4 or projected.shape.rank() != 3:
        return None
    heads, per_head = viewed.shape[2], viewed.shape[3]
    if not isinstance(heads, int) or not isinstance(per_head, int) or per_head % 3 \
            or list(viewed.shape[:2]) != list(projected.shape[:2]):
        return None
    try:
        projection = _projection(projected, "query/key/value")
    except _Refused:
        return None
    if projection.width != heads * per_head:
        return None
    # packed column j * heads * head_dim + h * head_dim + d (part j of head h) reads the projection's column
    # h * 3 * head_dim + j * head_dim + d
    order = np.arange(projection.width).reshape(heads, 3, per_head // 3).transpose(1, 0, 2).reshape(-1)
    if isinstance(projection.weight, np.ndarray):
        weight = projection.weight[:, order]
    else:  # MatMulNBits: one row per output column
        weight = [array[order] if array is not None else None for array in projection.weight]
    bias = projection.bias[order] if projection.bias is not None else None
    return _Projection(projection.matmul, weight, bias, projection.width)


def _sliced_packed(node: ir.Node) -> ir.Value | None:
    """The one tensor [batch, seq, width] the op's query, key and value are cut from, where they are its columns
    [0, q), [q, q + kv), [q + kv, width) with q = heads * head_dim, kv = kv_heads * head_dim (three Slices or one
    Split on its last axis): that tensor is the op's packed query as it is. None where they are not cuts of one
    tensor; refused, saying why, where they are but not in that layout."""
    if len(node.inputs) < 3 or any(value is None for value in node.inputs[:3]):
        return None
    cuts = [value.producer() for value in node.inputs[:3]]
    if any(cut is None or cut.op_type not in ("Slice", "Split") or cut.domain != "" for cut in cuts):
        return None
    source = cuts[0].inputs[0]
    if any(cut.inputs[0] is not source for cut in cuts):
        return None
    width = _last_axis_width(source)
    rank = next((value.shape.rank() for value in (source, *node.inputs[:3]) if value.shape is not None), None)
    if width is None or rank != 3:
        raise _Refused("its query, key and value are cuts of one tensor whose width or rank is not known")
    spans = [_span(cut, value, width, rank) for cut, value in zip(cuts, node.inputs[:3], strict=True)]
    if None in spans:
        raise _Refused("its query, key and value are cuts of one tensor, not all constant, step-1 cuts of its last "
                       "axis")
    heads = node.attributes.get_int("num_heads", 0)
    kv_heads = node.attributes.get_int("kv_num_heads", 0)
    head_dim, rest = divmod(width, heads + 2 * kv_heads) if heads > 0 and kv_heads > 0 else (0, 1)
    q, kv = heads * head_dim, kv_heads * head_dim
    if rest or spans != [(0, q), (q, q + kv), (q + kv, width)]:
        raise _Refused(f"its query, key and value are columns {spans} of one tensor {width} wide, not [q | k | v] "
                       f"of {heads} and {kv_heads} heads of one size")
    return source


def _span(cut: ir.Node, value: ir.Value, width: int, rank: int) -> tuple[int, int] | None:
    """The columns [start, end) of the last axis that ``cut`` (a Slice, or the Split output ``value``) takes; None
    where it cuts another axis, steps, or has bounds that are not constants."""
    def last(axis: int) -> bool:
        return axis in (-1, rank - 1)

    if cut.op_type == "Slice":
        bounds = [constant_array(v) if v is not None else None for v in list(cut.inputs[1:5]) + [None] * 4][:4]
        starts, ends, axes, steps = bounds
        if starts is None or ends is None or axes is None or starts.size != 1 or ends.size != 1 \
                or axes.size != 1 or not last(int(axes[0])) or (steps is not None and steps.ravel().tolist() != [1]):
            return None
        # negative bounds count from the end; both clamp to [0, width] (Slice's own rule for step 1)
        start, end = (min(max(int(b[0]) + width if int(b[0]) < 0 else int(b[0]), 0), width) for b in (starts, ends))
        return start, end
    if not last(cut.attributes.get_int("axis", 0)):
        return None
    given = constant_array(cut.inputs[1]) if len(cut.inputs) > 1 and cut.inputs[1] is not None else None
    if given is not None:
        sizes = given.ravel().tolist()
    elif "split" in cut.attributes:  # before opset 13, the sizes an attribute
        sizes = list(cut.attributes.get_ints("split"))
    elif len(cut.inputs) > 1 and cut.inputs[1] is not None:
        return None  # sizes computed in the graph
    else:  # equal parts, the last one smaller where the width does not divide (opset 18's num_outputs)
        parts = len(cut.outputs)
        chunk = -(-width // parts)
        sizes = [chunk] * (parts - 1) + [width - chunk * (parts - 1)]
    if sum(sizes) != width or len(sizes) != len(cut.outputs):
        return None
    start = sum(sizes[:value.index()])
    return start, start + sizes[value.index()]


def _last_axis_width(value: ir.Value) -> int | None:
    """``value``'s last axis, from its shape or, where the graph does not record it, from the projection producing
    it (a MatMul's constant weight, a MatMulNBits' N, a bias added after either)."""
    if value.shape is not None and value.shape.rank() and isinstance(value.shape[-1], int):
        return value.shape[-1]
    producer = value.producer()
    if producer is None:
        return None
    if producer.op_type == "Add" and len(producer.inputs) == 2:
        for addend in producer.inputs:
            array = constant_array(addend)
            if array is not None and array.ndim == 1 and array.size > 1:
                return array.size
        return None
    if producer.op_type == "MatMulNBits" and producer.domain == _DOMAIN:
        return producer.attributes.get_int("N", 0) or None
    if producer.op_type == "MatMul":
        weight = constant_array(producer.inputs[1])
        return weight.shape[-1] if weight is not None and weight.ndim == 2 else None
    return None


def _single_reader_producer(value: ir.Value, op_type: str) -> ir.Node | None:
    """The ``op_type`` node (default domain) producing ``value``, where nothing but one node reads ``value``."""
    producer = value.producer()
    if producer is None or producer.op_type != op_type or producer.domain != "" or value.is_graph_output() \
            or len(value.uses()) != 1:
        return None
    return producer


def _quantized(node: ir.Node, bias: np.ndarray | None, role: str) -> _Projection:
    """A MatMulNBits projection: its B, scales, zero points and bias as [N, ...] arrays (None where absent)."""
    width = node.attributes.get_int("N", 0)
    inputs = list(node.inputs[1:]) + [None] * (6 - len(node.inputs))
    if inputs[3] is not None:
        raise _Refused(f"its {role}'s quantized projection takes g_idx")
    arrays = []
    for value in inputs[:2] + inputs[2:3] + inputs[4:5]:  # B, scales, zero points, bias (not g_idx)
        array = constant_array(value) if value is not None else None
        if value is not None and (array is None or array.size % width):
            raise _Refused(f"its {role}'s quantized projection has an input that is not a constant per column")
        arrays.append(array.reshape(width, -1) if array is not None else None)
    if arrays[0] is None or arrays[1] is None or (bias is not None and bias.shape != (width,)):
        raise _Refused(f"its {role}'s quantized projection has no constant weight and scales")
    return _Projection(node, arrays, bias, width)


def _pack(graph: ir.Graph, node: ir.Node, projections: list[_Projection]) -> None:
    name = node.name or "GroupQueryAttention"

    def initializer(array: np.ndarray, what: str) -> ir.Value:
        tensor = ir.tensor(np.ascontiguousarray(array), name=f"{_PREFIX}{name}.{what}")
        value = ir.Value(name=tensor.name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
        graph.register_initializer(value)
        return value

    source = projections[0].matmul.inputs[0]
    width = sum(p.width for p in projections)
    first = projections[0].matmul
    if first.op_type == "MatMul":
        weight = np.concatenate([p.weight for p in projections], axis=1)
        dtype = weight.dtype
        matmul = ir.Node("", "MatMul", [source, initializer(weight, "weight")],
                         outputs=[ir.Value(name=f"{_PREFIX}{name}.packed")], graph=graph,
                         name=f"{_PREFIX}{name}.matmul")
    else:
        inputs: list[ir.Value | None] = [source]
        for index, what in enumerate(("weight", "scales", "zero_points", "bias")):
            parts = [p.weight[index] for p in projections]
            if parts[0] is None:
                inputs.append(None)
                continue
            shape = first.inputs[1 + index if index < 3 else 5].const_value.shape
            stacked = np.concatenate(parts, axis=0)
            # the original layout with the stacked width first: B [N, blocks, blob], scales [N * blocks] or [N, blocks]
            inputs.append(initializer(stacked.reshape((width, *shape[1:]) if len(shape) > 1 else (-1,)), what))
        inputs.insert(4, None)  # g_idx (refused where given) sits before the bias
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = [ir.AttrInt64(k, first.attributes.get_int(k)) for k in ("K", "bits", "block_size",
                                                                                  "accuracy_level")
                      if k in first.attributes]
        attributes.append(ir.AttrInt64("N", width))
        dtype = projections[0].weight[1].dtype
        matmul = ir.Node(_DOMAIN, "MatMulNBits", inputs, attributes,
                         outputs=[ir.Value(name=f"{_PREFIX}{name}.packed")], graph=graph,
                         name=f"{_PREFIX}{name}.matmul")
    packed = matmul.outputs[0]
    if any(p.bias is not None for p in projections):
        bias = np.concatenate([p.bias if p.bias is not None else np.zeros(p.width, dtype)
                               for p in projections]).astype(dtype)
        add = ir.Node("", "Add", [packed, initializer(bias, "bias")],
                      outputs=[ir.Value(name=f"{_PREFIX}{name}.packed_bias")], graph=graph,
                      name=f"{_PREFIX}{name}.bias")
        packed = add.outputs[0]
    query = node.inputs[0]
    packed.type = query.type
    if query.shape is not None and query.shape.rank() == 3:
        packed.shape = ir.Shape([query.shape[0], query.shape[1], width])
    _read_packed(node, packed)


def _read_packed(node: ir.Node, packed: ir.Value) -> None:
    """``node`` reading ``packed`` [batch, seq, (heads + 2 kv_heads) * head_dim] as its query, key and value empty."""
    node.replace_input_with(0, packed)
    node.replace_input_with(1, None)
    node.replace_input_with(2, None)
