"""A cache model's ops narrowed to this call's new positions, so that a step costs what its tokens cost.

``own_kv_cache`` rewires a causal LM's plain export so that the module's forward runs over the whole
sequence (placeholder ids for the cached positions) and every attention reads the cache for its past keys
and values; only the rows of the new positions are kept: the logits ``[:, past:]`` and each attention's
keys/values ``[:, :, past:]``. Every op that computes a row per position from that position's row alone
(projections, norms, activations, the query side of an attention) therefore computes rows nobody reads.
This pass moves those cuts from the outputs back to the sources.

Why here, on the rewired graph before fusion: the attention is still explicit there (scores MatMul, mask,
Softmax over the keys, MatMul by the values), so the one op through which positions read each other is
plain to see and is narrowed like any other row-wise op (its queries and its mask's rows cut, its keys and
values the whole cache); fusion then runs as on any graph and reads the narrowed mask by what it computes.
After fusion the same information sits inside kernels with their own mask conventions.

How: a value is *demanded* on one axis, meaning only the rows ``[past:]`` along it are read. Demand starts
at the cuts (a ``Slice(x, past, end, axis)``) and walks back op by op (reverse topological order):

- an op that computes each output row from the same row of its inputs passes the demand on to the inputs
  that span that axis (an input that broadcasts along it, a weight, a cache, is read whole): elementwise
  ops, MatMul on its rows or its batch axes, Softmax / LayerNormalization / reductions over other axes,
  Gather of a table by demanded indices, Transpose, Unsqueeze/Squeeze, Concat on another axis, and a
  Reshape that keeps the positions' axis whole (or merged with others, as in ``[batch * seq, d]``: the
  demand then carries the factor inside the merged axis). Which axis of which value is the sequence is
  not guessed from op semantics: the graph is run at two total lengths with every intermediate as an
  output, and the dims that follow the length are the ones that span it.
- any other op whose inputs hold no model activations (ids, the mask, a causal ``tril``, a position
  ``Range`` or cumulative sum, a position table) is a *source*: it keeps computing over the whole length
  (cheap: no weights are applied) and an explicit ``Slice`` cuts its rows where the narrowed path meets it.
- a Reshape's target shape may hold the total length (read by Shape off a full-length value): the
  narrowed Reshape gets that entry scaled to the new length (``entry / total * seq``; -1 and 0 kept).

If demand reaches an op that is none of these and reads activations, narrowing is refused (the caller keeps
the whole-sequence graph and warns, naming the op); so it is if, after the rewrite, an op applying weights
still runs over the whole length. Per-step parity at export (``check_own_cache_parity``) is the proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from mha_deploy.onnx_nodes import producers_and_readers

_PREFIX = "kv_cache.narrow."
# Ops whose presence upstream means a value holds model activations (not ids, masks or positions).
_HEAVY = {"MatMul", "Gemm", "Conv", "Softmax", "LayerNormalization", "Einsum", "MatMulInteger",
          "SkipLayerNormalization", "Attention", "MultiHeadAttention", "GroupQueryAttention"}
_UNARY = {"Identity", "Cast", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Sigmoid", "Relu", "Erf",
          "Gelu", "FastGelu", "Softplus", "Elu", "LeakyRelu", "HardSigmoid", "Not", "Sin", "Cos", "IsNaN", "IsInf",
          "Floor", "Ceil", "Round", "Sign", "Dropout", "QuickGelu", "BiasGelu", "Mish", "HardSwish", "Celu", "Selu",
          "Clip", "CastLike"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual",
              "GreaterOrEqual", "And", "Or", "Xor", "Where", "Mod", "BitwiseAnd", "BitwiseOr", "PRelu", "Sum",
              "Mean"}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare",
           "ReduceLogSumExp"}
# The two runs that find the length axes: batch 2, total lengths 11 and 13 (fewer under a short position
# table); a static dim cannot equal the total in both.
_PROBE_TOTALS = (11, 13)
_PROBE_BATCH = 2


class NarrowingRefused(Exception):
    """Narrowing cannot be proven for an op; the message names it."""


@dataclass(frozen=True)
class Demand:
    """Rows ``[past:]`` of ``axis`` are read; ``inner`` > 1 when the axis is the positions merged with
    others (the dim is outer * total * inner)."""

    axis: int
    inner: int = 1


@dataclass(frozen=True)
class LengthNames:
    """The rewired graph's names for the cached length, the slice end, the new tokens and the mask."""

    past: str
    end: str
    tokens: str
    mask: str


class _Shapes(dict):
    """name -> (shape in the first run, shape in the second); ``totals``: the two runs' total lengths;
    ``constants``: the small constant values (initializers and Constant ops) by name."""

    totals: tuple[int, int]
    constants: dict[str, np.ndarray]


