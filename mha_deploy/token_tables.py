"""The embedding tables a graph's token ids index, and so its vocabulary (onnx only, for every layer).

A token input's vocabulary is the number of rows of the table its ids index: a ``Gather`` (axis 0) from a
constant ``[rows, width]`` table whose indices are the ids themselves, reshaped, cast or selected but never
computed from. Tables whose indices are computed from the ids are not the vocabulary's: a RoBERTa-style
position table is indexed by a cumulative sum over ``ids != pad``, and a segment table by zeros shaped like
the ids. The export records this vocabulary, ``optimize`` reads it off a foreign graph, and a session checks
it against the graph on load, so that all three agree on which ids a model takes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from mha_deploy.onnx_nodes import producers_and_readers

__all__ = ["EmbeddingTable", "indexed_tables", "non_finite_rows", "vocabulary"]

# Ops whose output holds only values of their first input (reshaped, converted, selected or repeated): ids
# through them are still ids. Arithmetic is left out: ``ids + 2`` indexes a table at other rows.
_ID_PRESERVING = {
    "Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose", "Slice", "Split",
    "Tile", "Gather", "GatherElements", "GatherND", "Compress", "Concat",
}
# Ops between a stored table and the Gather that reads it that keep its rows: a table stored in fp16 and
# cast up, or stored int8 and dequantized.
_ROW_PRESERVING = {"Identity", "Cast", "DequantizeLinear"}


@dataclass(frozen=True)
class EmbeddingTable:
    """A ``[rows, width]`` table the ids index: ``name`` is its stored tensor (initializer or Constant)."""

    name: str
    rows: int
    width: int


def indexed_tables(model: onnx.ModelProto, token_input: str) -> tuple[list[EmbeddingTable], bool]:
    """The tables ``token_input``'s ids index, and whether some Gather takes the ids from a table whose rows
    cannot be read off the graph (then the vocabulary is unknown, whatever the tables found say)."""
    graph = model.graph
    stored = _stored_shapes(graph)
    producers, consumers = producers_and_readers(graph)
    tables: dict[str, EmbeddingTable] = {}
    unreadable = False
    inferred: dict[str, tuple[int, ...]] | None = None
    ids, queue = {token_input}, deque([token_input])
    while queue:
        value = queue.popleft()
        for node in consumers.get(value, []):
            if _indexes_rows(node, value):
                table = _table(node.input[0], stored, producers)
                if table is None:
                    # A table computed from a stored one (scaled, sliced): its rows as shape inference says.
                    inferred = _inferred_shapes(model) if inferred is None else inferred
                    table = _table(node.input[0], inferred, {})
                if table is None:
                    unreadable = True
                else:
                    tables[table.name] = table
                continue
            # Concat keeps the values of every input; the others, those of their first.
            if node.op_type in _ID_PRESERVING and (node.input[0] == value or node.op_type == "Concat"):
                for name in node.output:
                    if name and name not in ids:
                        ids.add(name)
                        queue.append(name)
    return sorted(tables.values(), key=lambda t: (t.rows, t.name)), unreadable


def vocabulary(model: onnx.ModelProto, token_input: str) -> int | None:
    """The ids ``token_input`` takes, ``[0, vocabulary)``: the fewest rows of the tables its ids index, or
    None when they index none, or one whose rows the graph does not say."""
    tables, unreadable = indexed_tables(model, token_input)
    if unreadable or not tables:
        return None
    return tables[0].rows


def non_finite_rows(model: onnx.ModelProto, tables: Iterable[EmbeddingTable]) -> dict[str, list[int]]:
    """Table name -> the rows holding NaN or Inf, for the tables whose values the model holds (an id there
    gives NaN whatever the rest of the input)."""
    values = {tensor.name: tensor for tensor in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = node.attribute[0].t
    found = {}
    for table in tables:
        tensor = values.get(table.name)
        if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:  # a session's graph, data not read
            continue
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind != "f":
            continue
        bad = np.flatnonzero(~np.isfinite(array.reshape(array.shape[0], -1)).all(axis=1))
        if bad.size:
            found[table.name] = bad.tolist()
    return found


def _stored_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's dims, by name: initializers and Constant nodes (no data read)."""
    shapes = {tensor.name: tuple(tensor.dims) for tensor in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            shapes[node.output[0]] = tuple(node.attribute[0].t.dims)
    return shapes


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value's static dims as onnx's shape inference finds them (none where it fails or cannot say)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # onnx's own errors: a graph it cannot infer, or one too large to serialise
        return {}
    shapes = {}
    for value in graph.value_info:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    return shapes


def _table(name: str, stored: dict, producers: dict) -> EmbeddingTable | None:
    """The stored ``[rows, width]`` tensor behind ``name``, through casts and dequantization; else None."""
    while name not in stored:
        node = producers.get(name)
        if node is None or node.op_type not in _ROW_PRESERVING or not node.input:
            return None
        name = node.input[0]
    shape = stored[name]
    if len(shape) != 2 or shape[0] < 1:
        return None
    return EmbeddingTable(name, int(shape[0]), int(shape[1]))


def _indexes_rows(node: onnx.NodeProto, ids: str) -> bool:
    """Whether ``node`` reads rows of its first input at ``ids``: a Gather along axis 0, or a GatherND without
    batch dims (how torch exports ``table[ids]``: the ids unsqueezed into one-element index tuples)."""
    if len(node.input) < 2 or node.input[1] != ids:
        return False
    if node.op_type == "Gather":
        return _attribute(node, "axis") == 0
    return node.op_type == "GatherND" and _attribute(node, "batch_dims") == 0


def _attribute(node: onnx.NodeProto, name: str) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == name), 0)
