"""Padding masks taken in the dtype the Signature declares: int64 1/0 where a file takes a Hugging Face
tokenizer's ``attention_mask`` as it comes (``export --hf``), bool elsewhere.

The trace, the fusions and token packing all run on the bool mask the module was traced with (each rule reads
a bool graph input: ``fusion.mask_analysis``, ``token_packing``), so the dtype is changed last, on the fused
graph: the input becomes int64 and one ``Cast(to=BOOL)`` feeds everything that read it. The fused attentions are
the same nodes, and a fused op that takes an int32 ``key_padding_mask`` still casts from that bool. The one
validator admits only 0 and 1 in such a mask (``runtime.validation``), so the Cast's "nonzero is True" never
has to decide anything else.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from mha_deploy.errors import ExportError
from mha_deploy.onnx_nodes import fresh_name, rename_readers
from mha_deploy.signature import PADDING_MASK, Signature

_TYPES = {"int64": TensorProto.INT64, "bool": TensorProto.BOOL}


def masks_as_declared(model: onnx.ModelProto, signature: Signature) -> onnx.ModelProto:
    """``model`` with each bool padding-mask input that ``signature`` declares int64 taking int64 (cast to bool
    inside, once); ``model`` itself when there is none. A copy: the caller's model is left as it was."""
    declared = {spec.name: _TYPES[spec.dtype] for spec in signature.inputs if spec.role == PADDING_MASK}
    return int64_masks(model, [name for name, dtype in declared.items() if dtype == TensorProto.INT64])


def int64_masks(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """``model`` with each of its bool inputs among ``names`` taking int64 1/0 instead, cast to bool once before
    every reader (``model`` itself when there is none to change; else a copy)."""
    inputs = {value.name: value for value in model.graph.input}
    changed = [name for name in names
               if name in inputs and inputs[name].type.tensor_type.elem_type == TensorProto.BOOL]
    if not changed:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    taken = _names(graph)
    casts = []
    for name in changed:
        inner = fresh_name(f"{name}.bool", taken)
        _refuse_mask_outputs(graph, name)
        rename_readers(graph, name, inner)
        next(value for value in graph.input if value.name == name).type.tensor_type.elem_type = TensorProto.INT64
        casts.append(helper.make_node("Cast", [name], [inner], to=TensorProto.BOOL, name=f"{inner}.cast"))
    nodes = [*casts, *graph.node]  # before every reader: the graph stays topologically sorted
    graph.ClearField("node")
    graph.node.extend(nodes)
    return model


def _names(graph: onnx.GraphProto) -> set[str]:
    names = {value.name for value in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= _names(attribute.g)
    return names


def _refuse_mask_outputs(graph: onnx.GraphProto, name: str) -> None:
    for output in graph.output:
        if output.name == name:  # the mask returned as it came in: it would come back int64
            raise ExportError(f"{name} is also an output of the graph: a padding mask taken as int64 cannot be "
                              "returned as the bool it was traced as; return a copy of it (mask.clone())")