def narrow_to_new_positions(
    model: onnx.ModelProto, names: LengthNames, feeds: Callable[[int, int, int], dict[str, np.ndarray]],
    max_length: int | None = None, position_ids: str | None = None,
) -> tuple[onnx.ModelProto, bool]:
    """``model`` (a rewired cache model, unfused) with every row-wise op computing the new positions only;
    ``NarrowingRefused`` naming the op where that cannot be proven. ``feeds(batch, past, seq)`` gives the
    model's inputs for a call (to find which dims follow the total length), at most ``max_length`` long.

    ``position_ids``: the name of an int64 [batch, seq] input to take each row's positions from, where the
    module's positions are a ``Range`` over the sequence indexing or computing a table (``take_position_ids``); the
    flag says whether the model now takes it."""
    shapes = _probe_shapes(model, feeds, max_length)
    graph = model.graph
    shapes.constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer
                        if math.prod(init.dims) <= 64}
    shapes.constants.update({node.output[0]: value for node in graph.node if node.op_type == "Constant"
                             and (value := _constant(graph, node.output[0])) is not None})
    producers = {out: node for node in graph.node for out in node.output}
    heavy = _heavy_values(graph)
    demands: dict[str, Demand] = {}
    roots: dict[str, str] = {}  # a cut's output -> the value it cuts
    for node in graph.node:
        axis = _cut_axis(node, names, graph)
        if axis is not None:
            roots[node.output[0]] = node.input[0]
            _demand(demands, node.input[0], Demand(axis), node)
    plans: dict[str, tuple[onnx.NodeProto, dict[int, Demand]]] = {}
    sources: set[str] = set()
    for node in reversed(list(graph.node)):
        wanted = [(i, demands[out]) for i, out in enumerate(node.output) if out in demands]
        if not wanted:
            continue
        reason = f"{node.op_type} {node.name} is not known to compute a row per position"
        try:
            inputs = _input_demands(node, wanted, shapes)
        except NarrowingRefused as exc:
            reason = str(exc)
            inputs = None
        if inputs is None:
            cheap = all(out not in heavy for _, out in enumerate(node.output))
            if not cheap:
                raise NarrowingRefused(reason)
            for i, demand in wanted:
                if demand.inner != 1 or _dim(shapes, node.output[i], demand.axis) != shapes.totals:
                    raise NarrowingRefused(f"{node.op_type} {node.name}: its output mixes the sequence with "
                                           "another axis, and cannot be cut")
                sources.add(node.output[i])
            continue
        plans[node.name or node.output[0]] = (node, inputs)
        for index, demand in inputs.items():
            name = node.input[index]
            _demand(demands, name, demand, node)
            if name not in producers:
                if demand.inner != 1:
                    raise NarrowingRefused(f"graph input {name} is read merged with another axis")
                sources.add(name)
    narrowed = _rewrite(model, names, demands, plans, sources, roots, shapes, heavy, producers)
    taken = position_ids is not None and take_position_ids(narrowed, shapes, names.tokens, position_ids, names)
    return narrowed, taken


def _demand(demands: dict[str, Demand], name: str, demand: Demand, reader: onnx.NodeProto) -> None:
    if demands.setdefault(name, demand) != demand:
        raise NarrowingRefused(f"{reader.op_type} {reader.name}: {name} is read along two different axes")


def _cut_axis(node: onnx.NodeProto, names: LengthNames, graph: onnx.GraphProto) -> int | None:
    """The axis of a cut ``Slice(x, past, end, axis)``, else None."""
    if node.op_type != "Slice" or len(node.input) < 4 or list(node.input[1:3]) != [names.past, names.end]:
        return None
    axes = _constant(graph, node.input[3])
    return None if axes is None or axes.size != 1 else int(axes.reshape(-1)[0])


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
                if attribute.name in ("value_ints", "value_int"):
                    return np.array(helper.get_attribute_value(attribute))
    return None


def _heavy_values(graph: onnx.GraphProto) -> set[str]:
    """Every value computed, directly or not, by an op that applies weights or reads activations (or by an op
    with a subgraph, which is not looked into)."""
    heavy: set[str] = set()
    for node in graph.node:  # topologically sorted
        subgraph = any(attribute.type == onnx.AttributeProto.GRAPH for attribute in node.attribute)
        if node.op_type in _HEAVY or subgraph or any(name in heavy for name in node.input):
            heavy.update(node.output)
    return heavy


def _probe_shapes(model: onnx.ModelProto, feeds, max_length: int | None) -> _Shapes:
    """Each value's shape in two runs at two total lengths."""
    import onnxruntime as ort

    totals = _PROBE_TOTALS if max_length is None else tuple(min(t, max_length - 2 + i * 2)
                                                             for i, t in enumerate(_PROBE_TOTALS))
    if totals[0] < 3:
        raise NarrowingRefused(f"a position table of {max_length} positions is too short to probe the lengths")

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {out.name for out in probe.graph.output}
    for node in probe.graph.node:
        for out in node.output:
            if out and out not in known:
                probe.graph.output.add(name=out)
                known.add(out)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    runs = []
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [out.name for out in session.get_outputs()]
        for total in totals:
            given = feeds(_PROBE_BATCH, total - 2, 2)
            results = session.run(names, given)
            shapes = {init.name: tuple(init.dims) for init in model.graph.initializer}
            shapes.update({name: np.shape(value) for name, value in given.items()})
            shapes.update({name: np.shape(value) for name, value in zip(names, results, strict=True)})
            runs.append(shapes)
    except Exception as exc:  # ORT's own errors: the graph cannot be probed, so nothing can be proven
        raise NarrowingRefused(f"the graph could not be run with every value as an output ({exc})") from exc
    result = _Shapes({name: (runs[0][name], runs[1][name]) for name in runs[0]})
    result.totals = totals
    return result


