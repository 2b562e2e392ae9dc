"""Token packing: the per-token layers of a model run on its real tokens only.

Attention fusion makes the attention cheap; around it a transformer spends most
of its time in per-token work (projections, feed-forwards, norms), and a padded
batch does all of it on the padding too. This pass gathers the real tokens of a
padding mask into one [tokens + 1, ...] tensor wherever a run of per-token ops
starts, runs those ops on it, and puts the rows back to [batch, seq, ...] only
where something that is not per-token reads them: an attention, a pooling, a
model output. Real rows are the same numbers (a per-token op does not see the
other rows). The one row after the real tokens is a spare: position 0's token,
carried through like the others, so that putting rows back for an attention is
one Gather, the padded positions taking the spare row (an attention's mask
ignores padded keys, and its padded queries are dropped when packed again); so
is a model output put back (its padded rows are not compared or returned; an
output whose padded rows someone reads is not packed). Put back for anything
else, padded positions are zeros, the padding's value of a masked product
(pooling's ``x * mask``). Only axes the export measured paddable
are packed (the model's outputs do not depend on what the padding holds), and
parity against the model checks every packed export.

An op is per-token when row (b, s) of its output depends only on row (b, s) of
its [batch, seq, ...] inputs: elementwise ops, MatMul by a 2-D weight,
LayerNormalization, Softmax, Split and reductions over trailing axes, Gather of
an embedding table by token ids, Unsqueeze/Squeeze of trailing axes. Its other inputs must not span
the batch or seq axes (weights, biases, scalars), or span only seq with batch 1
(a position table [1, seq, ...], gathered by each token's position). Ops on the
masks alone stay as they are.

Packing an op is right only where nothing reads its padded rows (``_padding_readers``): what reads a
packed value must be a per-token op, an attention that masks padding, an op that moves elements with their
tokens (a head split or merge), a Shape or a per-token model output. What anything else reads (RoBERTa's
cumulative sum of position ids, an output that is not per-token) is computed unpacked, back to the inputs.
Positions read along the sequence by a fixed Gather (BERT's pooler at position 0) are packed in every row
as if real. A view flattened to [batch * seq, d] around a 2-D Gemm (GPT-2's Conv1D) packs as the projection
it is.

Gathering and putting back cost copies, so a connected run of packed ops is kept
only when its MatMul work per token is worth the rows it copies in and out
(``MIN_WORK_PER_COPIED_ELEMENT``): a whole transformer stack is one run with the
attentions inside it; a lone projection between two attentions is not.

    rows      = Concat(NonZero(Reshape(mask, [-1])), [0])    int64 [tokens + 1]
    pack(x)   = Gather(Reshape(x, [-1, ...]), rows)
    back(y)   = Gather(y, [batch, seq]: where each position's row is, else the spare row)
    zeroed(y) = the same over Pad(y, one zero row), padded positions taking the zero row
"""

from __future__ import annotations

import collections
import itertools
import math
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from mha_deploy.exporters.fusion.constant_values import constant_array
from mha_deploy.model_report import ATTENTION_INPUT_ROLES
from mha_deploy.onnx_nodes import KERNEL_PROP, PACKING_PROP
from mha_deploy.signature import PADDING_MASK, Signature

# Ops whose output row (b, s) is a function of their inputs' rows (b, s) under numpy broadcasting.
_ELEMENTWISE = {
    "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Clip", "Cos", "Div", "Elu", "Equal", "Erf", "Exp",
    "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN",
    "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "Pow",
    "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt",
    "Sub", "Tanh", "Where", "Xor",
}  # fmt: skip
# Reductions: per-token over trailing axes (a norm written out: x.mean(-1, keepdim=True), x.std(-1)).
_REDUCE_OPS = {"ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
               "ReduceSum", "ReduceSumSquare"}
# Ops over trailing axes, with the axis attribute and its default (a Split along the features: GPT-2's fused
# q, k, v projection split in three).
_AXIS_OPS = {"LayerNormalization": -1, "RMSNormalization": -1, "SimplifiedLayerNormalization": -1, "Softmax": -1,
             "LogSoftmax": -1, "Split": 0}
# Contrib ops of the fusion that are per-token like an Add in their [batch, seq, ...] inputs (fusion.norms: the
# residual sum normalised over its last axis; their scales and biases span that axis only).
_PER_TOKEN_CONTRIB = {"SkipSimplifiedLayerNormalization"}
# A run of packed ops is kept when its MatMul multiply-adds per token are at least this many times the
# elements per token it gathers in and puts back (a pre-norm block: 12 d^2 against 4 d). Packed over unpacked,
# the classifier of tests/user_models at 2 layers, 2 threads, fp32, ORT CPU, one run of
# benchmarks/token_packing.py (8x128 a quarter padded / unpadded; 1x512 the same): d_model 64 (153 per
# element) 1.06 / 0.86, 0.98 / 0.92; 128 (307) 1.16 / 0.91, 1.04 / 0.94; 256 (614) 1.18 / 0.94, 1.15 / 0.95;
# 512 (1228) 1.28 / 0.99, 1.16 / 0.98. From d_model 256 a quarter's padding gains three times what no padding
# loses.
MIN_WORK_PER_COPIED_ELEMENT = 500
PACKED_AXIS = "packed"  # the packed axis of a mask's tokens: "<mask>_packed", one per mask


