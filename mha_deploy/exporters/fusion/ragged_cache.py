"""A user's causal LM's KV-cache graph (``exporters.own_kv_cache``, narrowed and fused) -> the "ragged" layout:
each attention is contrib ``GroupQueryAttention`` reading and writing the cache in place.

Why: in the "holes" layout each attention's keys are ``Concat(past_key_values.i.key, new keys)``, which is also
``present.i.key``: every step copies the whole cache, and a left-padded row keeps its padding in the cache as
holes that an additive bias (built from the mask by the module's own ops) hides. ``GroupQueryAttention`` takes
each row's length instead (``seqlens_k``), attends over that row's positions only, and writes this call's keys
and values at each row's own positions; bound to the same buffer as its past, present is updated in place.
Measured on the benchmark GPT (tests/user_models/tutorial_gpt.py ``build_bench``), batch 16 greedy on ORT 1.31
CPU: 1.67x the holes file's tokens per second, the same tokens.

The file contract of the ragged layout (what a runtime feeds; ``metadata.cache_layout == CACHE_RAGGED``):

- ``input_ids`` [batch, seq]: each row's next ``seq`` tokens. In a first call (no past), rows may be
  right-padded (pads after each row's tokens); later calls have ``seq`` real tokens per row, and ``seq`` > 1
  only for batch 1 (ONNX Runtime's GroupQueryAttention refuses more tokens after a past on several rows).
- ``attention_mask`` int64 [batch, total]: row r's first n_r entries 1, the rest 0 (n_r = the row's tokens so
  far including this call's real ones). Right padding only.
- ``position_ids`` [batch, seq] (when the file takes them): n_r - seq + arange(seq) (a first call: arange).
- ``past_key_values.i.key|value`` [batch, heads, W, head_dim], W >= each row's past length (n_r - seq): row r's
  first n_r - seq positions are its cache, anything after is ignored. ``present.i.key|value`` [batch, heads,
  max(total, W), head_dim]: past with this call's keys/values written at each row's positions; bound to the
  past's own buffer it is updated in place.

What is rewritten, found structurally: each ``com.microsoft.MultiHeadAttention`` whose keys and values are
``Concat(past input, new [batch, heads, seq, head_dim])`` along the length, each Concat read by the op and by
one Identity to a present output; the new keys/values traced back through Transposes and one Reshape to the
[batch, seq, heads * head_dim] projection GroupQueryAttention takes. The op's additive bias must come only from
``attention_mask`` and from shapes (a Shape of any input, constants): what the module's mask ops can then
express is key padding and a pattern over positions; that the pattern is causal (not, say, a sliding window) is
what the export's per-step parity under this layout proves (``own_kv_cache.check_ragged_cache_parity``). The
bias's subgraph, the Concats and the Identities are then dead and removed. ``to_ragged_cache`` says in one line
why it refuses, and the export keeps the holes layout.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from mha_deploy.exporters.fusion.contrib_mha import ATTENTION_BIAS, BIAS, KEY_PADDING_MASK, PAST_KEY, optional_input

_PREFIX = "ragged."
_DOMAIN = "com.microsoft"


class RaggedRefused(Exception):
    """Why a graph cannot take the ragged layout (one line, for the export's warning)."""


def to_ragged_cache(model: onnx.ModelProto, mask: str = "attention_mask") -> onnx.ModelProto:
    """``model`` with every cached attention on ``GroupQueryAttention`` in the ragged layout (the module
    docstring); ``RaggedRefused`` saying why when any one cannot be (``model`` is left as it was)."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    inputs = {value.name: value for value in graph.inputs}
    if mask not in inputs:
        raise RaggedRefused(f"the file takes no {mask}")
    attentions = [node for node in graph if node.op_type == "MultiHeadAttention" and node.domain == _DOMAIN]
    caches = [name for name in inputs if name.startswith("past_key_values.")]
    if not attentions:
        raise RaggedRefused("no attention is fused into contrib MultiHeadAttention (GroupQueryAttention replaces it)")
    plans = [_plan(node, inputs[mask]) for node in attentions]
    if 2 * len(plans) != len(caches):
        raise RaggedRefused(f"{len(plans)} attention(s) read a cache, the file takes {len(caches)} cache inputs")
    lengths, total = _row_lengths(graph, inputs[mask])
    for plan in plans:
        plan.apply(graph, lengths, total)
    RemoveUnusedNodesPass()(ir_model)
    graph.sort()
    return ir.serde.serialize_model(ir_model)


class _Plan:
    """One MultiHeadAttention's rewrite, checked before any is applied."""

    def __init__(self, node, query, keys, values, heads, head_dim, presents, concats):
        self.node, self.query, self.keys, self.values = node, query, keys, values
        self.heads, self.head_dim, self.presents, self.concats = heads, head_dim, presents, concats

    def apply(self, graph: ir.Graph, lengths: ir.Value, total: ir.Value) -> None:
        node = self.node
        attributes = [ir.AttrInt64("num_heads", self.heads), ir.AttrInt64("kv_num_heads", self.heads)]
        scale = node.attributes.get("scale")
        if scale is not None:
            attributes.append(ir.AttrFloat32("scale", scale.as_float()))
        past_key, past_value = (concat.inputs[0] for concat in self.concats)
        outputs = [ir.Value(name=_PREFIX + node.name + ".out"),
                   *(ir.Value(name=_PREFIX + present.name) for present in self.presents)]
        ir.Node(_DOMAIN, "GroupQueryAttention",
                [self.query, self.keys, self.values, past_key, past_value, lengths, total],
                attributes, outputs=outputs, name=_PREFIX + node.name, graph=graph)
        out = node.outputs[0]
        outputs[0].shape, outputs[0].type = out.shape, out.type
        out.replace_all_uses_with(outputs[0])
        if out.is_graph_output():
            _swap_output(graph, out, outputs[0])
        # The present outputs were Identity(Concat): GroupQueryAttention now writes them.
        for present, written in zip(self.presents, outputs[1:], strict=True):
            identity = present.producer()
            written.shape, written.type = present.shape, present.type
            _swap_output(graph, present, written)
            name = present.name
            graph.remove(identity, safe=True)
            written.name = name
        graph.remove(node, safe=True)


def _swap_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    index = next(i for i, value in enumerate(graph.outputs) if value is old)
    graph.outputs[index] = new


def _plan(node: ir.Node, mask: ir.Value) -> _Plan:
    name = node.name or "a MultiHeadAttention"
    if len(node.outputs) != 1 or any(o is not None and o.uses() for o in node.outputs[1:]):
        raise RaggedRefused(f"{name} returns more than its output")
    for index, what in ((BIAS, "a projection bias"), (KEY_PADDING_MASK, "a key padding mask"),
                        (PAST_KEY, "its own past state")):
        if optional_input(node, index) is not None:
            raise RaggedRefused(f"{name} takes {what}")
    heads = node.attributes.get_int("num_heads", 0)
    query = node.inputs[0]
    if query is None or query.shape is None or query.shape.rank() != 3:
        raise RaggedRefused(f"{name}: its query is not [batch, seq, hidden]")
    traced = [_cache_and_new(node.inputs[i], heads, name, role) for i, role in ((1, "keys"), (2, "values"))]
    (key_concat, keys, key_dim), (value_concat, values, value_dim) = traced
    if key_dim != value_dim:
        raise RaggedRefused(f"{name}: keys of {key_dim} and values of {value_dim} per head")
    bias = optional_input(node, ATTENTION_BIAS)
    if bias is not None:
        _check_bias_sources(bias, mask, name)
    presents = [_present_of(concat, node, name) for concat in (key_concat, value_concat)]
    return _Plan(node, query, keys, values, heads, key_dim, presents, (key_concat, value_concat))


def _cache_and_new(grown: ir.Value | None, heads: int, name: str, role: str) -> tuple[ir.Node, ir.Value, int]:
    """(the Concat growing the cache, the [batch, seq, heads * head_dim] projection its new part is, head_dim)."""
    concat = grown.producer() if grown is not None else None
    if concat is None or concat.op_type != "Concat" or concat.attributes.get_int("axis", 0) not in (2, -2) \
            or len(concat.inputs) != 2 or not concat.inputs[0].is_graph_input():
        raise RaggedRefused(f"{name}: its {role} are not a cache input grown by a Concat along the length")
    past = concat.inputs[0]
    shape = past.shape
    if shape is None or shape.rank() != 4 or shape[1] != heads or not isinstance(shape[3], int):
        raise RaggedRefused(f"{name}: {past.name} is not [batch, {heads} heads, past_seq, head_dim]")
    head_dim = shape[3]
    # Follow the new part up through Transposes to a Reshape of [batch, seq, hidden] into [batch, seq, heads, d]:
    # the Transposes together must make that [batch, heads, seq, d].
    value, perm = concat.inputs[1], list(range(4))
    while (producer := value.producer()) is not None and producer.op_type == "Transpose":
        step = list(producer.attributes.get_ints("perm", [3, 2, 1, 0]))
        perm = [step[axis] for axis in perm]
        value = producer.inputs[0]
    if producer is None or producer.op_type != "Reshape" or perm != [0, 2, 1, 3]:
        raise RaggedRefused(f"{name}: its new {role} are not a [batch, seq, hidden] projection split into heads")
    projection = producer.inputs[0]
    shape = projection.shape
    if shape is None or shape.rank() != 3 or shape[2] != heads * head_dim:
        raise RaggedRefused(f"{name}: its new {role} come from {projection.name}, not [batch, seq, "
                            f"{heads * head_dim}]")
    return concat, projection, head_dim


def _present_of(concat: ir.Node, attention: ir.Node, name: str) -> ir.Value:
    """The present output that is an Identity of the grown cache, which nothing else may read (the op then
    owns the cache's update)."""
    grown = concat.outputs[0]
    presents = [use.node.outputs[0] for use in grown.uses()
                if use.node.op_type == "Identity" and use.node.outputs[0].is_graph_output()]
    others = [use.node for use in grown.uses() if use.node is not attention and use.node.op_type != "Identity"]
    if len(presents) != 1 or others or grown.is_graph_output() or len(grown.uses()) != 2:
        raise RaggedRefused(f"{name}: its grown cache is read by more than the op and one present output")
    return presents[0]


def _check_bias_sources(bias: ir.Value, mask: ir.Value, name: str) -> None:
    """The additive bias computed from ``mask`` and shapes only: no token, position or cache value reaches it
    (ragged rows differ from padded ones in exactly those)."""
    seen, stack = set(), [bias]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.is_graph_input():
            if value is not mask:
                raise RaggedRefused(f"{name}: its mask reads {value.name}, not only the attention mask and shapes")
            continue
        producer = value.producer()
        if producer is None or producer.op_type == "Shape":
            continue  # an initializer, or a shape (the length of whatever it reads)
        if any(attr.type == ir.AttributeType.GRAPH for attr in producer.attributes.values()):
            raise RaggedRefused(f"{name}: its mask is computed inside a {producer.op_type} subgraph")
        stack.extend(v for v in producer.inputs if v is not None)


def _row_lengths(graph: ir.Graph, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(seqlens_k int32 [batch]: each row's real tokens minus one, total_sequence_length int32 scalar: the
    mask's width), computed once for every attention."""
    def constant(name, array):
        tensor = ir.tensor(np.asarray(array), name=_PREFIX + name)
        value = ir.Value(name=_PREFIX + name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
        graph.register_initializer(value)
        return value

    def node(op, inputs, out, **attributes):
        made = ir.Node("", op, inputs, [ir.AttrInt64(k, v) if isinstance(v, int) else ir.AttrInt64s(k, v)
                                        for k, v in attributes.items()],
                       outputs=[ir.Value(name=_PREFIX + out)], graph=graph, name=_PREFIX + out)
        return made.outputs[0]

    as_int64 = node("Cast", [mask], "mask", to=ir.DataType.INT64.value)
    count = node("ReduceSum", [as_int64, constant("axis1", np.array([1], np.int64))], "count", keepdims=0)
    last = node("Sub", [count, constant("one", np.array(1, np.int64))], "last")
    lengths = node("Cast", [last], "seqlens_k", to=ir.DataType.INT32.value)
    width = node("Shape", [mask], "width64", start=1, end=2)
    width32 = node("Cast", [width], "width32", to=ir.DataType.INT32.value)
    total = node("Squeeze", [width32, constant("axis0", np.array([0], np.int64))], "total_sequence_length")
    return lengths, total
