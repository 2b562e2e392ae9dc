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
    found = [_projection(value, role) for value, role in zip(node.inputs[:3], ("query", "key", "value"),
                                                              strict=True)]
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
            if array is not None and array.ndim == 1 and inner is not None and inner.op_type == "MatMul" \
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
    node.replace_input_with(0, packed)
    node.replace_input_with(1, None)
    node.replace_input_with(2, None)
