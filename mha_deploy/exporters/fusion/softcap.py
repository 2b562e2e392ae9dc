"""Soft-capped attention scores (Gemma-2's ``attn_logit_softcapping``): ``tanh(scores / cap) * cap`` between the
scaled Q·Kᵀ and the mask, read from a traced graph and carried to ``GroupQueryAttention``'s ``softcap``.

Why its own module: of ONNX Runtime's contrib attention ops only ``GroupQueryAttention`` caps scores (its CPU kernel,
``gqa_attention_base.h``, applies ``softcap * tanh(x / softcap)`` to the scaled scores of each query's visible keys,
window or not, before the softmax: Gemma-2's order). ``MultiHeadAttention`` has no such attribute, and dropping the
cap changes every score over it. So the fusion pipeline leaves a soft-capped attention as the module wrote it (named
in ``FusionReport.softcapped`` and its warning, exact), and only the ragged cache layout (``fusion.ragged_cache``),
whose every attention becomes ``GroupQueryAttention``, fuses it: ``as_capped_mha`` first writes it as a
``MultiHeadAttention`` over the same query, keys, values and additive mask, with the cap recorded beside it (never
in the file: the ragged rewrite either replaces every such op or refuses and keeps the holes file as it was).

Hugging Face's eager Gemma-2 attention traces as

    MatMul(q, Transpose(k, [0, 1, 3, 2])) -> Mul(scaling) -> Div(cap) -> Tanh -> Mul(cap) -> Add(mask) -> Softmax
      -> MatMul(probabilities, v)

with q [batch, heads, seq, head_dim] (rotated after the head split) and k, v the cached keys and values repeated to
the query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mha_deploy.exporters.fusion.constant_values import scalar_constant

_PREFIX = "softcap."
_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class SoftcappedAttention:
    """One soft-capped attention: ``softmax`` over ``Add(tanh(scaled / cap) * cap, bias)`` of ``scores`` =
    MatMul(query, keys_t) times ``scale``, weighting values in ``weighted``."""

    softmax: ir.Node
    scores: ir.Node
    weighted: ir.Node
    scale: float
    cap: float
    bias: ir.Value | None


def _constant_operand(node: ir.Node) -> tuple[ir.Value, float] | None:
    """(the other operand, the one-element constant) of a binary ``node``, the constant second for Div."""
    first, second = node.inputs[0], node.inputs[1]
    value = scalar_constant(second)
    if value is not None:
        return first, float(value)
    if node.op_type == "Mul" and (value := scalar_constant(first)) is not None:
        return second, float(value)
    return None


def _producer(value: ir.Value | None, op: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op and node.domain in ("", "ai.onnx") else None


def _capped(value: ir.Value) -> tuple[ir.Value, float] | None:
    """(the scores before the cap, cap) where ``value`` is Mul(Tanh(Div(scores, cap)), cap), the same cap twice
    (Mul by 1 / cap in place of the Div too), else None."""
    multiply = _producer(value, "Mul")
    outer = _constant_operand(multiply) if multiply is not None else None
    tanh = _producer(outer[0], "Tanh") if outer is not None else None
    if tanh is None:
        return None
    inner = _producer(tanh.inputs[0], "Div") or _producer(tanh.inputs[0], "Mul")
    divided = _constant_operand(inner) if inner is not None else None
    if divided is None or outer[1] <= 0:
        return None
    cap = outer[1]
    inverse = divided[1] if inner.op_type == "Div" else 1.0 / divided[1] if divided[1] else 0.0
    if not np.isclose(inverse, cap, rtol=1e-6):
        return None
    return divided[0], cap


def softcapped_attention(softmax: ir.Node) -> SoftcappedAttention | None:
    """``softmax`` read as a soft-capped attention (the module docstring), or None."""
    if softmax.op_type != "Softmax" or softmax.domain not in ("", "ai.onnx") \
            or softmax.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    value, bias = softmax.inputs[0], None
    add = _producer(value, "Add")
    if add is not None:
        for index in (0, 1):
            if _capped(add.inputs[index]) is not None:
                value, bias = add.inputs[index], add.inputs[1 - index]
                break
    capped = _capped(value)
    if capped is None:
        return None
    scaled, cap = capped
    scale, scores = 1.0, _producer(scaled, "MatMul")
    if scores is None:
        step = _producer(scaled, "Mul") or _producer(scaled, "Div")
        factor = _constant_operand(step) if step is not None else None
        if factor is None or factor[1] == 0:
            return None
        scale = factor[1] if step.op_type == "Mul" else 1.0 / factor[1]
        scores = _producer(factor[0], "MatMul")
    uses = [use.node for use in softmax.outputs[0].uses()]
    if scores is None or len(uses) != 1 or uses[0].op_type != "MatMul" or uses[0].inputs[0] is not softmax.outputs[0]:
        return None
    return SoftcappedAttention(softmax, scores, uses[0], scale, cap, bias)


def softcapped_attentions(graph: ir.Graph) -> list[SoftcappedAttention]:
    return [found for node in graph.all_nodes() if (found := softcapped_attention(node)) is not None]


def as_capped_mha(graph: ir.Graph) -> dict[ir.Node, float]:
    """Each soft-capped attention of ``graph`` rewritten as a contrib ``MultiHeadAttention`` (its 4-D query, keys
    and values merged to [batch, seq, heads * head_dim], its mask as ``attention_bias``, its scale as ``scale``)
    whose output is read where the attention's was: op -> its cap, which the op does not apply (the caller puts it
    on ``GroupQueryAttention``; the graph is not a valid file until then). An attention whose query, keys or
    values are not [batch, heads, seq, head_dim] with static heads is left as it was."""
    capped = {}
    for found in softcapped_attentions(graph):
        keys_t = found.scores.inputs[1]
        transpose = _producer(keys_t, "Transpose")
        if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
            continue
        query, keys, values = found.scores.inputs[0], transpose.inputs[0], found.weighted.inputs[1]
        shapes = [value.shape for value in (query, keys, values)]
        if any(shape is None or shape.rank() != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int)
               for shape in shapes) or len({(shape[1], shape[3]) for shape in shapes}) != 1:
            continue
        heads, head_dim = shapes[0][1], shapes[0][3]
        name = found.softmax.name or f"attention{len(capped)}"
        merged = [_merge_heads(graph, value, heads * head_dim, f"{name}.{role}")
                  for value, role in ((query, "query"), (keys, "keys"), (values, "values"))]
        attributes = [ir.AttrInt64("num_heads", heads), ir.AttrFloat32("scale", found.scale)]
        node = ir.Node(_DOMAIN, "MultiHeadAttention", [*merged, None, None, found.bias], attributes,
                       outputs=[ir.Value(name=_PREFIX + name + ".out")], graph=graph, name=_PREFIX + name)
        out = node.outputs[0]
        out.dtype = query.dtype
        out.shape = ir.Shape([shapes[0][0], shapes[0][2], heads * head_dim])
        _read_as_attention_output(graph, found.weighted.outputs[0], out, heads, head_dim, f"{name}.out")
        capped[node] = found.cap
    return capped


def _merge_heads(graph: ir.Graph, value: ir.Value, hidden: int, name: str) -> ir.Value:
    """[batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim] (Transpose, Reshape: the form the ragged
    rewrite traces back to the 4-D cache and projection)."""
    transpose = ir.Node("", "Transpose", [value], [ir.AttrInt64s("perm", [0, 2, 1, 3])],
                        outputs=[ir.Value(name=_PREFIX + name + ".bsnh")], graph=graph, name=_PREFIX + name + ".bsnh")
    reshape = ir.Node("", "Reshape", [transpose.outputs[0], _shape(graph, [0, 0, hidden], name)],
                      outputs=[ir.Value(name=_PREFIX + name + ".merged")], graph=graph,
                      name=_PREFIX + name + ".merged")
    out = reshape.outputs[0]
    out.dtype = value.dtype
    out.shape = ir.Shape([value.shape[0], value.shape[2], hidden])
    return out


def _read_as_attention_output(graph: ir.Graph, weighted: ir.Value, out: ir.Value, heads: int, head_dim: int,
                              name: str) -> None:
    """Make what read ``weighted`` [batch, heads, seq, head_dim] read ``out`` [batch, seq, heads * head_dim]: the
    module's own head merge (Transpose [0, 2, 1, 3], Reshape to 3-D) replaced by ``out`` itself where that is all
    that reads it, else ``out`` split back into heads."""
    uses = weighted.uses()
    transpose = uses[0].node if len(uses) == 1 else None
    if transpose is not None and transpose.op_type == "Transpose" and len(transpose.outputs[0].uses()) == 1 \
            and list(transpose.attributes.get_ints("perm", [])) == [0, 2, 1, 3]:
        reshape = transpose.outputs[0].uses()[0].node
        merged = reshape.outputs[0]
        if reshape.op_type == "Reshape" and merged.shape is not None and merged.shape.rank() == 3 \
                and merged.shape[2] == heads * head_dim and not merged.is_graph_output():
            merged.replace_all_uses_with(out)
            return
    split = ir.Node("", "Reshape", [out, _shape(graph, [0, 0, heads, head_dim], name)],
                    outputs=[ir.Value(name=_PREFIX + name + ".bsnh")], graph=graph, name=_PREFIX + name + ".bsnh")
    back = ir.Node("", "Transpose", [split.outputs[0]], [ir.AttrInt64s("perm", [0, 2, 1, 3])],
                   outputs=[ir.Value(name=_PREFIX + name + ".bnsh")], graph=graph, name=_PREFIX + name + ".bnsh")
    back.outputs[0].dtype, back.outputs[0].shape = weighted.dtype, weighted.shape
    weighted.replace_all_uses_with(back.outputs[0])


def _shape(graph: ir.Graph, dims: list[int], name: str) -> ir.Value:
    tensor = ir.tensor(np.array(dims, np.int64), name=f"{_PREFIX}{name}.shape{len(dims)}")
    value = ir.Value(name=tensor.name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    graph.register_initializer(value)
    return value