@dataclass
class PackingReport:
    """What ``pack_model`` did."""

    masks: list[str] = field(default_factory=list)  # the padding masks whose real tokens were packed
    runs: int = 0  # connected runs of packed ops kept
    matmuls: int = 0  # MatMuls that run on real tokens only
    ops: int = 0  # ops that run on real tokens only
    copies: int = 0  # gathers in and scatters out
    # the largest run's MatMul multiply-adds per token over the elements per token it copies
    work_per_copied: float = 0.0
    reason: str = ""  # why nothing was packed
    # positions packed in every row as if real, because an op reads them there, e.g. "position 0 of
    # attention_mask's rows (Gather node_select reads it)"
    positions: list[str] = field(default_factory=list)
    unpacked: str = ""  # the per-token ops left unpacked because something reads their padded rows, and what

    @property
    def text(self) -> str:
        """What was packed, e.g. ``36 MatMul(s) and 60 other op(s) run on the real tokens of attention_mask
        only (...)``; or why nothing was."""
        if not self.runs:
            return f"not applied ({self.reason or 'no run of per-token ops found'})"
        return (
            f"{self.matmuls} MatMul(s) and {self.ops - self.matmuls} other op(s) run on the real tokens of "
            f"{', '.join(self.masks)} only ({self.runs} run(s) of per-token ops, {self.copies} gathers/scatters"
            f"{''.join(f'; and {read}' for read in self.positions)}{f'; {self.unpacked}' if self.unpacked else ''})"
        )

    def describe(self) -> str:
        return f"token packing: {self.text}"


@dataclass(frozen=True)
class _Mask:
    name: str
    batch: str
    seq: str


@dataclass
class _Plan:
    """One candidate op: the mask it packs by, and how each input enters packed form."""

    mask: _Mask
    rank: int  # of its (first) output, unpacked
    inputs: dict[int, str]  # input index -> "packed", "entry", "position", "squeeze" (others: as they are)
    # its output is [batch * seq, ...] (a view flattened for a 2-D Gemm, GPT-2's Conv1D), packed [tokens, ...]
    flat: bool = False
    reshape_to: tuple[int, ...] | None = None  # a Reshape's shape on packed rows

    @property
    def packed_rank(self) -> int:
        return self.rank if self.flat else self.rank - 1


def packing_masks(signature: Signature) -> list[str]:
    """The padding masks of a model along whose axis it may be padded (``Signature.paddable_axes``: a user's
    model measured at export, its real outputs not moving with what the padding holds), each the only mask of
    its axis (tensors on an axis are recognised by their shape, which two masks of one axis share). None for
    KV-cache models, whose decode calls take one token at a time."""
    if signature.kv_cache:
        return []
    masks = [spec for spec in signature.inputs if spec.role == PADDING_MASK]
    return [spec.name for spec in masks if spec.axes[1] in signature.paddable_axes
            and sum(other.axes[1] == spec.axes[1] for other in masks) == 1]


def pack_model(model: onnx.ModelProto, masks: list[str], rows_only: list[str] | None = None,
               ) -> tuple[onnx.ModelProto, PackingReport]:
    """``model`` with its per-token ops run on the real tokens of ``masks`` (bool [batch, seq] graph inputs,
    True = real token) only, and the report of what was packed; ``model`` itself is left as it was.
    ``rows_only``: the outputs whose padded rows nobody reads (``Signature.per_token_outputs``: parity compares
    an output's real rows along its own length axis only, and runners return those; None: every output with a
    mask's [batch, seq] axes first)."""
    rewritten = ir.from_proto(model)
    report = _pack_tokens(rewritten, masks, _inferred_types(model), rows_only)
    return (ir.to_proto(rewritten) if report.runs else model), report


def _pack_tokens(model: ir.Model, masks: list[str], types: dict, rows_only: list[str] | None) -> PackingReport:
    """Rewrite ``model`` in place (``pack_model``); ``types``: onnx's inferred tensor types by value name."""
    report = PackingReport()
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    mask_specs = [_mask_spec(inputs.get(name)) for name in masks]
    mask_specs = [spec for spec in mask_specs if spec is not None]
    if not mask_specs:
        report.reason = "no [batch, seq] bool padding mask input"
        return report
    _fill_missing_shapes(model, types)
    plans = _candidates(graph, mask_specs)
    read_padded, why, positions = _padding_readers(graph, plans, mask_specs, rows_only)
    if read_padded:
        plans = _candidates(graph, mask_specs, excluded=read_padded)
    runs = _runs(plans)
    kept: dict[ir.Node, _Plan] = {}
    best = (0, 0)
    for run in runs:
        work, copied = _cost(run, plans)
        best = max(best, (work, copied))
        if not work or work < MIN_WORK_PER_COPIED_ELEMENT * copied:
            continue
        report.runs += 1
        kept.update({node: plans[node] for node in run})
    report.work_per_copied = best[0] / max(best[1], 1)
    if not kept and why and not best[0]:
        report.reason = why
    elif not kept and best[0]:
        report.reason = (
            f"too small to pay for its copies: the largest run of per-token ops does {report.work_per_copied:.0f} "
            f"multiply-adds per element it copies in and out, below {MIN_WORK_PER_COPIED_ELEMENT} "
            "(about d_model 256)")
    if kept:
        _rewrite(graph, kept, report, positions, mask_specs)
        if read_padded:
            report.unpacked = f"{len(read_padded)} per-token op(s) left unpacked: {why}"
    return report


def _inferred_types(model: onnx.ModelProto) -> dict:
    """onnx's inferred tensor types of ``model``'s values, by name, inferred over a copy without the weights'
    data (their types are all inference needs of them)."""
    graph = model.graph
    inputs = {value.name for value in graph.input}
    weights = [onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
               for t in graph.initializer if t.name not in inputs]
    stripped = onnx.helper.make_model(
        onnx.helper.make_graph(graph.node, graph.name, [*graph.input, *weights], graph.output,
                               value_info=graph.value_info),
        opset_imports=model.opset_import, ir_version=model.ir_version, functions=model.functions)
    return {info.name: info.type.tensor_type for info in onnx.shape_inference.infer_shapes(stripped).graph.value_info}


def _fill_missing_shapes(model: ir.Model, types: dict) -> None:
    """Shapes for the model graph's values that have none (an If's outputs, what follows them) from onnx's
    inference (``types``); the shapes the graph has are kept (onnx's inference of the standard Attention op in
    a branch writes a 0 for a width it cannot see)."""
    for node in model.graph:
        for value in node.outputs:
            tensor = types.get(value.name)
            if value.shape is not None or tensor is None or not tensor.HasField("shape"):
                continue
            value.shape = ir.Shape([dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None)
                                    for dim in tensor.shape.dim])
            if value.dtype is None and tensor.elem_type:
                value.dtype = ir.DataType(tensor.elem_type)
        _fill_attention_shape(node)
        _fill_reshape_shape(node)


