"""Walking an ONNX graph with its subgraphs, and the kernel tag the fusion rules leave on what they build.

onnx only, for every layer: the runtime's checks, ``inspect`` and the exporter.

A fusion rule that builds an ``If`` choosing between kernels (padding_flash,
causal_gqa, short_sequence) knows which kernel runs when, and its bounds; it
writes that description into the ``If`` node's ``metadata_props`` under
``KERNEL_PROP``, so that nothing downstream has to recognise the rule's graph
again to name the kernel. short_sequence's description holds ``LONG_KERNEL``
where its long branch's kernel (a plain op, or another rule's ``If``) goes.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

__all__ = [
    "BIAS_PROP", "KERNEL_PROP", "LONG_KERNEL", "PACKING_PROP", "POSITION_BIAS", "SCORE_TERMS", "WINDOW_MASK",
    "all_nodes", "kernel_tag", "packing_tags",
]

KERNEL_PROP = "mha_deploy.kernel"
# What token packing did, on the node that finds a mask's real tokens (exporters.token_packing)
PACKING_PROP = "mha_deploy.packing"
LONG_KERNEL = "{long}"
# On an attention op whose attention_bias the fusion read as a bias that masks nothing (e.g. T5's relative
# position bias), its mask parts given to the op's own inputs: POSITION_BIAS. Without it, an attention_bias is
# a mask the fusion could not read.
BIAS_PROP = "mha_deploy.attention_bias"
POSITION_BIAS = "position bias"
# An attention_bias holding a term of the scores computed from the activations (DeBERTa's c2p + p2c) with the
# model's mask added to it, as the graph computes them (exact; the term is [batch, heads, q, kv] anyway).
SCORE_TERMS = "relative score terms with the mask"
# An attention_bias that is a mask with a window or chunk size (ModernBERT's local layers): MultiHeadAttention takes
# no window and GroupQueryAttention's local_window_size is causal only, so it stays materialised.
WINDOW_MASK = "window or chunk mask"


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph``, including those in its subgraphs (the branches of the fusions' Ifs), each
    subgraph's right after the node holding it."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from all_nodes(subgraph)


def default_opset(model: onnx.ModelProto) -> int:
    """The model's version of the default ONNX domain (0 when it imports none)."""
    return next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), 0)


def producers_and_readers(
    graph: onnx.GraphProto,
) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """Of ``graph``'s top level: the node that produces each value, and the nodes that read each value."""
    producers = {name: node for node in graph.node for name in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return producers, readers


def kernel_tag(node: onnx.NodeProto) -> str | None:
    """The kernel description a fusion rule wrote on ``node``, if any."""
    return next((p.value for p in node.metadata_props if p.key == KERNEL_PROP), None)


def packing_tags(graph: onnx.GraphProto) -> list[str]:
    """What token packing wrote on ``graph``'s nodes: its report, one line, or nothing for a model not packed."""
    return [p.value for node in graph.node for p in node.metadata_props if p.key == PACKING_PROP]


def fresh_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... the first not in ``taken``, added to it: a value or node name a pass
    writes without clashing with the graph's own."""
    candidate, count = name, 1
    while candidate in taken:
        candidate, count = f"{name}_{count}", count + 1
    taken.add(candidate)
    return candidate


def rename_readers(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node input reading ``old`` reads ``new``, in subgraphs too (an If's branches read outer values by
    name, and a branch returning one reads it). What produces ``old`` and ``graph``'s own inputs and outputs keep
    the name: for a pass that puts a node between a value and its readers (e.g. a Cast after an input)."""
    for sub in all_graphs(graph):
        for node in sub.node:
            node.input[:] = [new if name == old else name for name in node.input]
        if sub is not graph:
            for value in sub.output:
                if value.name == old:
                    value.name = new


def rename_value(graph: onnx.GraphProto, old: str, new: str) -> None:
    """The value ``old`` called ``new`` everywhere: its readers, its producer, and the graph inputs, outputs and
    value_info that name it, in subgraphs too (names are unique across a graph and its subgraphs, so each is the
    same value)."""
    for sub in all_graphs(graph):
        for node in sub.node:
            node.input[:] = [new if name == old else name for name in node.input]
            node.output[:] = [new if name == old else name for name in node.output]
        for value in (*sub.input, *sub.output, *sub.value_info):
            if value.name == old:
                value.name = new


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it, at any depth."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_graphs(attribute.g)
            for subgraph in attribute.graphs:
                yield from all_graphs(subgraph)
