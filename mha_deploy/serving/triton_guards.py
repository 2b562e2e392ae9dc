"""The validator's bounds written into the graph a Triton repository holds.

Triton's onnxruntime backend runs the file as it is: no ``MHASession`` and none of the one validator
(``runtime.validation``) stand between a client and ONNX Runtime there. Two of the validator's refusals guard
against answers that look right and are not: a negative token id, which ONNX's ``Gather`` reads as a row from
the table's end (-1: the last row), and an id or a sequence past what the export recorded (a vocabulary smaller
than its table, a sequence past the max length). So the repository's copy of the model checks them itself.

Each bound is a ``Reshape`` of a one-element constant to the shape [1] when every value keeps it and [2] when
one does not, named after the bound: ONNX Runtime then fails the request on any provider (shapes are computed
on the host) with ``... running Reshape node. Name:'input_ids: token ids must be in [0, 1000)' ...``, which
Triton returns to the client. The check's output (a one) scales the shape the input is reshaped to before its
consumers read it, so that no optimiser drops the check or runs a consumer before it; the values are the
input's own.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from mha_deploy.metadata import ModelMetadata
from mha_deploy.signature import ID_ROLES, LENGTH_ROLES, SEGMENTS

_PREFIX = "mha_deploy_bound"


def bound_inputs(proto: onnx.ModelProto, metadata: ModelMetadata) -> list[str]:
    """``proto`` (changed in place) with each token or segment input checked against its table and each input of a
    length axis (ids, features, padding masks) against the recorded max length (not on a KV-cache file, whose
    length is past + new tokens); the names of the checks added, empty when the metadata records no bound."""
    signature = metadata.signature
    graph = proto.graph
    checks: list[str] = []
    for spec in signature.custom_inputs:
        bounds = []
        if spec.role in ID_ROLES and spec.vocab is not None:
            kind = "segment" if spec.role == SEGMENTS else "token"
            bounds.append((f"{spec.name}: {kind} ids must be in [0, {spec.vocab})",
                           _outside_vocabulary(spec.name, spec.vocab)))
        # Masks too: an export reads the length off whichever input of the axis it traced (positions counted
        # over the mask's columns, say), so every input of a length axis carries the bound.
        if spec.role in LENGTH_ROLES and metadata.max_length is not None and not signature.kv_cache:
            bounds.append((f"{spec.name}: at most {metadata.max_length} positions (the model's max length)",
                           _longer_than(spec.name, metadata.max_length)))
        if not bounds:
            continue
        checked = spec.name
        nodes: list[onnx.NodeProto] = []
        for index, (name, (flag_nodes, flag)) in enumerate(bounds):
            tag = f"{_PREFIX}.{spec.name}.{index}"
            nodes += flag_nodes
            nodes += _fail_if(name, tag, flag)
            # The input reshaped to its own shape times the check's one: a shape no optimiser can know without
            # running the check, so every consumer, a Shape feeding positions included, waits for it.
            nodes.append(helper.make_node("Shape", [checked], [f"{tag}.input_shape"]))
            nodes.append(helper.make_node("Mul", [f"{tag}.input_shape", f"{tag}.kept"], [f"{tag}.same_shape"]))
            nodes.append(helper.make_node("Reshape", [checked, f"{tag}.same_shape"], [f"{tag}.checked"]))
            checked = f"{tag}.checked"
            checks.append(name)
        _read_through(graph, spec.name, checked)
        # Before every other node: the checks read only the graph input.
        others = list(graph.node)
        del graph.node[:]
        graph.node.extend([*nodes, *others])
    return checks


def _outside_vocabulary(name: str, vocab: int) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing int64 [1]: how many ids of ``name`` lie outside [0, vocab), and that output's name."""
    tag = f"{_PREFIX}.{name}.vocab"
    return [
        _constant(f"{tag}.low", 0), _constant(f"{tag}.high", vocab), _constant(f"{tag}.one_dim", 1),
        helper.make_node("Less", [name, f"{tag}.low"], [f"{tag}.below"]),
        helper.make_node("GreaterOrEqual", [name, f"{tag}.high"], [f"{tag}.above"]),
        helper.make_node("Or", [f"{tag}.below", f"{tag}.above"], [f"{tag}.outside"]),
        helper.make_node("Cast", [f"{tag}.outside"], [f"{tag}.counts"], to=TensorProto.INT64),
        # ReduceSum over every axis (an empty tensor sums to 0), kept as [1, 1]; then [1]
        helper.make_node("ReduceSum", [f"{tag}.counts"], [f"{tag}.sum2"], keepdims=1),
        helper.make_node("Reshape", [f"{tag}.sum2", f"{tag}.one_dim"], [f"{tag}.sum"]),
    ], f"{tag}.sum"


def _longer_than(name: str, max_length: int) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing int64 [1]: 1 when ``name``'s axis 1 is longer than ``max_length``, else 0."""
    tag = f"{_PREFIX}.{name}.length"
    return [
        helper.make_node("Shape", [name], [f"{tag}.length"], start=1, end=2),
        _constant(f"{tag}.max", max_length),
        helper.make_node("Greater", [f"{tag}.length", f"{tag}.max"], [f"{tag}.over"]),
        helper.make_node("Cast", [f"{tag}.over"], [f"{tag}.sum"], to=TensorProto.INT64),
    ], f"{tag}.sum"


def _fail_if(name: str, tag: str, count: str) -> list[onnx.NodeProto]:
    """A Reshape named ``name`` that fails when ``count`` (int64 [1]) is not 0, else gives int64 [1] one as
    ``tag``.kept."""
    return [
        _constant(f"{tag}.one", 1),
        helper.make_node("Min", [count, f"{tag}.one"], [f"{tag}.failed"]),
        helper.make_node("Add", [f"{tag}.failed", f"{tag}.one"], [f"{tag}.shape"]),
        helper.make_node("Reshape", [f"{tag}.one", f"{tag}.shape"], [f"{tag}.kept"], name=name),
    ]


def _constant(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value]))


def _read_through(graph: onnx.GraphProto, name: str, checked: str) -> None:
    """Every node of ``graph`` (and of its subgraphs) that reads ``name`` reads ``checked`` instead."""
    for node in graph.node:
        node.input[:] = [checked if value == name else value for value in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _read_through(attribute.g, name, checked)