def _fill_reshape_shape(node: ir.Node) -> None:
    """A Reshape's output dims where onnx's inference left them unnamed and its shape input is built from its
    input's own Shape (torch's ``keepdim`` views: ``Concat(Shape(x)[0], Shape(x)[1], [1])``)."""
    if node.op_type != "Reshape" or node.attributes.get_int("allowzero", 0):
        return
    dims, known = _dims(node.outputs[0]), _shape_value(node.inputs[1])
    if known is None or (dims is not None and len(dims) == len(known) and not any(
            (isinstance(dim, str) and dim.startswith("unk__")) or dim is None for dim in dims)):
        return
    source = _dims(node.inputs[0]) or []
    known = [source[axis] if dim == 0 and axis < len(source) else dim for axis, dim in enumerate(known)]
    if all(dim is not None and dim != -1 for dim in known):
        node.outputs[0].shape = ir.Shape(known)


def _shape_value(value: ir.Value | None) -> list | None:
    """The elements of a 1-D shape tensor, ints or symbolic dims' names, where it is constant or Concats of
    constants and Shapes of values with known dims."""
    if value is None:
        return None
    constant = constant_array(value)
    if constant is not None:
        return [int(dim) for dim in constant.reshape(-1)] if constant.ndim <= 1 else None
    node = value.producer()
    if node is None:
        return None
    if node.op_type == "Shape":
        dims = _dims(node.inputs[0])
        if dims is None:
            return None
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", len(dims))
        return dims[start:end]
    if node.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Identity"):
        inner = _shape_value(node.inputs[0])
        return inner if inner is not None and len(inner) == 1 else None
    if node.op_type == "Concat" and node.attributes.get_int("axis", 0) == 0:
        parts = [_shape_value(part) for part in node.inputs]
        return None if any(part is None for part in parts) else [dim for part in parts for dim in part]
    return None


def _fill_attention_shape(node: ir.Node) -> None:
    """An ORT attention op's output, which onnx's inference does not know: [batch, q_len, value width], read off
    its 3-D query and value (GPT-2's Conv1D flattens it next: the flattening is packed when its rows are
    known)."""
    if node.op_type == "If" and KERNEL_PROP in node.metadata_props and node.outputs[0].shape is None:
        # the fusion's kernel If: its branches' attention ops all give the same shape
        for inner in node.attributes.values():
            if inner.type == ir.AttributeType.GRAPH:
                for op in inner.as_graph().all_nodes():
                    _fill_attention_shape(op)
                    if _is_attention(op) and op.outputs[0].shape is not None:
                        node.outputs[0].shape = ir.Shape(list(op.outputs[0].shape))
                        return
        return
    if (node.domain != "com.microsoft" or node.op_type not in ("MultiHeadAttention", "GroupQueryAttention")
            or node.outputs[0].shape is not None or len(node.inputs) < 3):
        return
    query, value = _dims(node.inputs[0]), _dims(node.inputs[2]) if node.inputs[2] is not None else None
    if query is not None and value is not None and len(query) == len(value) == 3 and isinstance(value[2], int):
        node.outputs[0].shape = ir.Shape([*node.inputs[0].shape[:2], value[2]])


def _mask_spec(value: ir.Value | None) -> _Mask | None:
    if value is None or value.dtype != ir.DataType.BOOL or value.shape is None or value.shape.rank() != 2:
        return None
    batch, seq = value.shape
    if not (isinstance(batch, ir.SymbolicDim) and isinstance(seq, ir.SymbolicDim)) or None in (
            batch.value, seq.value):
        return None
    return _Mask(value.name, batch.value, seq.value)


def _dims(value: ir.Value | None) -> list | None:
    if value is None or value.shape is None:
        return None
    return [_symbol(dim.value) if isinstance(dim, ir.SymbolicDim) else dim for dim in value.shape]


_CAPPED = re.compile(r"^Min\((?:(\d+), (\w+)|(\w+), (\d+))\)$")


def _symbol(name: str | None) -> str | None:
    """A symbolic dim's name; ``Min(512, seq)`` (a table sliced to the sequence length, as torch's exporter
    names it) is ``seq``: a longer sequence fails on the table, not on packing."""
    match = _CAPPED.match(name or "")
    return (match.group(2) or match.group(3)) if match else name


def _aligned(value: ir.Value, masks: list[_Mask]) -> _Mask | None:
    """The mask whose [batch, seq] are ``value``'s first two axes."""
    dims = _dims(value)
    if dims is None or len(dims) < 2:
        return None
    return next((mask for mask in masks if dims[0] == mask.batch and dims[1] == mask.seq), None)


def _classify(value: ir.Value, rank: int, mask: _Mask | None, masks: list[_Mask], packed: dict) -> tuple:
    """How an input of an op with output rank ``rank`` enters packed form: (kind, mask), kind one of
    "packed" (already), "entry" (a [batch, seq, ...] tensor to gather), "position" ([1, seq, ...] or
    [seq, ...]: gathered by position), "squeeze" ([1, 1, ...]), "as-is" (spans neither axis), or None (the
    op is not per-token in this input)."""
    if value in packed:  # flattened rows are read by the ops that know them only (_flat_plan)
        plan = packed[value]
        return ("packed", plan.mask) if plan.rank == rank and not plan.flat else (None, None)
    dims = _dims(value)
    if dims is None:
        return None, None
    if len(dims) <= rank - 2:
        return "as-is", None  # right-aligned, it reaches neither axis
    seq_mask = None
    if len(dims) == rank:
        aligned = _aligned(value, masks)
        if aligned is not None:
            return "entry", aligned
        if dims[0] != 1:
            return None, None
        if dims[1] == 1:
            return "squeeze", None
        seq_mask = next((m for m in masks if dims[1] == m.seq and mask in (None, m)), None)
    elif len(dims) == rank - 1:
        if dims[0] == 1:
            return "as-is", None
        seq_mask = next((m for m in masks if dims[0] == m.seq and mask in (None, m)), None)
    return ("position", seq_mask) if seq_mask is not None else (None, None)


