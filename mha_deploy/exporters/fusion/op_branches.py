"""Branches of the ``If``s the rules build around an attention op, and their size condition.

padding_flash (masked op or mask-free op), causal_gqa (GroupQueryAttention
materialising its scores or tiled) and short_sequence (standard Attention or
MultiHeadAttention) put one op under an ``If`` in each branch
(``op_branch``: a graph of that one op reading values of the enclosing graph,
and returning its first output). padding_flash and causal_gqa also run the op
on compacted tokens when a key is padded: that branch is several nodes, built
on a ``TapeBuilder`` (``tape_branch``), as does short_sequence when it expands a
padding mask for the standard op. The rules must not match the ops they put
inside the branches again (``in_subgraph``, ``made_in_subgraph``). causal_gqa
and short_sequence choose by the bytes of the scores a materialising kernel
would hold (``score_bytes``), which ``mha-deploy inspect`` reads back from
``LessOrEqual(score_bytes, N)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._context import TapeBuilder

from mha_deploy.onnx_nodes import KERNEL_PROP


def in_subgraph(context) -> bool:
    """True when the matched node sits in a subgraph (e.g. a branch of an If), not the model's graph."""
    where = context.graph_or_function
    return isinstance(where, ir.Graph) and where is not context.model.graph


def made_in_subgraph(value: ir.Value, context) -> bool:
    """True when ``value`` is computed inside a subgraph, not in the model's graph nor given to it."""
    return value.graph is not None and value.graph is not context.model.graph


def op_branch(
    domain: str,
    op_type: str,
    inputs: Sequence[ir.Value | None],
    attributes: Mapping[str, object] | Sequence[ir.Attr],
    name: str,
    like: ir.Value,
    num_outputs: int = 1,
    shape: ir.Shape | None = None,
) -> ir.Graph:
    """A graph named ``name`` holding one ``op_type`` node on ``inputs`` (values of the enclosing graph),
    returning the node's first output, typed as ``like`` and shaped as ``shape`` or else ``like``. The other
    ``num_outputs`` are produced but not returned: asking for an output can change the kernel an op runs
    (causal_gqa)."""
    inputs = list(inputs)
    while inputs and inputs[-1] is None:
        inputs = inputs[:-1]
    node = ir.Node(
        domain,
        op_type,
        inputs,
        attributes=ir.convenience.convert_attributes(attributes) if isinstance(attributes, Mapping) else attributes,
        num_outputs=num_outputs,
        name=f"{name}_op",
    )
    for index, value in enumerate(node.outputs):
        value.name = f"{name}_output" if index == 0 else f"{name}_output_{index}"
    output = node.outputs[0]
    output.dtype, output.shape = like.dtype, shape if shape is not None else like.shape
    return ir.Graph(inputs=(), outputs=(output,), nodes=(node,), name=name)


def tag_kernel(output: ir.Value, kernel: str) -> ir.Value:
    """``output`` of an ``If`` a rule built, with ``kernel`` (which kernel runs when) written on the ``If`` for
    ``inspect`` and the fusion report to read (``mha_deploy.onnx_nodes.KERNEL_PROP``)."""
    output.producer().metadata_props[KERNEL_PROP] = kernel
    return output


def tape_branch(tape: TapeBuilder, output: ir.Value, like: ir.Value, name: str) -> ir.Graph:
    """A graph named ``name`` of the nodes recorded on ``tape``, returning ``output`` typed and shaped as
    ``like``. Its nodes and values are named after ``name``: a subgraph's values share the model's
    namespace, and ORT's profiles name nodes."""
    output.dtype, output.shape = like.dtype, like.shape
    for index, node in enumerate(tape.nodes):
        node.name = f"{name}_{index}_{node.op_type}"
        for position, value in enumerate(node.outputs):
            value.name = f"{name}_{index}_{position}"
    return ir.Graph(inputs=(), outputs=(output,), nodes=tape.nodes, name=name)


def copied_attributes(node: ir.Node) -> list[ir.Attr]:
    """New attributes equal to ``node``'s (types kept), for ``op_branch`` to copy the node."""
    return [ir.convenience.convert_attribute(name, attr.value, attr.type) for name, attr in node.attributes.items()]


def score_bytes(op, query: ir.Value, key: ir.Value, num_heads: int, itemsize: int) -> ir.Value:
    """int64 [1] (as an If's condition takes): the bytes of the [batch, heads, q_len, kv_len] scores of
    ``query`` [batch, q_len, ...] against ``key`` [batch, kv_len, ...]."""
    batch, q_len = op.Shape(query, start=0, end=1), op.Shape(query, start=1, end=2)
    kv_len = op.Shape(key, start=1, end=2)
    pair_bytes = op.Constant(value=ir.tensor(np.array(num_heads * itemsize, np.int64)))
    return op.Mul(op.Mul(op.Mul(batch, q_len), kv_len), pair_bytes)
