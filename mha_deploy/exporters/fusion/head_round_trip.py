"""A ``GroupQueryAttention``'s or ``MultiHeadAttention``'s output split into heads and merged back before the
output projection, removed.

Why: the op returns [batch, seq, heads * head_dim], which the output projection reads; but the graph around it is
the module's, whose attention returned [batch, heads, seq, head_dim]: upstream's fusion split the op's output into
that (Reshape, Transpose) and the module's own ops merge it back (a Reshape to the shape it already has, a
Transpose, a Reshape): five copies a layer that give the op's output back unchanged.

What is removed, found structurally, each step read by the next only: Reshape(out, [0, 0, heads, -1]) (the op's
heads split off its last axis), then Transposes and Reshapes that leave their input's recorded shape unchanged,
whose Transposes together are the identity, ending in a Reshape to [d0, d1, heads * head_dim] where d0, d1 are
the split's own first two dims (as the graph's shapes record them). Nothing moved an element: the last value is
the op's output, and its readers read that instead.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from mha_deploy.exporters.fusion.attention_rewrite import AttentionRewriteReport, rewritten
from mha_deploy.exporters.fusion.constant_values import constant_array

_DOMAIN = "com.microsoft"
REWRITE = "heads split and merged back after the op removed"  # how a line names this pass


def drop_head_round_trips(model: onnx.ModelProto) -> tuple[onnx.ModelProto, AttentionRewriteReport]:
    """``model`` with each ``GroupQueryAttention`` output's split-and-merge removed (the module docstring), and how
    many were (an output with no such chain is not a refusal: nothing to remove); ``model`` itself where none was."""
    ir_model = ir.serde.deserialize_model(model)
    attentions = [node for node in ir_model.graph if node.op_type == "GroupQueryAttention" and node.domain == _DOMAIN]
    report = AttentionRewriteReport(REWRITE, attentions=len(attentions), done=_drop(attentions))
    return rewritten(model, ir_model, report)


def drop_mha_round_trips(model: ir.Model) -> int:
    """``model``'s ``MultiHeadAttention`` outputs' split-and-merge removed in place (the module docstring: the op
    returns [batch, seq, heads * head_dim] too), and how many were. The attention chain calls it on the mha target:
    in ViT's layers the module's merge (a permute, a ``view``, a permute back) is two Transposes of the context a
    layer, which ORT cannot cancel across the Reshape between them (~1% of ORT's kernel time for ViT-S at batch 8,
    2 threads: 12 Transposes of [8, 197, 6, 64]). The caller
    removes the nodes left unread."""
    return _drop([node for node in model.graph if node.op_type == "MultiHeadAttention" and node.domain == _DOMAIN])


def _drop(attentions: list[ir.Node]) -> int:
    done = 0
    for node in attentions:
        merged = _round_trip_end(node.outputs[0], node.attributes.get_int("num_heads", 0))
        if merged is None or merged.is_graph_output():
            continue
        merged.replace_all_uses_with(node.outputs[0])
        if merged.shape is not None and node.outputs[0].shape is None:
            node.outputs[0].shape = merged.shape
        done += 1
    return done


def _only_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def _round_trip_end(out: ir.Value, heads: int) -> ir.Value | None:
    """The value the chain from ``out`` ends in, equal to ``out``; None where the chain is not one."""
    split = _only_reader(out)
    if split is None or split.op_type != "Reshape" or split.inputs[0] is not out \
            or split.attributes.get_int("allowzero", 0):
        return None
    target = constant_array(split.inputs[1])
    if target is None or target.tolist() != [0, 0, heads, -1]:
        return None
    value, perm = split.outputs[0], [0, 1, 2, 3]
    heads_dims = _known(value)  # [batch, seq, heads, head_dim] once the graph's shapes say them
    while (step := _only_reader(value)) is not None and step.inputs[0] is value:
        result = step.outputs[0]
        if step.op_type == "Transpose":
            step_perm = list(step.attributes.get_ints("perm", []))
            if sorted(step_perm) != [0, 1, 2, 3]:
                return None
            perm = [perm[axis] for axis in step_perm]
            # A split of an output the graph gives no shape has only inference's placeholders: a transposed
            # value's recorded dims replace them.
            if (heads_dims is None or not isinstance(heads_dims[3], int)) and (known := _known(result)) is not None:
                heads_dims = [None] * 4
                for axis, dim in zip(perm, known, strict=True):
                    heads_dims[axis] = dim
        elif step.op_type == "Reshape":
            if heads_dims is None or heads_dims[2] != heads or not isinstance(heads_dims[3], int):
                return None
            if perm == [0, 1, 2, 3] and _same_shape(result, [heads_dims[0], heads_dims[1], heads * heads_dims[3]]):
                return result  # merged back: [batch, seq, heads * head_dim] in the op's own order
            if _known(value) is None or not _same_shape(result, _known(value)):
                return None
        else:
            return None
        value = result
    return None


def _known(value: ir.Value) -> list | None:
    """``value``'s recorded 4-D shape where every dim is a number or a named symbol, else None."""
    if value.shape is None or value.shape.rank() != 4:
        return None
    dims = list(value.shape)
    if any(not isinstance(dim, int) and dim.value is None for dim in dims):
        return None
    return dims


def _same_shape(value: ir.Value, dims: list | None) -> bool:
    """Whether ``value``'s recorded shape is ``dims``, every dim known (a number or a named symbol)."""
    if dims is None or value.shape is None or value.shape.rank() != len(dims):
        return False
    for have, want in zip(value.shape, dims, strict=True):
        if isinstance(want, int) or isinstance(have, int):
            if have != want:
                return False
        elif have.value is None or have.value != want.value:
            return False
    return True