def _candidates(graph: ir.Graph, masks: list[_Mask], excluded: set[ir.Node] = frozenset()) -> dict[ir.Node, _Plan]:
    """The model graph's ops that are per-token in some mask's axes, in graph order, but for ``excluded``.

    Ops on the masks alone are left as they are: they cost nothing worth saving, and a mask put back with zeros
    (or the spare row) at padded positions would no longer say what the mask said there. Where per-token ops
    read such a value, it is gathered in, exactly."""
    plans: dict[ir.Node, _Plan] = {}
    packed: dict[ir.Value, _Plan] = {}  # outputs of candidate ops
    mask_names = {mask.name for mask in masks}
    # values that depend on some input other than the masks
    data = {value for value in graph.inputs if value.name not in mask_names}
    for node in graph:
        # a size read off the data is not data (GPT-2's attention_mask.view(batch, -1) is the mask still)
        if node.op_type in ("Shape", "Size") or not any(value in data for value in _reads(node)):
            continue
        data.update(node.outputs)
        plan = _plan(node, masks, packed) if node not in excluded else None
        if plan is None:
            continue
        plans[node] = plan
        for output in node.outputs:
            packed[output] = plan
    return plans


def _padding_readers(graph: ir.Graph, plans: dict[ir.Node, _Plan], masks: list[_Mask],
                     rows_only: list[str] | None = None) -> tuple[set, str, dict]:
    """The candidate ops whose outputs must keep their padded rows, why (each reader that stops some), and the
    positions that ops read in every row of a mask's axis ({mask: {position: [reader, ...]}}).

    Packed, a value is right on its real rows only: put back, its padded rows hold the spare row or zeros. That
    is right where whatever reads it ignores padded rows: a per-token op (row by row), an attention whose mask
    hides padded keys (its padded query rows are padded rows again), a Shape, a per-token model output (its
    padded rows are not returned). Anything else may read them: a pooling of position 0 (BERT's pooler), a
    cumulative sum along the sequence (RoBERTa's position ids), an attention that masks no padding, a model
    output that is not per-token. What it reads must then be right on every row, and so must what that is
    computed from, back to the inputs: none of those ops is packed. But for a Gather of fixed positions along
    the sequence (the pooler's ``hidden[:, 0]``, a last token's ``hidden[:, -1]``): those positions are packed
    in every row as if they were real tokens, so their rows are right, padded or not (a row's attention sees
    its real keys: a row of padding only, whose attention sees no key, is the one left out). A masked product
    (``x * mask``) ends the walk: it is zero at padded rows, and so are its packed rows put back."""
    mask_names = {mask.name for mask in masks}
    mask_only = _mask_only_values(graph, mask_names)
    need: collections.deque[tuple[ir.Value, str]] = collections.deque()
    positions: dict[_Mask, dict[int, list[str]]] = {}
    for node in graph:
        if node in plans or node.op_type == "Shape" or _keeps_tokens(node, masks):
            continue
        if (read := _positions_read(node, masks)) is not None:
            mask, indices = read
            for index in indices:
                positions.setdefault(mask, {}).setdefault(index, []).append(f"{node.op_type} {node.name}")
            continue
        if _is_attention(node):
            if any(value in mask_only for value in _reads(node)):
                continue
            why = f"attention {node.name} masks no padding"
        else:
            why = f"{node.op_type} {node.name} reads padded rows"
        need.extend((value, why) for value in _reads(node) if value is not None)
    need.extend((value, f"output {value.name} is returned with its padded rows") for value in graph.outputs
                if _aligned(value, masks) is None or (rows_only is not None and value.name not in rows_only))
    reached: set[ir.Node] = set()
    whys: list[str] = []
    while need:
        value, why = need.popleft()  # breadth first: the reason nearest to the ops it stops
        node = value.producer()
        # a Shape reads no row; a masked product is zero at padded rows, packed or not; the positions a Gather
        # reads are packed
        if (node is None or node in reached or node.op_type in ("Shape", "Size")
                or (node in plans and _masked_product(node, plans[node].mask))
                or _positions_read(node, masks) is not None):
            continue
        reached.add(node)
        if node in plans and why not in whys:
            whys.append(why)
        need.extend((read, why) for read in _reads(node) if read is not None)
    return reached & set(plans), "; ".join(whys), positions


def _positions_read(node: ir.Node, masks: list[_Mask]) -> tuple[_Mask, list[int]] | None:
    """(mask, positions) when ``node`` is a Gather of fixed positions along a mask's seq axis."""
    if node.op_type != "Gather" or len(node.inputs) != 2:
        return None
    dims, indices = _dims(node.inputs[0]), constant_array(node.inputs[1])
    mask = _aligned(node.inputs[0], masks)
    if mask is None or indices is None or indices.ndim > 1 or indices.size > 8 or indices.dtype.kind not in "iu":
        return None
    axis = node.attributes.get_int("axis", 0)
    if (axis + len(dims) if axis < 0 else axis) != 1:
        return None
    return mask, sorted({int(index) for index in indices.reshape(-1)})