def _dim(shapes, name: str, axis: int) -> tuple[int, int] | None:
    pair = shapes.get(name)
    if pair is None or not -len(pair[0]) <= axis < len(pair[0]):
        return None
    return pair[0][axis], pair[1][axis]


def _rank(shapes, name: str) -> int:
    if name not in shapes:
        raise NarrowingRefused(f"{name} has no shape")
    return len(shapes[name][0])


def _spans(shapes, name: str, axis: int, demand: Demand) -> bool:
    """Whether ``name``'s ``axis`` holds the positions as ``demand`` describes (else it must broadcast)."""
    dims = _dim(shapes, name, axis)
    if dims is None:
        return False
    totals = shapes.totals
    return all(dim % (totals[run] * demand.inner) == 0 and dim > 0 for run, dim in enumerate(dims)) and (
        dims[0] // totals[0] == dims[1] // totals[1])


def _input_demands(node: onnx.NodeProto, wanted: list[tuple[int, Demand]], shapes) -> dict[int, Demand] | None:
    """The demands ``node`` puts on its inputs (by input index) when its outputs are demanded as ``wanted``;
    None when the op is not one that computes rows from the same rows."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return None
    if len({d for _, d in wanted}) != 1:
        return None
    out_index, demand = wanted[0]
    out = node.output[out_index]
    rank = _rank(shapes, out)
    axis = demand.axis % rank
    demand = Demand(axis, demand.inner)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in _UNARY or op in _BROADCAST or op == "Expand":
        readers = [0] if op == "Expand" else range(len(node.input))
        return _broadcast(node, readers, demand, rank, shapes)
    if op == "MatMul":
        a_rank, b_rank = _rank(shapes, node.input[0]), _rank(shapes, node.input[1])
        if a_rank < 2 or b_rank < 2:
            return None
        if axis == rank - 2:
            return {0: Demand(a_rank - 2, demand.inner)}
        if axis == rank - 1:
            return {1: Demand(b_rank - 1, demand.inner)}
        return _broadcast(node, [0, 1], demand, rank, shapes, trailing=2)
    if op == "Gemm" and axis == 0 and not attrs.get("transA", 0):
        result = {0: demand}
        if len(node.input) > 2 and node.input[2] and _spans(shapes, node.input[2], 0, demand):
            result[2] = demand
        return result
    if op in ("Softmax", "LogSoftmax"):
        softmax_axis = attrs.get("axis", -1) % rank
        return {0: demand} if softmax_axis != axis else None
    if op in ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"):
        return {0: demand} if axis < attrs.get("axis", -1) % rank else None
    if op == "Transpose":
        perm = attrs.get("perm", list(reversed(range(rank))))
        return {0: Demand(perm[axis], demand.inner)}
    if op in ("Unsqueeze", "Squeeze"):
        return _squeeze(node, demand, rank, shapes)
    if op in ("Concat", "Split"):
        if attrs.get("axis", 0) % rank == axis:
            return None
        return {i: demand for i in range(len(node.input) if op == "Concat" else 1)}
    if op == "Gather":
        data_rank, idx_rank = _rank(shapes, node.input[0]), _rank(shapes, node.input[1])
        gather_axis = attrs.get("axis", 0) % data_rank
        if gather_axis <= axis < gather_axis + idx_rank:
            return {1: Demand(axis - gather_axis, demand.inner)}
        data_axis = axis if axis < gather_axis else axis - idx_rank + 1
        return {0: Demand(data_axis, demand.inner)}
    if op == "Slice":
        # a cut along other axes (x[..., :half]); one along the positions is not a row-wise op
        starts = shapes.get(node.input[1])
        axes = shapes.constants.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        if starts is None or (len(node.input) > 3 and node.input[3] and axes is None):
            return None
        axes = [int(a) % rank for a in (axes.reshape(-1) if axes is not None else range(starts[0][0]))]
        return None if axis in axes else {0: demand}
    if op in _REDUCE:
        return _reduce(node, demand, rank, shapes, attrs)
    if op == "Reshape":
        return {0: _reshape(node, demand, shapes)}
    return None


def _broadcast(node, readers, demand: Demand, rank: int, shapes, trailing: int = 0) -> dict[int, Demand]:
    """Inputs aligned to the output's trailing axes: those spanning ``demand``'s axis get it, those of dim 1
    there (or without that axis) are read whole."""
    result = {}
    for index in readers:
        name = node.input[index]
        if not name:
            continue
        input_rank = _rank(shapes, name)
        aligned = demand.axis - (rank - input_rank)
        if aligned < 0 or aligned >= input_rank - trailing:
            continue
        if _spans(shapes, name, aligned, demand):
            result[index] = Demand(aligned, demand.inner)
        elif _dim(shapes, name, aligned) != (1, 1):
            raise NarrowingRefused(f"{node.op_type} {node.name}: input {name} neither spans nor broadcasts "
                                   "along the sequence")
    return result


def _squeeze(node, demand: Demand, rank: int, shapes) -> dict[int, Demand]:
    in_shape = shapes[node.input[0]]
    out_shape = shapes[node.output[0]]
    # the axis's position among the dims that are not 1 is the same on both sides
    kept_in = [i for i in range(len(in_shape[0])) if in_shape[0][i] != 1 or in_shape[1][i] != 1]
    kept_out = [i for i in range(len(out_shape[0])) if out_shape[0][i] != 1 or out_shape[1][i] != 1]
    if demand.axis not in kept_out or len(kept_in) != len(kept_out):
        raise NarrowingRefused(f"{node.op_type} {node.name}: cannot follow the sequence axis")
    return {0: Demand(kept_in[kept_out.index(demand.axis)], demand.inner)}


def _reduce(node, demand: Demand, rank: int, shapes, attrs) -> dict[int, Demand] | None:
    in_rank = _rank(shapes, node.input[0])
    keep = attrs.get("keepdims", 1)
    if in_rank == rank and keep:
        in_shape, out_shape = shapes[node.input[0]], shapes[node.output[0]]
        reduced = [i for i in range(rank) if out_shape[0][i] != in_shape[0][i] or out_shape[1][i] != in_shape[1][i]]
        return None if demand.axis in reduced else {0: demand}
    return None


def _reshape(node, demand: Demand, shapes) -> Demand:
    """The input demand of a Reshape whose output is demanded: the same positions in the row-major layout,
    which exists when the elements after the positions (``inner``) are the same on both sides."""
    out_shape, in_shape = shapes[node.output[0]], shapes[node.input[0]]
    inner_after = [demand.inner * math.prod(out_shape[run][demand.axis + 1:]) for run in (0, 1)]
    for axis in reversed(range(len(in_shape[0]))):
        after = [math.prod(in_shape[run][axis + 1:]) for run in (0, 1)]
        if any(a == 0 or inner_after[run] % a for run, a in enumerate(after)):
            continue
        inner = inner_after[0] // after[0]
        if inner != inner_after[1] // after[1]:
            continue
        candidate = Demand(axis, inner)
        if _spans(shapes, node.input[0], axis, candidate):
            return candidate
    raise NarrowingRefused(f"Reshape {node.name}: it does not keep the positions' rows apart")


def _rewrite(model, names: LengthNames, demands, plans, sources, roots, shapes, heavy,
             producers: dict[str, onnx.NodeProto]) -> onnx.ModelProto:
    """The narrowed graph: a narrowed copy of each planned node, sources cut, the cuts' readers rewired to
    the narrowed values, then what no output reads dropped. ``producers``: each value's node, as planned on."""
    graph = model.graph
    narrow = {name: _PREFIX + name for name in demands}
    seq, total = _PREFIX + "seq", _PREFIX + "total"
    added = [
        helper.make_node("Shape", [names.tokens], [seq], start=1, end=2),
        helper.make_node("Shape", [names.mask], [total], start=1, end=2),
    ]
    for name in sources:
        axis = demands[name].axis
        new_part = _after_past_padding(name, axis, names.past, producers)
        if new_part is not None:
            added.append(helper.make_node("Identity", [new_part], [narrow[name]]))  # ORT drops it on loading
            continue
        axis_name = f"{_PREFIX}axis{axis}"
        added += [helper.make_node("Constant", [], [axis_name],
                                   value=helper.make_tensor(axis_name, TensorProto.INT64, [1], [axis])),
                  helper.make_node("Slice", [name, names.past, names.end, axis_name], [narrow[name]])]
    added = _dedupe(added)
    for node, inputs in plans.values():
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = _PREFIX + (node.name or node.output[0])
        for index in inputs:
            copy.input[index] = narrow[node.input[index]]
        copy.output[:] = [narrow.get(out, _PREFIX + out) for out in node.output]
        if node.op_type in ("Reshape", "Expand"):
            # Expand's shape may be shorter than its output (it broadcasts with the input's rank)
            length, rank = shapes[node.input[1]][0][0], _rank(shapes, node.output[0])
            entry = demands[node.output[0]].axis - (rank - length)
            if entry >= 0:
                copy.input[1] = _scaled_shape(added, node, entry, length, seq, total)
        added.append(copy)
    for node in graph.node:
        node.input[:] = [narrow[roots[name]] if name in roots else name for name in node.input]
    for output in graph.output:
        if output.name in roots:  # a cut that is itself an output: keep its name
            added.append(helper.make_node("Identity", [narrow[roots[output.name]]], [output.name]))
    kept = [node for node in graph.node if not (node.output and node.output[0] in roots)]
    graph.ClearField("node")
    graph.node.extend(kept + added)
    _type_narrowed(graph, names, demands, narrow)
    result = _without_dead_nodes(_sorted(model))
    _check_no_whole_length_weights(result, heavy, roots)
    return result


def _after_past_padding(name: str, axis: int, past: str, producers: dict[str, onnx.NodeProto]) -> str | None:
    """X where ``name`` is ``Concat(ConstantOfShape(Concat(batch, past)), X)`` along ``axis``: the whole sequence
    made of a filler as long as the past and this call's X (own_kv_cache's token ids), whose cut from ``past`` on
    is X itself; else None. Cutting it would cost a decode step six small ops for nothing."""
    concat = producers.get(name)
    if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
        return None
    if helper.get_attribute_value(next(a for a in concat.attribute if a.name == "axis")) != axis:
        return None
    filler = producers.get(concat.input[0])
    shape = producers.get(filler.input[0]) if filler is not None and filler.op_type == "ConstantOfShape" else None
    if shape is None or shape.op_type != "Concat" or len(shape.input) != 2 or shape.input[1] != past:
        return None  # [batch, past]: the filler's dim 1 is the past's length
    return concat.input[1] if axis == 1 else None


def _type_narrowed(graph: onnx.GraphProto, names: LengthNames, demands, narrow: dict[str, str]) -> None:
    """Value infos for the narrowed values: the whole-length value's, its demanded dim this call's length
    (the new tokens' dim), unknown where the positions are merged with another axis. The fusion's
    patterns read ranks and dims from them."""
    seq_dim = next(value.type.tensor_type.shape.dim[1] for value in graph.input if value.name == names.tokens)
    total_dim = next(value.type.tensor_type.shape.dim[1] for value in graph.input if value.name == names.mask)
    # The plain export named the whole sequence's dim as the tokens' dim is now named: the values that keep
    # the whole length say so.
    for value in graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if seq_dim.dim_param and dim.dim_param == seq_dim.dim_param:
                dim.CopyFrom(total_dim)
            elif seq_dim.dim_param and seq_dim.dim_param in dim.dim_param:
                dim.Clear()
    types = {value.name: value.type for value in (*graph.input, *graph.output, *graph.value_info)}
    for name, demand in demands.items():
        if name not in types or not types[name].tensor_type.HasField("shape"):
            continue
        value_type = onnx.TypeProto()
        value_type.CopyFrom(types[name])
        dims = value_type.tensor_type.shape.dim
        if demand.axis >= len(dims):
            continue
        dims[demand.axis].Clear()
        if demand.inner == 1 and seq_dim is not None:
            dims[demand.axis].CopyFrom(seq_dim)
        graph.value_info.add(name=narrow[name]).type.CopyFrom(value_type)


def _dedupe(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    seen, result = set(), []
    for node in nodes:
        if node.output[0] not in seen:
            seen.add(node.output[0])
            result.append(node)
    return result


def _scaled_shape(added: list, node: onnx.NodeProto, entry: int, length: int, seq: str, total: str) -> str:
    """A Reshape's / Expand's target shape with the demanded axis's entry scaled from the total length to
    this call's (an entry of -1, 0 or 1 is kept: it is inferred, copied or broadcast)."""
    shape = node.input[1]
    base = _PREFIX + (node.name or node.output[0]) + ".shape"
    hot = np.zeros(length, bool)
    hot[entry] = True
    added += [
        helper.make_node("Constant", [], [base + ".hot"], value=numpy_helper.from_array(hot, base + ".hot")),
        helper.make_node("Constant", [], [base + ".one"],
                         value=helper.make_tensor(base + ".one", TensorProto.INT64, [], [1])),
        helper.make_node("Greater", [shape, base + ".one"], [base + ".sized"]),
        helper.make_node("And", [base + ".hot", base + ".sized"], [base + ".which"]),
        helper.make_node("Mul", [shape, seq], [base + ".times"]),
        helper.make_node("Div", [base + ".times", total], [base + ".scaled"]),
        helper.make_node("Where", [base + ".which", base + ".scaled", shape], [base]),
    ]
    return base


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.serde.deserialize_model(model)
    ir_model.graph.sort()
    return ir.serde.serialize_model(ir_model)


def _without_dead_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    live = {output.name for output in graph.output}
    kept = []
    for node in reversed(list(graph.node)):
        if any(out in live for out in node.output):
            kept.append(node)
            live.update(name for name in node.input if name)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    live.update(_outer_names(attribute.g))
    graph.ClearField("node")
    graph.node.extend(reversed(kept))
    names = {name for node in kept for name in (*node.input, *node.output)}
    inits = [init for init in graph.initializer if init.name in names]
    graph.ClearField("initializer")
    graph.initializer.extend(inits)
    infos = [info for info in graph.value_info if info.name in names]
    graph.ClearField("value_info")
    graph.value_info.extend(infos)
    return model


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    return {name for node in graph.node for name in node.input}


def _check_no_whole_length_weights(model: onnx.ModelProto, heavy: set[str], roots: dict[str, str]) -> None:
    """Refuse a result in which an op applying weights to activations still runs over every position: some
    reader kept the whole-length value alive (named in the refusal)."""
    readers: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, node)
    for node in model.graph.node:
        if node.name.startswith(_PREFIX) or node.op_type not in _HEAVY:
            continue
        reader = readers.get(node.output[0])
        via = f" (read whole by {reader.op_type} {reader.name})" if reader is not None else ""
        raise NarrowingRefused(f"{node.op_type} {node.name} still runs over every position{via}")


def take_position_ids(model: onnx.ModelProto, shapes, tokens: str, name: str, lengths: LengthNames | None = None
                      ) -> bool:
    """Rewire ``model`` (narrowed) so that the module's positions come from a new input ``name`` (int64 [batch, seq],
    each row's own positions) instead of the new rows of a ``Range(0, total, 1)``, or of a count of the mask's real
    tokens (``_counted_positions``, OPT's ``cumsum(mask) * mask - 1``, found by ``lengths``, the cuts' names); False
    (and ``model`` untouched) unless every use of the positions it rewires is one it can replace exactly.

    Two uses are replaced. A table lookup: ``Gather(table, r)`` or ``Gather(table, Unsqueeze(r, 0))`` where ``r``
    is the Range's new rows and the table a weight; the lookup ([seq, d] or [1, seq, d]) then becomes
    [batch, seq, d], which each reader must broadcast against a [batch, ...] operand (the embedding sum). A
    computed table (``_take_computed_positions``): rotary cos/sin of the positions times inverse frequencies.
    Other readers of the Range (a causal mask's query positions, compared with the keys') keep the padded column
    indices: the cache's columns are padded ones."""
    graph = model.graph
    producers, readers = producers_and_readers(graph)
    tables = {init.name for init in graph.initializer if len(init.dims) == 2}
    lookups: list[tuple[onnx.NodeProto, int]] = []  # (Gather, rank of its indices)
    computed: list[tuple[str, onnx.NodeProto]] = []  # (the Range's new rows, a reader whose chain computes on them)
    for node in graph.node:
        if node.op_type != "Slice" or not _is_position_range(graph, producers.get(node.input[0])):
            continue
        for reader in readers.get(node.output[0], []):
            via = reader
            if reader.op_type == "Unsqueeze" and _constant(graph, reader.input[1]) is not None and \
                    list(_constant(graph, reader.input[1]).reshape(-1)) == [0]:
                gathers = [gather for gather in readers.get(reader.output[0], [])
                           if _is_table_lookup(gather, reader.output[0], tables)]
                lookups += [(gather, 2) for gather in gathers]
                if gathers:
                    continue
            if _is_table_lookup(via, node.output[0], tables):
                lookups.append((via, 1))
            else:
                computed.append((node.output[0], reader))
    for gather, _ in lookups:
        for reader in readers.get(gather.output[0], []):
            out = reader.output[0]
            original = shapes.get(out[len(_PREFIX):] if out.startswith(_PREFIX) else out)
            # [batch, seq, d] either way: the reader must already have been one
            if reader.op_type not in _BROADCAST or original is None or len(original[0]) != 3 or \
                    original[0][0] != _PROBE_BATCH:
                return False
    rotary = _computed_position_chains(graph, computed, readers, shapes)
    counted = _counted_positions(graph, producers, readers, tables, lengths) if lengths is not None else None
    if rotary is None or not (lookups or rotary or counted):
        return False
    for gather, _ in lookups:
        gather.input[1] = name
    if counted:
        _take_counted_positions(graph, counted, name)
    looked_up = {gather.output[0] for gather, _ in lookups}
    looked_up.update(value for chain in rotary for value in chain.values)
    infos = [info for info in graph.value_info if info.name not in looked_up]
    graph.ClearField("value_info")
    graph.value_info.extend(infos)
    if rotary:
        _take_computed_positions(graph, rotary, name, shapes)
    seq_dim = next(value.type.tensor_type.shape.dim[1] for value in graph.input if value.name == tokens)
    graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", seq_dim.dim_param or None]))
    _without_dead_nodes(model)
    return True


# Ops that compare positions (a causal mask's query positions against the keys'): a chain holding one keeps the
# padded column indices, which the cache's columns are.
_COMPARISONS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}
# Ops a chain of computed positions may hold: each output row a function of the same row (narrowing proved that for
# each op along the sequence axis), with no shape read off the sequence, so that the chain computes the same rows
# when batch x seq positions are laid along the axis where seq was.
_POSITIONWISE = _UNARY | _BROADCAST | {"Unsqueeze", "Squeeze", "Concat", "Transpose", "MatMul"}


