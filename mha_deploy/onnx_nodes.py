"""Walking an ONNX graph with its subgraphs: onnx only, for every layer (runtime checks, inspect, the exporter)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

__all__ = ["all_nodes"]


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph``, including those in its subgraphs (the branches of the fusions' Ifs)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from all_nodes(subgraph)