def _keeps_tokens(node: ir.Node, masks: list[_Mask]) -> bool:
    """``node`` moves each element of a [batch, seq, ...] tensor with its token (a head split or merge, a
    broadcast over trailing axes): its
    padded rows' elements are padded rows' elements again, wherever they go. What reads them is checked as
    anything else that reads a packed value."""
    if node.op_type in ("Transpose", "Identity"):
        return True
    if node.op_type == "Split":
        axis, rank = node.attributes.get_int("axis", 0), len(_dims(node.inputs[0]) or [])
        return axis >= 2 or (rank > 0 and axis + rank >= 2)
    if node.op_type not in ("Reshape", "Expand"):
        return False
    shape = constant_array(node.inputs[1]) if node.op_type == "Reshape" else None
    if shape is not None and not node.attributes.get_int("allowzero", 0) and shape.size >= 2 and not shape.reshape(
            -1)[:2].any():
        return True  # [0, 0, ...]: the first two axes kept, the tokens' elements split or merged after them
    values = [node.inputs[0], *node.outputs]
    return any(all((_dims(value) or []).count(mask.batch) == 1 and (_dims(value) or []).count(mask.seq) == 1
                   for value in values)
               for mask in masks)


def _mask_only_values(graph: ir.Graph, mask_names: set[str]) -> set[ir.Value]:
    """Values computed from the padding masks and no other input's content (sizes read with Shape aside)."""
    mask_derived = {value for value in graph.inputs if value.name in mask_names}
    content = {value for value in graph.inputs if value.name not in mask_names}
    for node in graph.all_nodes():
        if node.op_type in ("Shape", "Size"):
            continue
        reads = _reads(node)
        if any(value in content for value in reads):
            content.update(node.outputs)
        if any(value in mask_derived for value in reads):
            mask_derived.update(node.outputs)
    return mask_derived - content


def _is_attention(node: ir.Node) -> bool:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return (domain, node.op_type) in ATTENTION_INPUT_ROLES or (
        node.op_type == "If" and KERNEL_PROP in node.metadata_props)


def _masked_product(node: ir.Node, mask: _Mask) -> bool:
    """``node`` is x * (the padding mask ``mask``, cast, given trailing axes or broadcast over them): zero at
    padded rows."""
    if node.op_type != "Mul":
        return False
    for value in node.inputs:
        while value is not None and value.name != mask.name:
            producer = value.producer()
            if producer is None or producer.op_type not in ("Cast", "CastLike", "Identity", "Unsqueeze", "Expand"):
                break
            # the mask's axes stay the first two
            if (_dims(producer.outputs[0]) or [])[:2] != [mask.batch, mask.seq]:
                break
            value = producer.inputs[0]
        if value is not None and value.name == mask.name and value.producer() is None:
            return True
    return False


def _reads(node: ir.Node) -> list[ir.Value | None]:
    """Every value ``node`` reads: its inputs, and what the ops of its subgraphs read (an If's branches read the
    attention's query, key and value from the graph around them; its input is only the condition)."""
    values = list(node.inputs)
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.GRAPH:
            values += [value for inner in attribute.as_graph().all_nodes() for value in inner.inputs]
    return values