@dataclass(frozen=True)
class _PositionChain:
    """The ops computing a table from the positions' rows ``source`` ([seq]), first read by ``first``:
    ``values`` their outputs, ``boundaries`` (reader, input index) where the table meets activations."""

    source: str
    first: onnx.NodeProto
    values: frozenset[str]
    boundaries: tuple[tuple[onnx.NodeProto, int], ...]


def _computed_position_chains(graph, computed, readers, shapes) -> list[_PositionChain] | None:
    """The chains among ``computed`` (positions' rows, first reader) that compute a rotary table (a Sin or Cos of
    the positions, nothing compared), to be fed each row's own positions; None when one computes on the positions
    in a way that cannot be (it also reads another sequence-long value, reads a shape, or is a graph output)."""
    heavy = _heavy_values(graph)
    constants = {init.name for init in graph.initializer}
    constants.update(node.output[0] for node in graph.node if node.op_type == "Constant")
    outputs = {output.name for output in graph.output}
    chains = []
    for source, first in computed:
        nodes, values, boundaries, pending = [], set(), [], [first]
        while pending:
            node = pending.pop()
            if node.output[0] in values:
                continue
            nodes.append(node)
            values.update(node.output)
            for out in node.output:
                for reader in readers.get(out, []):
                    if any(o in heavy for o in reader.output):
                        boundaries.append((reader, list(reader.input).index(out)))
                    else:
                        pending.append(reader)
        ops = {node.op_type for node in nodes}
        if ops & _COMPARISONS or not ops & {"Sin", "Cos"}:
            continue  # a mask's positions, or no table computed: left on the columns
        inside = values | constants | {source}
        if not ops <= _POSITIONWISE or values & outputs or any(
                name and name not in inside for node in nodes for name in node.input):
            return None
        for reader, index in boundaries:
            if _boundary_shape(shapes, reader.input[index], reader.output[0]) is None:
                return None
        chains.append(_PositionChain(source, first, frozenset(values), tuple(boundaries)))
    return chains


