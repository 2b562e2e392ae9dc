"""A KV-cache model whose prefill runs the fused causal kernel: ``If(past_seq == 0, prefill, decode)``.

The cache contract (present = past ++ new, holes where a prefill was padded)
needs the keys' positions as they are, which no fused kernel on ORT's CPU
provider takes with a general padding mix: GroupQueryAttention's ``seqlens_k``
only says where each row's real keys end, and MultiHeadAttention with the mask as
``attention_bias`` over the concatenated cache was 3x slower per decode step than
the plain graph (``mha_deploy.exporters.export.AUTO_TARGET_KV_CACHE``). A prefill
has no past, so it is exactly the cache-free causal model plus its keys and
values: the fusion that model gets (GroupQueryAttention with padding compacted,
any side) applies unchanged. So the file holds both graphs behind one If on the
cache's length, and each call runs one of them:

- past_seq == 0 (prefill): the cache-free graph, fused, also returning its keys
  and values as present (a decoder stack: each layer's, and memory's for each
  cross-attention). The presents are attached after fusion (``attach_caches``):
  exported beside the attention, torch's exporter may share the key projection
  between the two, and a projection the graph also returns keeps the fusion
  rules off the attention (measured: d_model 512 fell back from
  GroupQueryAttention to a masked MultiHeadAttention);
- otherwise (decode): the KV-cache graph (projections, the new keys appended to
  the cache, the masked attention over it), on contrib MultiHeadAttention with
  past/present for the mha target (``decode_on_mha``).

Both branches read the outer graph's inputs and weights; their own value names
get a prefix so that they cannot collide. Weights the two exports share
(the same projections) are stored once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mha_deploy.errors import ExportError
from mha_deploy.onnx_nodes import producers_and_readers


@dataclass(frozen=True)
class CacheProjection:
    """How a first call computes one attention's present key and value: ``source`` (a [batch, seq, d_model]
    value of the prefill graph: its input x, a decoder layer's input, or memory) through the attention's key
    and value projections (``source @ weight + bias``, weights [d_model, d_model]), heads split."""

    source: str
    present_key: str
    present_value: str
    key_weight: np.ndarray
    key_bias: np.ndarray
    value_weight: np.ndarray
    value_bias: np.ndarray


def attach_caches(
    prefill: onnx.ModelProto, projections: list[CacheProjection], heads: int, outputs: tuple[str, ...]
) -> onnx.ModelProto:
    """``prefill`` (fused) with the present outputs of ``projections`` added, its outputs then exactly
    ``outputs`` (its own first output, then the presents; any other output it had, e.g. a decoder layer's
    input exposed for a projection's ``source``, is dropped). The projections repeat the MatMuls the fused
    attentions already run: ``prefill_or_decode`` merges those."""
    model = onnx.ModelProto()
    model.CopyFrom(prefill)
    graph = model.graph
    d_model = projections[0].key_weight.shape[0]
    shape = "kv_cache_heads_shape"
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, heads, d_model // heads], np.int64), shape))
    for index, projection in enumerate(projections):
        for kind, present, weight, bias in (
            ("key", projection.present_key, projection.key_weight, projection.key_bias),
            ("value", projection.present_value, projection.value_weight, projection.value_bias),
        ):
            name = f"kv_cache.{index}.{kind}"
            graph.initializer.extend([
                numpy_helper.from_array(np.ascontiguousarray(weight, np.float32), f"{name}.weight"),
                numpy_helper.from_array(np.ascontiguousarray(bias, np.float32), f"{name}.bias"),
            ])
            graph.node.extend([
                helper.make_node("MatMul", [projection.source, f"{name}.weight"], [f"{name}.projected"]),
                helper.make_node("Add", [f"{name}.projected", f"{name}.bias"], [f"{name}.biased"]),
                # [batch, seq, d_model] -> [batch, seq, heads, d_k] -> [batch, heads, seq, d_k]
                helper.make_node("Reshape", [f"{name}.biased", shape], [f"{name}.heads"]),
                helper.make_node("Transpose", [f"{name}.heads"], [present], perm=[0, 2, 1, 3]),
            ])
    first = graph.output[0]
    if first.name != outputs[0]:
        raise ValueError(f"the prefill's first output is {first.name}, expected {outputs[0]}")
    kept = onnx.ValueInfoProto()
    kept.CopyFrom(first)
    element = first.type.tensor_type.elem_type
    del graph.output[:]
    graph.output.append(kept)
    graph.output.extend(helper.make_tensor_value_info(name, element, [None] * 4) for name in outputs[1:])
    return model


def prefill_or_decode(prefill: onnx.ModelProto, decode: onnx.ModelProto, cache_input: str) -> onnx.ModelProto:
    """One model with ``decode``'s inputs and outputs running ``prefill`` when ``cache_input``'s axis 2 is 0.

    ``prefill`` is the first call's model: a subset of ``decode``'s inputs, and the same outputs in the same
    order (its presents computed beside the attention: the projections it repeats are merged with the
    attention's own here, so that each is computed once).
    """
    outer = {value.name for value in decode.graph.input}
    missing = {value.name for value in prefill.graph.input} - outer
    if missing:
        raise ValueError(f"the prefill graph reads inputs the decode graph lacks: {sorted(missing)}")
    outputs = [value.name for value in decode.graph.output]
    if [value.name for value in prefill.graph.output] != outputs:
        raise ValueError("the prefill and decode graphs must have the same outputs in the same order")
    initializers: list[onnx.TensorProto] = []
    branches = []
    for graph, prefix in ((prefill.graph, "prefill/"), (decode.graph, "decode/")):
        graph = _copy(graph)
        _rename(graph, lambda name, p=prefix: name if not name or name in outer else p + name)
        initializers.extend(graph.initializer)  # read from the outer scope, stored once
        del graph.initializer[:]
        del graph.input[:]
        graph.name = prefix[:-1]
        branches.append(graph)
    then_branch, else_branch = branches
    _share_identical(initializers, branches)
    # The presents project what the fused attentions already project: compute those once.
    _merge_repeated_nodes(then_branch)
    # [1] bool: If takes a one-element condition.
    zero = helper.make_tensor("zero", onnx.TensorProto.INT64, [1], [0])
    nodes = [
        helper.make_node("Shape", [cache_input], ["cache_length"], start=2, end=3),
        helper.make_node("Constant", [], ["zero_length"], value=zero),
        helper.make_node("Equal", ["cache_length", "zero_length"], ["is_prefill"]),
        helper.make_node(
            "If", ["is_prefill"], outputs, then_branch=then_branch, else_branch=else_branch, name="prefill_or_decode"
        ),
    ]
    graph = helper.make_graph(
        nodes, "kv_cache", list(decode.graph.input), list(decode.graph.output), _unique(initializers)
    )
    opsets: dict[str, int] = {}
    for model in (prefill, decode):
        for opset in model.opset_import:
            opsets[opset.domain] = max(opsets.get(opset.domain, 0), opset.version)
    combined = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    combined.ir_version = min(prefill.ir_version, decode.ir_version)
    combined.functions.extend([*prefill.functions, *decode.functions])
    combined.metadata_props.extend(decode.metadata_props)
    return combined


def decode_on_mha(
    decode: onnx.ModelProto,
    num_heads: int,
    fill: float,
    attentions: int,
    mask_input: str | None = None,
    memory_mask_input: str | None = None,
) -> onnx.ModelProto:
    """``decode`` (the plain KV-cache graph) with each attention, from its keys to the merged heads, replaced
    by one ``com.microsoft.MultiHeadAttention``:

    - a cached self-attention (its keys a Concat onto a past input) by the op taking the cache itself: past
      key/value in, present key/value out, ``key_padding_mask`` = ``mask_input`` over past_seq + seq (int32),
      ``unidirectional`` (query i at position past_seq + i). The op concatenates as the Concat did and
      attends without the [batch, heads, 1, total_seq] mask and the transposed copy of the keys the plain
      graph builds;
    - a decoder's cross-attention over its encoder cache (its keys a graph input, [batch, heads, mem_seq,
      d_k]) by the op reading that cache as its key and value (the op's BNSH cross-attention layout, which
      ORT's CPU kernel takes), masked by ``memory_mask_input``.

    ``attentions``: how many attentions the graph has. Raises ``ExportError`` naming what it did not find
    where the plain graph has it.
    """
    model = onnx.ModelProto()
    model.CopyFrom(decode)
    graph = model.graph
    producer, consumers = producers_and_readers(graph)
    graph_inputs = {value.name for value in graph.input}
    outputs = [value.name for value in graph.output]

    def expect(node: onnx.NodeProto | None, op_type: str, what: str) -> onnx.NodeProto:
        if node is None or node.op_type != op_type:
            found = node.op_type if node is not None else "a graph input"
            raise ExportError(f"KV-cache decode fusion: expected {op_type} {what}, found {found}")
        return node

    def only_consumer(name: str, op_type: str, what: str) -> onnx.NodeProto:
        return expect(next(iter(consumers.get(name, [])), None), op_type, what)

    def cache(present: str) -> tuple[str, str]:
        """(the past input, the [batch, seq, d_model] projection) the Concat producing ``present`` joins."""
        concat = expect(producer.get(present), "Concat", f"producing {present}")
        heads = expect(producer.get(concat.input[1]), "Transpose", "splitting the new keys' heads")
        projection = expect(producer.get(heads.input[0]), "Reshape", "splitting the new keys' heads").input[0]
        return concat.input[0], projection

    fused_at: dict[int, list[onnx.NodeProto]] = {}  # id(merge Reshape) -> the nodes replacing the attention
    merged_outputs: dict[str, str] = {}
    concats: set[int] = set()
    casts: dict[str, str] = {}  # bool mask input -> its int32 copy, cast once for every op reading it

    def int32_mask(name: str | None, fused: list[onnx.NodeProto]) -> str:
        if name is None:
            return ""
        if name not in casts:
            casts[name] = f"kv_cache_{name}_int32"
            fused.append(helper.make_node("Cast", [name], [casts[name]], to=onnx.TensorProto.INT32))
        return casts[name]

    for softmax in (node for node in graph.node if node.op_type == "Softmax"):
        # Back from the scores through the mask (Where(mask, fill, scores)) and the scale to Q @ K^T.
        node = producer.get(softmax.input[0])
        while node is not None and node.op_type != "MatMul":
            node = producer.get(node.input[2] if node.op_type == "Where" else node.input[0])
        scores = expect(node, "MatMul", "computing the scores")
        keys = expect(producer.get(scores.input[1]), "Transpose", "transposing the keys").input[0]
        if keys not in graph_inputs and keys not in outputs:
            raise ExportError(f"KV-cache decode fusion: the keys {keys} are neither a cache nor a present output")
        context = only_consumer(softmax.output[0], "MatMul", "applying the weights")
        values = context.input[1]
        query_heads = expect(producer.get(scores.input[0]), "Transpose", "splitting the query's heads")
        query = expect(producer.get(query_heads.input[0]), "Reshape", "splitting the query's heads").input[0]
        merge = only_consumer(context.output[0], "Transpose", "merging the heads")
        merged = only_consumer(merge.output[0], "Reshape", "merging the heads")
        fused: list[onnx.NodeProto] = []
        name = f"kv_cache_attention_{len(fused_at)}"
        if keys in graph_inputs:  # a cross-attention over its encoder cache
            fused.append(helper.make_node(
                "MultiHeadAttention", [query, keys, values, "", int32_mask(memory_mask_input, fused)], [name],
                domain="com.microsoft", name=name, num_heads=num_heads, mask_filter_value=fill,
            ))
        else:
            (past_key, key), (past_value, value) = cache(keys), cache(values)
            concats.update(id(producer[name]) for name in (keys, values))
            mask = int32_mask(mask_input, fused)
            fused.append(helper.make_node(
                "MultiHeadAttention", [query, key, value, "", mask, "", past_key, past_value], [name, keys, values],
                domain="com.microsoft", name=name, num_heads=num_heads, unidirectional=1, mask_filter_value=fill,
            ))
        fused_at[id(merged)] = fused
        merged_outputs[merged.output[0]] = name
    if len(fused_at) != attentions:
        raise ExportError(f"KV-cache decode fusion: found {len(fused_at)} attentions, expected {attentions}")
    nodes = []
    for node in graph.node:
        if id(node) in fused_at:
            nodes.extend(fused_at[id(node)])
            continue
        if id(node) in concats:
            continue  # the op returns present itself
        node.input[:] = [merged_outputs.get(name, name) for name in node.input]
        nodes.append(node)
    live, needed = [], set(outputs)
    for node in reversed(nodes):
        if set(node.output) & needed:
            live.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(live))
    used = {name for node in graph.node for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _copy(graph: onnx.GraphProto) -> onnx.GraphProto:
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    return copy


def _rename(graph: onnx.GraphProto, rename) -> None:
    """Apply ``rename`` to every value name of ``graph`` and of the graphs nested in its nodes."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        value.name = rename(value.name)
    for tensor in graph.initializer:
        tensor.name = rename(tensor.name)
    for node in graph.node:
        node.input[:] = [rename(name) for name in node.input]
        node.output[:] = [rename(name) for name in node.output]
        if node.name:
            node.name = rename(node.name)
        for attribute in node.attribute:
            nested = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for sub in nested:
                _rename(sub, rename)


def _merge_repeated_nodes(graph: onnx.GraphProto) -> None:
    """Drop every node that repeats an earlier one (same op, inputs and attributes), reading the earlier
    one's outputs instead; in graph order, so chains of repeats (MatMul, then its bias Add) collapse."""
    kept_outputs = {value.name for value in graph.output}
    alias: dict[str, str] = {}
    seen: dict[tuple, onnx.NodeProto] = {}
    keep = []
    for node in graph.node:
        node.input[:] = [alias.get(name, name) for name in node.input]
        nested = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        key = (node.domain, node.op_type, tuple(node.input), tuple(a.SerializeToString() for a in node.attribute))
        earlier = None if nested or kept_outputs & set(node.output) else seen.get(key)
        if earlier is not None and len(earlier.output) == len(node.output):
            alias.update(zip(node.output, earlier.output, strict=True))
            continue
        seen.setdefault(key, node)
        keep.append(node)
    if alias:
        _rename(graph, lambda name: alias.get(name, name))
        del graph.node[:]
        graph.node.extend(keep)


def _share_identical(initializers: list[onnx.TensorProto], graphs: list[onnx.GraphProto]) -> None:
    """Point every reference to a weight equal to an earlier one (same type, shape and values, however the
    exporter stored them) at the earlier one's name."""
    first: dict[str, str] = {}
    alias: dict[str, str] = {}
    for tensor in initializers:
        values = numpy_helper.to_array(tensor)
        digest = hashlib.sha256(f"{values.dtype}{values.shape}".encode() + values.tobytes()).hexdigest()
        canonical = first.setdefault(digest, tensor.name)
        if canonical != tensor.name:
            alias[tensor.name] = canonical
    if alias:
        for graph in graphs:
            _rename(graph, lambda name: alias.get(name, name))
        initializers[:] = [tensor for tensor in initializers if tensor.name not in alias]


def _unique(initializers: list[onnx.TensorProto]) -> list[onnx.TensorProto]:
    return list({tensor.name: tensor for tensor in initializers}.values())