def _axes(node: ir.Node) -> list[int] | None:
    """The constant axes of an Unsqueeze, Squeeze or reduction (an input from opset 13 or 18, an attribute
    before); None when they are not constant, or not given (a reduction over every axis)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = constant_array(node.inputs[1])
        return None if axes is None else [int(axis) for axis in axes.reshape(-1)]
    attribute = node.attributes.get("axes")
    return list(attribute.as_ints()) if attribute is not None else None


def _plan(node: ir.Node, masks: list[_Mask], packed: dict) -> _Plan | None:
    out_dims = _dims(node.outputs[0]) if node.outputs else None
    rank = len(out_dims) if out_dims is not None else None
    if node.domain == "com.microsoft" and node.op_type in _PER_TOKEN_CONTRIB:
        # normalised over the last axis, which must not be the sequence
        return _elementwise_plan(node, masks, packed, rank) if rank is not None and rank >= 3 else None
    if node.domain not in ("", "ai.onnx") or not node.outputs:
        return None
    op = node.op_type
    if op in ("Gemm", "Reshape") or (op == "MatMul" and node.inputs[0] in packed and packed[node.inputs[0]].flat):
        return _flat_plan(node, masks, packed, out_dims)
    if op == "MatMul":
        data, weight = node.inputs
        weight_dims = _dims(weight)
        if weight_dims is None or len(weight_dims) != 2 or rank is None or rank < 3:
            return None
        kind, mask = _classify(data, rank, None, masks, packed)
        return _Plan(mask, rank, {0: kind}) if kind in ("packed", "entry") else None
    if op == "Gather":
        table, ids = node.inputs
        if node.attributes.get_int("axis", 0) != 0 or rank is None or table in packed:
            return None
        table_dims, ids_dims = _dims(table), (_dims(ids) if ids not in packed else None)
        if table_dims is None or _aligned(table, masks) is not None:
            return None
        ids_rank = packed[ids].rank if ids in packed else (len(ids_dims) if ids_dims else None)
        if ids_rank is None or ids_rank < 2:
            return None
        kind, mask = _classify(ids, ids_rank, None, masks, packed)
        return _Plan(mask, rank, {1: kind}) if kind in ("packed", "entry") else None
    if op in ("Unsqueeze", "Squeeze") or op in _REDUCE_OPS:
        data = node.inputs[0]
        axes = _axes(node)
        data_rank = packed[data].rank if data in packed else len(_dims(data) or [])
        if not axes or rank is None or data_rank < 2:
            return None
        axes_rank = rank if op == "Unsqueeze" else data_rank
        if any((axis + axes_rank if axis < 0 else axis) < 2 for axis in axes):
            return None
        kind, mask = _classify(data, data_rank, None, masks, packed)
        return _Plan(mask, rank, {0: kind}) if kind in ("packed", "entry") else None
    if op in _AXIS_OPS:
        axis = node.attributes.get_int("axis", _AXIS_OPS[op])
        if rank is None or (axis + rank if axis < 0 else axis) < 2:
            return None
        kind, mask = _classify(node.inputs[0], rank, None, masks, packed)
        # scale and bias cover the normalised (trailing) axes only
        return _Plan(mask, rank, {0: kind}) if kind in ("packed", "entry") else None
    if op not in _ELEMENTWISE or rank is None or rank < 2:
        return None
    return _elementwise_plan(node, masks, packed, rank)


def _elementwise_plan(node: ir.Node, masks: list[_Mask], packed: dict, rank: int) -> _Plan | None:
    """Each input enters by how it spans [batch, seq] (all by one mask); at least one is an activation."""
    kinds: dict[int, str] = {}
    mask = None
    for index, value in enumerate(node.inputs):
        if value is None:
            continue
        kind, value_mask = _classify(value, rank, mask, masks, packed)
        if kind is None or (value_mask is not None and mask is not None and value_mask != mask):
            return None
        mask = mask or value_mask
        kinds[index] = kind
    if not any(kind in ("packed", "entry") for kind in kinds.values()):
        return None
    return _Plan(mask, rank, kinds)


def _flat_plan(node: ir.Node, masks: list[_Mask], packed: dict, out_dims: list | None) -> _Plan | None:
    """A projection on a view flattened to [batch * seq, d] (``x.view(-1, d)``, a 2-D Gemm or MatMul, the view
    back to [batch, seq, ...]), as GPT-2's Conv1D runs its ``addmm``. Packed, the rows are the tokens either
    way: the views keep them, the projection runs on them."""
    data = node.inputs[0]
    source = packed.get(data)
    # the axes after the rows: fixed sizes
    if out_dims is None or not all(isinstance(dim, int) for dim in out_dims[2 if node.op_type == "Reshape" else 1:]):
        return None
    if node.op_type in ("Gemm", "MatMul"):
        weight, bias = node.inputs[1], (node.inputs[2] if len(node.inputs) > 2 else None)
        if (source is None or not source.flat or node.attributes.get_int("transA", 0) or weight in packed
                or len(_dims(weight) or []) != 2 or not all(isinstance(dim, int) for dim in _dims(weight))):
            return None
        if bias is not None and (bias in packed or len(_dims(bias) or [0, 0, 0]) > 2
                                 or (len(_dims(bias)) == 2 and _dims(bias)[0] != 1)):
            return None  # a bias with rows of its own
        return _Plan(source.mask, len(out_dims), {0: "packed"}, flat=True)
    in_dims = _dims(data)
    row_axes = 1 if source and source.flat else 2
    if in_dims is None or len(in_dims) < 2 or not all(isinstance(dim, int) for dim in in_dims[row_axes:]):
        return None
    if source is not None and source.flat:
        # [batch * seq, ...] -> [batch, seq, ...]: on packed rows, [tokens, ...] whatever its shape input says
        if out_dims[:2] != [source.mask.batch, source.mask.seq] or math.prod(out_dims[2:]) != math.prod(
                in_dims[1:]):
            return None
        return _Plan(source.mask, len(out_dims), {0: "packed"}, reshape_to=(-1, *out_dims[2:]))
    kind, mask = _classify(data, len(in_dims), None, masks, packed)
    if kind not in ("packed", "entry"):
        return None
    if out_dims[:2] == [mask.batch, mask.seq] and all(isinstance(dim, int) for dim in out_dims[2:]) and math.prod(
            out_dims[2:]) == math.prod(in_dims[2:]):
        # [batch, seq, ...] -> [batch, seq, ...] (GPT-2's view back to its input's shape, computed)
        return _Plan(mask, len(out_dims), {0: kind}, reshape_to=(-1, *out_dims[2:]))
    # [batch, seq, ...] -> [batch * seq, ...]: a shape [-1, ...] keeps its rows' elements together
    shape = constant_array(node.inputs[1])
    if shape is None or (node.attributes.get_int("allowzero", 0) and not shape.all()):
        return None
    shape = [int(dim) for dim in shape.reshape(-1)]
    if (len(shape) < 2 or shape[0] != -1 or min(shape[1:]) < 1
            or math.prod(shape[1:]) != math.prod(in_dims[2:])):
        return None
    return _Plan(mask, len(shape), {0: kind}, flat=True)


def _runs(plans: dict[ir.Node, _Plan]) -> list[list[ir.Node]]:
    """Candidate ops joined where one reads another's output; each run in graph order."""
    parent = {node: node for node in plans}

    def root(node):
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node, plan in plans.items():
        for index, kind in plan.inputs.items():
            if kind == "packed":
                parent[root(node)] = root(node.inputs[index].producer())
    runs: dict[ir.Node, list[ir.Node]] = {}
    for node in plans:
        runs.setdefault(root(node), []).append(node)
    return list(runs.values())


def _row_elements(value: ir.Value, skip: int) -> int:
    dims = _dims(value)
    if dims is None or not all(isinstance(dim, int) for dim in dims[skip:]):
        return 1 << 20  # unknown: too many to copy
    return math.prod(dims[skip:])


def _exits(value: ir.Value, run: set) -> list:
    """The uses of ``value`` outside ``run`` (ops of other runs or not packed, ops in subgraphs)."""
    return [use for use in value.uses() if use.node not in run]


def _cost(run: list[ir.Node], plans: dict[ir.Node, _Plan]) -> tuple[int, int]:
    """Multiply-adds per token in the run's MatMuls; elements per token it gathers in and scatters out."""
    members = set(run)
    work = copied = 0
    entries = set()
    for node in run:
        plan = plans[node]
        if node.op_type in ("MatMul", "Gemm"):
            weight = _dims(node.inputs[1])
            work += weight[0] * weight[1] if all(isinstance(d, int) for d in weight) else 0
        for index, kind in plan.inputs.items():
            value = node.inputs[index]
            if kind in ("entry", "position") and value not in entries:
                entries.add(value)
                copied += _row_elements(value, 2 if kind == "entry" or len(_dims(value)) == plan.rank else 1)
        for output in node.outputs:
            if _exits(output, members) or output.is_graph_output():
                copied += _row_elements(output, 1 if plan.flat else 2)
    return work, copied