def _original(shapes, name: str):
    return shapes.get(name[len(_PREFIX):] if name.startswith(_PREFIX) and name not in shapes else name)


def _boundary_shape(shapes, table: str, reader_output: str) -> tuple[int, tuple[int, ...]] | None:
    """How a computed table meets the activations: (the reader's output rank, the table's dims after its sequence
    axis), when the table is [1, ..., seq, d...] (only ones before the sequence) and the reader's output is
    [batch, ..., seq, ...] with the table's sequence axis past the batch's; else None."""
    table_shape, out_shape = _original(shapes, table), _original(shapes, reader_output)
    if table_shape is None or out_shape is None:
        return None
    axes = [axis for axis in range(len(table_shape[0]))
            if (table_shape[0][axis], table_shape[1][axis]) == shapes.totals]
    if len(axes) != 1 or any(table_shape[run][:axes[0]] != (1,) * axes[0] for run in (0, 1)):
        return None
    axis, rank, out_rank = axes[0], len(table_shape[0]), len(out_shape[0])
    after = tuple(table_shape[0][axis + 1:])
    if after != tuple(table_shape[1][axis + 1:]) or out_rank - rank + axis < 1 or \
            (out_shape[0][0], out_shape[1][0]) != (_PROBE_BATCH, _PROBE_BATCH):
        return None
    return out_rank, after


