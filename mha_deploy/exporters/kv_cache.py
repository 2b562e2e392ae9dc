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

- past_seq == 0 (prefill): the fused cache-free graph, also returning its keys
  and values as present;
- otherwise (decode): the plain KV-cache graph (projections, Concat onto the
  cache, the masked attention over it).

Both branches read the outer graph's inputs and weights; their own value names
get a prefix so that they cannot collide. Weights the two exports share
(the same projections) are stored once.
"""

from __future__ import annotations

import hashlib

import onnx
from onnx import helper, numpy_helper

from mha_deploy.errors import ExportError

_PREFIXES = ("prefill/", "decode/")


def prefill_or_decode(
    prefill: onnx.ModelProto, decode: onnx.ModelProto, cache_input: str, plain: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """One model with ``decode``'s inputs and outputs running ``prefill`` when ``cache_input``'s axis 2 is 0.

    ``prefill`` is the cache-free model (a subset of ``decode``'s inputs, its one output named as
    ``decode``'s first). The prefill branch takes the present outputs from the nodes of ``plain`` (the
    unfused KV-cache graph; default ``decode``) that compute them: the key/value projections and the Concat
    onto the empty past, so that the cache-free graph stays exactly as its own fusion left it.
    """
    outer = {value.name for value in decode.graph.input}
    missing = {value.name for value in prefill.graph.input} - outer
    if missing:
        raise ValueError(f"the prefill graph reads inputs the decode graph lacks: {sorted(missing)}")
    outputs = [value.name for value in decode.graph.output]
    presents = _slice((plain or decode).graph, outputs[1:])
    initializers: list[onnx.TensorProto] = []
    parts = []
    for graph, prefix in ((prefill.graph, "prefill/"), (presents, "prefill/cache/"), (decode.graph, "decode/")):
        graph = _copy(graph)
        _rename(graph, lambda name, p=prefix: name if not name or name in outer else p + name)
        initializers.extend(graph.initializer)  # read from the outer scope, stored once
        del graph.initializer[:]
        del graph.input[:]
        parts.append(graph)
    then_branch, cache, else_branch = parts
    then_branch.node.extend(cache.node)
    then_branch.output.extend(cache.output)
    then_branch.name, else_branch.name = "prefill", "decode"
    branches = [then_branch, else_branch]
    _share_identical(initializers, branches)
    # The present keys/values project x as the fused prefill already does: compute those once.
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


def decode_on_mha(decode: onnx.ModelProto, num_heads: int, mask_input: str | None, fill: float) -> onnx.ModelProto:
    """``decode`` (the plain KV-cache graph) with its attention, from the Concat onto the cache to the merged
    heads, replaced by one ``com.microsoft.MultiHeadAttention`` that takes the cache itself: past_key/past_value
    in, present_key/present_value out, ``key_padding_mask`` over past_seq + seq (int32), ``unidirectional``
    (query i at position past_seq + i). The op concatenates as the Concat did and attends without the
    [batch, heads, 1, total_seq] mask and the transposed copy of the keys the plain graph builds.

    Raises ``ExportError`` naming what it did not find where the plain graph has it.
    """
    model = onnx.ModelProto()
    model.CopyFrom(decode)
    graph = model.graph
    producer = {name: node for node in graph.node for name in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def expect(node: onnx.NodeProto | None, op_type: str, what: str) -> onnx.NodeProto:
        if node is None or node.op_type != op_type:
            found = node.op_type if node is not None else "a graph input"
            raise ExportError(f"KV-cache decode fusion: expected {op_type} {what}, found {found}")
        return node

    def projection(present: str) -> str:
        """The [batch, seq, d_model] projection whose heads the Concat appends to the cache."""
        concat = expect(producer.get(present), "Concat", f"producing {present}")
        heads = expect(producer.get(concat.input[1]), "Transpose", "splitting the new keys' heads")
        return expect(producer.get(heads.input[0]), "Reshape", "splitting the new keys' heads").input[0]

    outputs = [value.name for value in graph.output]
    key, value = projection(outputs[1]), projection(outputs[2])
    softmax = [node for node in graph.node if node.op_type == "Softmax"]
    if len(softmax) != 1:
        raise ExportError(f"KV-cache decode fusion: expected one Softmax, found {len(softmax)}")
    # Back from the scores through the mask (Where(mask, fill, scores)) and the scale to Q @ K^T.
    node = producer.get(softmax[0].input[0])
    while node is not None and node.op_type != "MatMul":
        node = producer.get(node.input[2] if node.op_type == "Where" else node.input[0])
    scores = expect(node, "MatMul", "computing the scores")
    query_heads = expect(producer.get(scores.input[0]), "Transpose", "splitting the query's heads")
    query = expect(producer.get(query_heads.input[0]), "Reshape", "splitting the query's heads").input[0]
    # Forward from the probabilities: P @ V, then the heads merged back to [batch, seq, d_model].
    context = expect(next(iter(consumers.get(softmax[0].output[0], [])), None), "MatMul", "applying the weights")
    merge = expect(next(iter(consumers.get(context.output[0], [])), None), "Transpose", "merging the heads")
    merged = expect(next(iter(consumers.get(merge.output[0], [])), None), "Reshape", "merging the heads")

    fused = []
    mask = ""
    if mask_input is not None:
        mask = "kv_cache_key_padding_mask_int32"
        fused.append(helper.make_node("Cast", [mask_input], [mask], to=onnx.TensorProto.INT32))
    attention_output = "kv_cache_attention"
    past = [value.name for value in graph.input if value.name in ("past_key", "past_value")]
    fused.append(helper.make_node(
        "MultiHeadAttention", [query, key, value, "", mask, "", *past], [attention_output, *outputs[1:]],
        domain="com.microsoft", name="kv_cache_attention", num_heads=num_heads, unidirectional=1,
        mask_filter_value=fill,
    ))
    nodes = []
    for node in graph.node:
        if node is merged:
            nodes.extend(fused)
            continue
        if set(node.output) & set(outputs[1:]):
            continue  # the Concats: the op returns present itself
        node.input[:] = [attention_output if name == merged.output[0] else name for name in node.input]
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


def _slice(graph: onnx.GraphProto, outputs: list[str]) -> onnx.GraphProto:
    """The part of ``graph`` that computes ``outputs``: those nodes, the initializers they read, those outputs."""
    producer = {name: node for node in graph.node for name in node.output}
    needed, stack, seen = [], list(outputs), set()
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        needed.append(node)
        stack.extend(node.input)
    order = {id(node): index for index, node in enumerate(graph.node)}
    needed.sort(key=lambda node: order[id(node)])
    read = {name for node in needed for name in node.input}
    return helper.make_graph(
        needed, "slice", list(graph.input), [v for v in graph.output if v.name in outputs],
        [tensor for tensor in graph.initializer if tensor.name in read],
    )


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