class _Index:
    """The index tensors of one mask, made on first use, ahead of ``anchor`` (the graph's first op)."""

    def __init__(self, graph: ir.Graph, mask: _Mask, anchor: ir.Node, positions: list[int] = ()):
        self.graph, self.mask, self.anchor = graph, mask, anchor
        self.value = next(value for value in graph.inputs if value.name == mask.name)
        self.positions = list(positions)  # packed in every row as if real (_padding_readers)
        self._cache: dict[str, ir.Value] = {} if self.positions else {"rows": self.value}

    def get(self, what: str) -> ir.Value:
        if what in self._cache:
            return self._cache[what]
        # what this one is made from first, so that its nodes go in ahead of this one's
        made_from = {"flat": ["rows"], "real": ["flat"], "position": ["real"], "row": ["flat"],
                     "zero_row": ["flat", "row"], "row_grid": ["row"], "zero_row_grid": ["zero_row"]}.get(what, [])
        sources = [self.get(name) for name in made_from]
        tape = ir.tape.Tape()
        prefix = f"{self.mask.name}_packing"
        if what == "rows":  # bool [batch, seq]: the mask, or it and the positions read in every row
            seq = tape.op("Shape", [self.value], attributes={"start": 1, "end": 2})
            at = tape.op("Range", [_int64(tape, 0), tape.op("Squeeze", [seq]), _int64(tape, 1)])
            wanted = tape.op("Mod", [tape.op("Add", [_int64(tape, self.positions), seq]), seq])  # -1: the last
            hit = tape.op("Equal", [tape.op("Unsqueeze", [at, _int64(tape, [1])]), wanted])  # [seq, positions]
            read = tape.op("Greater", [tape.op("ReduceMax", [tape.op("Cast", [hit], attributes={
                "to": ir.DataType.INT64}), _int64(tape, [1])], attributes={"keepdims": 0}), _int64(tape, 0)])
            value = tape.op("Or", [self.value, read], name=f"{prefix}_rows")
        elif what == "flat":
            value = tape.op("Reshape", [sources[0], _int64(tape, [-1])], name=f"{prefix}_flat")
        elif what == "real":  # int64 [tokens + 1]: the flat positions of the real tokens, then position 0
            real = tape.op("Reshape", [tape.op("NonZero", sources), _int64(tape, [-1])])
            value = tape.op("Concat", [real, _int64(tape, [0])], attributes={"axis": 0}, name=f"{prefix}_real")
        elif what == "position":  # int64 [tokens + 1]: each packed row's position in its row
            seq = tape.op("Shape", [self.value], attributes={"start": 1, "end": 2})
            value = tape.op("Mod", [sources[0], seq], name=f"{prefix}_position")
        elif what == "row":  # int64 [batch * seq]: each position's packed row; padding the spare row after them
            count = tape.op("Cast", sources, attributes={"to": ir.DataType.INT64})
            rank = tape.op("Sub", [tape.op("CumSum", [count, _int64(tape, 0)]), _int64(tape, 1)])
            total = tape.op("ReduceSum", [count], attributes={"keepdims": 1})
            value = tape.op("Where", [sources[0], rank, total], name=f"{prefix}_row")
        elif what == "zero_row":  # the same, padding one row further on: a zero row added after the spare one
            value = tape.op("Add", [sources[1], tape.op("Cast", [tape.op("Not", [sources[0]])],
                                                             attributes={"to": ir.DataType.INT64})])
        elif what in ("row_grid", "zero_row_grid"):  # the same as [batch, seq]: Gather by it gives [batch, seq, ...]
            value = tape.op("Reshape", [sources[0], tape.op("Shape", [self.value])], name=f"{prefix}_{what}")
        else:
            raise ValueError(what)
        _insert(self.graph, tape, before=self.anchor)
        self._cache[what] = value
        return value


def _insert(graph: ir.Graph, tape, before: ir.Node | None = None, after: ir.Node | None = None) -> None:
    """Put ``tape``'s nodes into ``graph``, every value named (ORT wants names unique across subgraphs too,
    and a serialiser's default names are not), none with a name the model holds already."""
    taken = graph.meta.get("packing_names_taken")
    if taken is None:
        taken = graph.meta["packing_names_taken"] = _value_names(graph)
    for node in tape.nodes:
        for output in node.outputs:
            while output.name is None or output.name in taken:
                output.name = f"packing_{next(_NAMES)}"
            taken.add(output.name)
    if before is not None:
        graph.insert_before(before, tape.nodes)
    else:
        graph.insert_after(after, tape.nodes)


_NAMES = itertools.count()


def _value_names(graph: ir.Graph) -> set[str]:
    names = {value.name for value in graph.inputs} | set(graph.initializers)
    for node in graph.all_nodes():
        names.update(value.name for value in node.outputs)
    return names


def _int64(tape, value) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(np.array(value, np.int64))})


def _rewrite(graph: ir.Graph, kept: dict[ir.Node, _Plan], report: PackingReport,
             positions: dict[_Mask, dict[int, list[str]]], masks: list[_Mask]) -> None:
    indexes: dict[_Mask, _Index] = {}
    anchor = next(iter(graph))
    entries: dict[tuple[ir.Value, str], ir.Value] = {}
    members = set(kept)
    attention_nodes = _attention_nodes(graph)

    def index(mask: _Mask) -> _Index:
        if mask not in indexes:
            indexes[mask] = _Index(graph, mask, anchor, sorted(positions.get(mask, {})))
        return indexes[mask]

    for node, plan in kept.items():
        tape = ir.tape.Tape()
        for position, kind in plan.inputs.items():
            value = node.inputs[position]
            key = (value, kind)
            if kind in ("packed", "as-is"):
                continue
            if key not in entries:
                entries[key] = _enter(tape, value, kind, plan, index(plan.mask))
                report.copies += kind in ("entry", "position")
            node.replace_input_with(position, entries[key])
        _packed_attributes(tape, node, plan)
        if tape.nodes:
            _insert(graph, tape, before=node)
        report.ops += 1
        report.matmuls += node.op_type in ("MatMul", "Gemm")
        for output in node.outputs:
            _leave(graph, output, plan, index(plan.mask), members, attention_nodes, masks, report)
    report.masks = sorted({plan.mask.name for plan in kept.values()})
    report.positions = [
        f"position {position} of {mask.name}'s rows ({', '.join(readers)} read{'s' if len(readers) == 1 else ''} it)"
        for mask in indexes for position, readers in sorted(positions.get(mask, {}).items())]
    # inspect reads it there, as it reads the kernels off the fusion's Ifs
    first = min(indexes.values(), key=lambda index: index.mask.name)
    first.get("real").producer().metadata_props[PACKING_PROP] = report.text
    graph.sort()