def _take_computed_positions(graph: onnx.GraphProto, chains: list[_PositionChain], name: str, shapes) -> None:
    """Feed each chain ``name`` [batch, seq] flattened to [batch * seq] where it read the positions' rows [seq]: its
    ops compute row by row, so the table comes out with batch x seq rows where it had seq; at each boundary it is
    reshaped to [batch, 1, ..., seq, d...], which broadcasts against the activations' [batch, ..., seq, ...]."""
    flat, shape = _PREFIX + name + ".flat", _PREFIX + name + ".shape"
    first = [
        helper.make_node("Constant", [], [flat + ".dims"], value=helper.make_tensor(flat + ".dims", TensorProto.INT64,
                                                                                   [1], [-1])),
        helper.make_node("Reshape", [name, flat + ".dims"], [flat]),
        helper.make_node("Shape", [name], [shape + ".batch"], start=0, end=1),
        helper.make_node("Shape", [name], [shape + ".seq"], start=1, end=2),
    ]
    before: dict[str, list[onnx.NodeProto]] = {}  # the reshapes a boundary reader reads, by its first output
    for chain in chains:
        chain.first.input[:] = [flat if value == chain.source else value for value in chain.first.input]
        for reader, index in chain.boundaries:
            table = reader.input[index]
            out_rank, after = _boundary_shape(shapes, table, reader.output[0])
            ones = out_rank - len(after) - 2  # between the batch and the sequence
            target, rows = f"{table}.rows_shape{out_rank}", f"{table}.rows{out_rank}"
            middle = f"{target}.ones", f"{target}.after"
            before.setdefault(reader.output[0], []).extend([
                helper.make_node("Constant", [], [middle[0]],
                                 value=helper.make_tensor(middle[0], TensorProto.INT64, [ones], [1] * ones)),
                helper.make_node("Constant", [], [middle[1]],
                                 value=helper.make_tensor(middle[1], TensorProto.INT64, [len(after)], list(after))),
                helper.make_node("Concat", [shape + ".batch", middle[0], shape + ".seq", middle[1]], [target], axis=0),
                helper.make_node("Reshape", [table, target], [rows]),
            ])
            reader.input[index] = rows
    # In topological order: the positions first, each reshape just before the reader it feeds.
    ordered = list(first)
    for node in graph.node:
        ordered += [*before.get(node.output[0], []), node]
    graph.ClearField("node")
    graph.node.extend(_dedupe(ordered))