def _enter(tape, value: ir.Value, kind: str, plan: _Plan, index: _Index) -> ir.Value:
    if kind == "squeeze":
        return tape.op("Squeeze", [value, _int64(tape, [0])])
    skip = 2 if kind == "entry" or len(_dims(value)) == plan.rank else 1
    by = index.get("real" if kind == "entry" else "position")
    rows = tape.op("Concat", [_int64(tape, [-1]), tape.op("Shape", [value], attributes={"start": skip})],
                   attributes={"axis": 0})
    return tape.op("Gather", [tape.op("Reshape", [value, rows]), by], attributes={"axis": 0},
                   name=f"{value.name}_packed")


def _packed_attributes(tape, node: ir.Node, plan: _Plan) -> None:
    """Axis attributes and inputs of ``node`` counted from the front lose the batch axis; a Reshape to
    [batch, seq, ...] takes the packed rows' shape."""
    if plan.reshape_to is not None:
        node.replace_input_with(1, _int64(tape, list(plan.reshape_to)))
    elif node.op_type in _AXIS_OPS:
        axis = node.attributes.get_int("axis", _AXIS_OPS[node.op_type])
        if axis >= 0:
            node.attributes["axis"] = ir.AttrInt64("axis", axis - 1)
    elif node.op_type in ("Unsqueeze", "Squeeze") or node.op_type in _REDUCE_OPS:
        axes = _axes(node)
        # Unsqueeze's axes count in its output, the others' in their input
        kept = node.op_type in _REDUCE_OPS and node.attributes.get_int("keepdims", 1)
        rank = plan.rank if node.op_type == "Unsqueeze" or kept else plan.rank + len(axes)
        packed_axes = [(axis + rank if axis < 0 else axis) - 1 for axis in axes]
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            node.replace_input_with(1, _int64(tape, packed_axes))
        else:
            node.attributes["axes"] = ir.AttrInt64s("axes", packed_axes)


def _attention_nodes(graph: ir.Graph) -> set[ir.Node]:
    """The nodes that read a tensor's padded rows only where they cannot matter: the model's attention ops
    (their mask blocks padded keys; their padded queries' rows are dropped when packed again), everything in
    the branches of the fusion's kernel Ifs, and Shapes."""
    found = set()
    for node in graph.all_nodes():
        domain = "" if node.domain == "ai.onnx" else node.domain
        if (domain, node.op_type) in ATTENTION_INPUT_ROLES or node.op_type == "Shape":
            found.add(node)
        elif node.op_type == "If" and KERNEL_PROP in node.metadata_props:
            found.update(inner for branch in node.attributes.values() if branch.type == ir.AttributeType.GRAPH
                         for inner in branch.as_graph().all_nodes())
    return found


def _reaches_attentions_only(node: ir.Node, attention_nodes: set, masks: list[_Mask]) -> bool:
    """``node`` is an attention, or moves elements with their tokens (a head split, its transpose) into what
    reaches attentions only: padded rows it reads land on padded rows of an attention's input."""
    if node in attention_nodes:
        return True
    return _keeps_tokens(node, masks) and not any(output.is_graph_output() for output in node.outputs) and all(
        _reaches_attentions_only(use.node, attention_nodes, masks) for output in node.outputs
        for use in output.uses())


def _leave(graph: ir.Graph, value: ir.Value, plan: _Plan, index: _Index, members: set,
           attention_nodes: set, masks: list[_Mask], report: PackingReport) -> None:
    """Scatter ``value`` back to [batch, seq, ...] for its readers outside the run, in one Gather by a
    [batch, seq] index (no Reshape after it: ORT copies a Reshape that is a model output, a whole logits
    tensor). Padded positions take the spare row where only attentions (which mask them) and the model's
    outputs (whose padded rows nobody reads: ``_padding_readers`` keeps any other output unpacked) read the
    value; zeros, one Pad away, where anything else may."""
    exits = _exits(value, members)
    is_output = value.is_graph_output()
    dims, unpacked_shape = _dims(value), value.shape
    if dims is not None:
        value.shape = ir.Shape([f"{index.mask.name}_{PACKED_AXIS}", *value.shape[1 if plan.flat else 2:]])
    if not exits and not is_output:
        return
    tape = ir.tape.Tape()
    original = value.name
    # flattened rows ([batch * seq, ...]) are gathered by the flat index
    grid = "" if plan.flat else "_grid"
    if all(_reaches_attentions_only(use.node, attention_nodes, masks) for use in exits) and (not exits or (
            plan.packed_rank >= 2 and not plan.flat and value.dtype is not None
            and value.dtype.is_floating_point())):
        back = tape.op("Gather", [value, index.get(f"row{grid}")], attributes={"axis": 0},
                       name=f"{original}_unpacked")
    else:
        rank = plan.packed_rank
        padded = tape.op("Pad", [value, _int64(tape, [0] * rank + [1] + [0] * (rank - 1))])
        back = tape.op("Gather", [padded, index.get(f"zero_row{grid}")], attributes={"axis": 0},
                       name=f"{original}_unpacked")
    back.shape, back.dtype = unpacked_shape, value.dtype
    _insert(graph, tape, after=value.producer())
    report.copies += 1
    for use in exits:
        use.node.replace_input_with(use.idx, back)
    if is_output:
        value.name = f"{original}_packed"
        back.name = original
        graph.outputs[graph.outputs.index(value)] = back