# Ops between a count of the mask's real tokens and the table it indexes (OPT: Mul by the mask, Sub 1, Add its
# offset 2): elementwise, so that each row's index is a function of that row's count and mask alone.
_COUNT_OPS = {"Cast", "Identity", "Add", "Sub", "Mul"}


@dataclass(frozen=True)
class _CountedPositions:
    """Positions counted from the mask: ``count`` (the new rows of ``CumSum(mask, axis 1)``, of type ``dtype``), the
    ops from it to table lookups, and where they read the mask's new rows (node, input index, its type)."""

    count: str
    dtype: int
    mask_reads: tuple[tuple[onnx.NodeProto, int, int], ...]


def _counted_positions(graph, producers, readers, tables: set[str], lengths: LengthNames
                       ) -> list[_CountedPositions] | None:
    """Each new-rows cut (``Slice(x, past, end, axis 1)``) of ``CumSum(mask, axis 1)`` (inclusive, forward) whose
    every reader, through ``_COUNT_OPS`` whose other operands are constants or the mask's same cut, ends in a lookup
    of a position table: OPT's ``(cumsum(mask) * mask - 1) + 2`` into its learned positions. None where a count
    reaches anything else (a mask's comparisons, an output), which then keeps the module's columns."""
    outputs = {value.name for value in graph.output}
    constants = {init.name for init in graph.initializer}
    constants.update(node.output[0] for node in graph.node if node.op_type == "Constant")
    mask = next((value for value in graph.input if value.name == lengths.mask), None)
    if mask is None:
        return []
    mask_type = mask.type.tensor_type.elem_type
    found = []
    for node in graph.node:
        cut = _cut_axis(node, lengths, graph)
        cumsum = producers.get(node.input[0]) if cut is not None else None
        if cumsum is None or cumsum.op_type != "CumSum" or \
                _from_mask(producers, cumsum.input[0], lengths, mask_type) is None:
            continue
        axis = _constant(graph, cumsum.input[1])
        flags = {a.name: helper.get_attribute_value(a) for a in cumsum.attribute}
        if axis is None or axis.size != 1 or int(axis.reshape(-1)[0]) not in (1, -1) or any(flags.values()) or \
                cut not in (1, -1):
            return None
        mask_reads, pending, seen = [], [node.output[0]], set()
        while pending:
            value = pending.pop()
            for reader in readers.get(value, []):
                if _is_table_lookup(reader, value, tables) or id(reader) in seen:
                    continue
                if reader.op_type not in _COUNT_OPS or set(reader.output) & outputs:
                    return None
                seen.add(id(reader))
                for index, operand in enumerate(reader.input):
                    if operand == value or operand in constants:
                        continue
                    cut_mask = _from_mask(producers, operand, lengths, mask_type, cut_rows=True)
                    if cut_mask is None:
                        return None
                    mask_reads.append((reader, index, cut_mask))
                pending.extend(reader.output)
        found.append(_CountedPositions(node.output[0], _from_mask(producers, cumsum.input[0], lengths, mask_type),
                                       tuple(mask_reads)))
    return found


def _from_mask(producers, value: str, lengths: LengthNames, mask_type: int, cut_rows: bool = False) -> int | None:
    """The element type of ``value`` where it is the mask through Casts and Identities (``cut_rows``: its new rows,
    through one cut along its tokens); None where it is anything else."""
    dtype, sliced = None, False
    while True:
        node = producers.get(value)
        if node is None:
            if value != lengths.mask or sliced != cut_rows:
                return None
            return dtype if dtype is not None else mask_type
        if node.op_type == "Cast":
            dtype = dtype if dtype is not None else helper.get_attribute_value(node.attribute[0])
        elif node.op_type == "Slice" and cut_rows and not sliced and list(node.input[1:3]) == [lengths.past,
                                                                                                lengths.end]:
            sliced = True
        elif node.op_type != "Identity":
            return None
        value = node.input[0]


def _take_counted_positions(graph: onnx.GraphProto, counted: list[_CountedPositions], name: str) -> None:
    """Feed each count ``name + 1`` and its mask reads a 1: at a real token the mask is 1 and the count of real
    tokens up to it is its position + 1, so the module's index is the same there; a padded token's (OPT's -1)
    becomes its fed position's, which no real token reads (the mask hides its key)."""
    first = []
    for index, found in enumerate(counted):
        one, count = f"{_PREFIX}{name}.one{index}", f"{_PREFIX}{name}.count{index}"
        first += [helper.make_node("Constant", [], [one], value=helper.make_tensor(one, TensorProto.INT64, [], [1])),
                  helper.make_node("Add", [name, one], [count + ".int64"]),
                  helper.make_node("Cast", [count + ".int64"], [count], to=found.dtype)]
        for reader in graph.node:
            reader.input[:] = [count if value == found.count else value for value in reader.input]
        for reader, position, dtype in found.mask_reads:
            real = f"{_PREFIX}{name}.real{index}.{position}.{reader.output[0]}"
            first.append(helper.make_node("Constant", [], [real], value=helper.make_tensor(
                real, dtype, [], [1])))
            reader.input[position] = real
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(first + nodes)


def _is_position_range(graph: onnx.GraphProto, node: onnx.NodeProto | None) -> bool:
    if node is None or node.op_type != "Range":
        return False
    start, delta = _constant(graph, node.input[0]), _constant(graph, node.input[2])
    return start is not None and delta is not None and start.size == 1 and delta.size == 1 and \
        int(start.reshape(-1)[0]) == 0 and int(delta.reshape(-1)[0]) == 1


def _is_table_lookup(node: onnx.NodeProto, indices: str, tables: set[str]) -> bool:
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return node.op_type == "Gather" and node.input[1] == indices and node.input[0] in tables and axis == 0
