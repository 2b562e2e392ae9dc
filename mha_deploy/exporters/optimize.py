"""``optimize_model``: an ONNX file exported elsewhere -> the fused, checked model ``export`` writes.

A user who already has ONNX (``torch.onnx.export`` of their model, by either exporter, at an opset from 18 to
23) declares its inputs as for ``export --module`` (``NAME:ROLE[:AXIS][:FEATURES]``); the graph says the rest:

- each declared input must be an input of the graph, of an element type its role allows, with a dynamic batch
  and length; every input of the graph must be declared;
- the outputs, and whether each has a row per position (its axis 1 a declared length axis) or one per item,
  from the graph's shapes, its dynamic dims renamed after the declared axes; where the graph does not say,
  from running it in ORT at two sizes (``probes.output_axes``, as ``export --module`` runs the module);
- the length axes that right-padding leaves every real output unchanged along, measured in ORT on the input
  graph (``probes.paddable_axes``, as ``export --module`` measures the module in torch);
- the vocabulary of each tokens input, from the embedding table its ids index (``token_tables``: the ids
  themselves, not positions computed from them).

Then the export's own passes (``export._finish``): the fusion chain, parity of the fused graph against the
input graph, both in ORT on the CPU with graph optimisations off, at unseen shapes on both padding sides, and
the Signature written into the file, so that runtime, batch and serving take the model like any other.

The written model takes what every mha-deploy model takes: bool padding masks and int64 token ids. A graph
that takes integer masks (a tokenizer's attention_mask) or int32 ids gets a Cast after that input, rather than
its type recorded: the Signature's padding masks are bool everywhere they are read (runtime validation, the
batch planner's padding, the v2 protocol's BOOL tensors, Triton's config), and a Cast of a [batch, seq] tensor
is exact and costs nothing next to attention. The reference run feeds the input graph the same values in its
own types, so parity checks the Cast too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto

from mha_deploy.atomic import same_file
from mha_deploy.errors import ExportError, ModelFileError, first_line, raises_export_errors
from mha_deploy.exporters.export import (
    ExportOptions,
    ExportResult,
    _check_output,
    _finish,
    capped_cases,
    widest_attention,
)
from mha_deploy.exporters.fusion.pipeline import MAX_IR_VERSION
from mha_deploy.exporters.own_model import ROLES, InputDecl, count_attentions, declare_inputs, graph_vocabularies
from mha_deploy.exporters.parity import ParityCase, default_cases
from mha_deploy.exporters.probes import output_axes, paddable_axes, probe_feeds, unpadded_mask_warnings
from mha_deploy.exporters.quantize import Quantization
from mha_deploy.metadata import MAX_OPSET, MIN_OPSET, ModelMetadata
from mha_deploy.onnx_nodes import default_opset, fresh_name
from mha_deploy.runtime.model_check import check_branch_ranks
from mha_deploy.signature import (
    BATCH_AXIS,
    MODEL_DTYPE,
    OUTPUT,
    PADDING_MASK,
    SEQUENCE,
    TOKENS,
    Signature,
    TensorSpec,
)
from mha_deploy.token_tables import indexed_tables

# Per declared role: the element types a graph's input may have, what the written model takes, and how
# errors describe the role.
_ACCEPTED_TYPES = {
    "tokens": (TensorProto.INT64, TensorProto.INT32),
    "segments": (TensorProto.INT64, TensorProto.INT32),
    "sequence": (TensorProto.FLOAT,),
    "image": (TensorProto.FLOAT,),
    "audio": (TensorProto.FLOAT,),
    "padding-mask": (TensorProto.BOOL, TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
                     TensorProto.UINT8),
}
_WRITTEN_TYPES = {"tokens": TensorProto.INT64, "segments": TensorProto.INT64, "sequence": TensorProto.FLOAT,
                  "padding-mask": TensorProto.BOOL, "image": TensorProto.FLOAT, "audio": TensorProto.FLOAT}
_ROLE_TEXT = {
    "tokens": "token ids: int64 or int32 [batch, seq]",
    "segments": "segment ids: int64 or int32 [batch, seq]",
    "sequence": "a sequence: float32 [batch, seq, features]",
    "padding-mask": "a padding mask: bool or integer [batch, seq]",
    "image": "an image: float32 [batch, channels, height, width]",
    "audio": "audio features: float32 [batch, mel, frames]",
}
_ROLE_RANKS = {"tokens": 2, "segments": 2, "sequence": 3, "padding-mask": 2, "image": 4, "audio": 3}
_OUTPUT_TYPES = {TensorProto.FLOAT: MODEL_DTYPE, TensorProto.INT64: "int64", TensorProto.BOOL: "bool"}
# The weights one model file can hold: protobuf refuses to serialise a message of 2 GB or more.
_MAX_MODEL_BYTES = 2**31 - 1
_FOUR_BIT_TYPES = {TensorProto.INT4, TensorProto.UINT4, getattr(TensorProto, "FLOAT4E2M1", TensorProto.INT4)}


@dataclass(frozen=True)
class _ProbeSizes:
    """A batch and a length per declared axis, to run the input graph at (``probes.ProbeSizes``)."""

    batch: int
    lengths: Mapping[str, int]


# The two sizes a graph without output shapes is run at: the batch and every length differ between them.
_PROBE_BATCHES, _PROBE_LENGTHS = (2, 4), ((3, 5, 7, 11), (6, 9, 13, 17))


@raises_export_errors
def optimize_model(
    source: str | os.PathLike,
    output: str | os.PathLike,
    inputs: Sequence[InputDecl | str],
    *,
    output_names: Sequence[str] | None = None,
    fuse: str = "auto",
    atol: float | None = None,
    rtol: float | None = None,
    max_length: int | None = None,
    parity_cases: tuple[ParityCase, ...] | None = None,
    pack_tokens: bool = True,
    quantize: str | Quantization = "none",
) -> ExportResult:
    """Fuse the attentions of the ONNX graph ``source`` (exported elsewhere) and write it to ``output``.

    ``inputs``: every input of the graph, as ``InputDecl`` s or ``"NAME:ROLE[:AXIS][:FEATURES]"`` strings
    (roles ``tokens``, ``sequence``, ``padding-mask``, as for ``export_model``). ``output_names`` renames the
    graph's outputs, in order. ``fuse`` as for ``export_mha`` (``auto`` falls back to the unfused graph with a
    warning; ``mha``/``onnx`` fail, writing nothing, if an attention stays unfused). Parity of the written graph
    against ``source``, both in ORT, is checked at unseen shapes, lengths capped at ``max_length``, which the
    file records (a longer sequence is refused).
    ``pack_tokens`` and ``quantize`` as for ``export_model`` (``ExportOptions``): a quantized graph is judged
    against ``source`` by its relative error, recorded with the logits' top-1 agreement. Raises
    ``ExportError`` (``ParityError`` for parity; of another layer's kind too, as ``export_model``'s) and writes
    nothing when anything fails.
    """
    output = _check_output(output)
    if max_length is not None and max_length < 1:
        raise ExportError(f"max length must be at least 1, got {max_length}")
    model = _load(source, output)
    try:
        check_branch_ranks(model, str(source))
    except ModelFileError as exc:  # the load check's words, as an export error: nothing is written
        raise ExportError(str(exc)) from exc
    options = ExportOptions(opset=_default_opset(model, source), atol=atol, rtol=rtol, fuse=fuse,
                            pack_tokens=pack_tokens, quantize=quantize)
    options.check()
    decls = declare_inputs(inputs)
    graph_inputs, graph_outputs = _interface(model, decls, source)
    names = _output_names(graph_outputs, output_names)
    axes_of = _axes_of_dims(decls, graph_inputs)
    marks = {d.axis: d.name for d in reversed(decls) if d.role in ("tokens", "sequence")}
    specs = tuple(_input_spec(decl, graph_inputs[decl.name], marks.get(decl.axis)) for decl in decls)
    specs, vocabulary_warnings = graph_vocabularies(specs, model)
    reference = GraphReference(model, {d.name: graph_inputs[d.name].elem_type for d in decls},
                               dict(zip(graph_outputs, names, strict=True)))
    outputs = _output_specs(graph_outputs, names, axes_of, specs, reference)
    draft = Signature.custom(specs, outputs)
    signature = Signature.custom(specs, outputs, paddable_axes(draft, reference))
    warnings = [*unpadded_mask_warnings(signature), *vocabulary_warnings]
    plain = _written_interface(model, decls, graph_inputs, names)
    _declare_shapes(plain, signature)
    attention_ops = count_attentions(plain)
    if attention_ops == 0:
        warnings.append("the graph holds no attention subgraph (Softmax over MatMul scores): nothing to fuse")
    widths = [spec.axes[2] for spec in specs if spec.role == SEQUENCE]
    # The model's width where no attention says it: a sequence's, a token table's, else (images, audio) the last
    # fixed size of the first float output.
    width = next(iter(widths), 0) or _embedding_width(model, specs) or next(
        (spec.axes[-1] for spec in outputs if spec.dtype == MODEL_DTYPE and isinstance(spec.axes[-1], int)), 0)
    d_model, heads = widest_attention(plain, width)
    metadata = ModelMetadata(d_model=d_model, num_heads=heads, signature=signature, layers=max(attention_ops, 1),
                             max_length=max_length)
    options = replace(options, parity_cases=parity_cases or capped_cases(default_cases(signature), max_length))
    result = _finish(reference, plain, metadata, output, options, attention_ops)
    result.warnings[:0] = warnings
    return result


def _load(source: str | os.PathLike, output: Path) -> onnx.ModelProto:
    """The graph at ``source`` with its external data, which is read only once its sizes are known to fit the
    files that hold it and the model that will be written, and none of which ``output`` would replace."""
    path = Path(source)
    if not path.is_file():
        raise ExportError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    if same_file(output, path):
        raise ExportError(f"-o {output} is the input graph itself, which writing would replace (and orphan its "
                          "external data): give the optimized model a path of its own")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's and onnx's own types
        raise ExportError(f"{path}: not an ONNX model ({first_line(exc)})") from exc
    if external_data_files(model, path, output):
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:
            raise ExportError(f"{path}: cannot read its external data ({first_line(exc)})") from exc
    return model


def _tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: initializers and tensor attributes, in If/Loop bodies too."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            yield from ([attribute.t] if attribute.HasField("t") else [])
            yield from attribute.tensors
            for body in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _tensors(body)


def _claimed_bytes(tensor: onnx.TensorProto) -> int:
    elements = int(np.prod(tensor.dims, dtype=object)) if tensor.dims else 1
    if tensor.data_type in _FOUR_BIT_TYPES:
        return (elements + 1) // 2
    return elements * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def external_data_files(model: onnx.ModelProto, path: Path, output: Path) -> list[Path]:
    """The files ``model`` (read from ``path``) keeps its external data in, once each tensor's claim is checked
    against them before anything is read: beside the model, holding the bytes the tensor's shape needs at its
    offset, none of them ``output``, and all of them together within what one model file can hold. A claim
    that fails (a data file truncated, of another model, or a size made up) used to be read whole first."""
    files, total = [], 0
    for tensor in _tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = dict((entry.key, entry.value) for entry in tensor.external_data)
        location = Path(info.get("location", ""))
        where = f"{path}: tensor {tensor.name!r} keeps its data in {str(location)!r}"
        if not info.get("location") or location.is_absolute() or ".." in location.parts:
            raise ExportError(f"{where}: external data must be a file beside the model; refused")
        data = path.parent / location
        if not data.is_file():
            raise ExportError(f"{where}, which is not there ({data}): copy the data file with the model")
        try:
            offset, length = int(info.get("offset", 0)), info.get("length")
            claimed = _claimed_bytes(tensor)
        except (ValueError, TypeError) as exc:
            raise ExportError(f"{where}: its offset, length or type is not readable ({exc})") from exc
        if length is not None and int(length) != claimed:
            raise ExportError(f"{where}: its shape {list(tensor.dims)} takes {claimed} bytes, its length says "
                              f"{int(length)}: the model is damaged; export it again")
        size = data.stat().st_size
        if offset < 0 or offset + claimed > size:
            raise ExportError(f"{where}: it claims {claimed} bytes at offset {offset}, the file holds {size}: "
                              "the data file is truncated or another model's; copy the model with its own")
        if same_file(output, data):
            raise ExportError(f"-o {output} is {path}'s external data file, which writing would replace: give "
                              "the optimized model a path of its own")
        files.append(data)
        total += claimed
    if total > _MAX_MODEL_BYTES:
        raise ExportError(f"{path}: its external data holds {total / 1e9:.1f} GB of weights; the optimized model "
                          f"is written as one file, which protobuf limits to 2 GB: models this large are not "
                          "supported")
    return files


def _default_opset(model: onnx.ModelProto, source) -> int:
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(
            f"{source} has opset {opset}: optimize takes opsets {MIN_OPSET} to {MAX_OPSET}, the ones the fusion "
            f"chain is checked on; export it with opset_version={MIN_OPSET} or later, or convert it "
            "(onnx.version_converter)"
        )
    return opset


@dataclass(frozen=True)
class _GraphTensor:
    """An input or output as the graph declares it: element type, and per axis its dim (a symbol, a size, or
    None when unknown); ``dims`` None when the graph gives no shape."""

    name: str
    elem_type: int
    dims: tuple[str | int | None, ...] | None

    @classmethod
    def of(cls, value: onnx.ValueInfoProto) -> _GraphTensor:
        tensor = value.type.tensor_type
        dims = None
        if tensor.HasField("shape"):
            dims = tuple(
                d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
                for d in tensor.shape.dim
            )
        return cls(value.name, tensor.elem_type, dims)

    @property
    def type_name(self) -> str:
        return _type_name(self.elem_type)

    def describe(self) -> str:
        shape = "" if self.dims is None else "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"
        return f"{self.type_name} {shape}".strip()


def _interface(model: onnx.ModelProto, decls: Sequence[InputDecl], source) -> tuple[dict, dict]:
    """The graph's inputs (declared ones, checked against their roles) and outputs, by name."""
    initializers = {tensor.name for tensor in model.graph.initializer}
    graph_inputs = {v.name: _GraphTensor.of(v) for v in model.graph.input if v.name not in initializers}
    for decl in decls:
        if decl.name not in graph_inputs:
            raise ExportError(f"input {decl.name}: {source} has no such input (its inputs: {', '.join(graph_inputs)})")
    declared = {decl.name for decl in decls}
    if undeclared := [name for name in graph_inputs if name not in declared]:
        raise ExportError(f"{source} also takes {', '.join(undeclared)}: declare every input, --input NAME:ROLE")
    for decl in decls:
        _check_role(decl, graph_inputs[decl.name])
    graph_outputs = {v.name: _GraphTensor.of(v) for v in model.graph.output}
    return graph_inputs, graph_outputs


def _check_role(decl: InputDecl, tensor: _GraphTensor) -> None:
    """The graph's element type and shape of ``decl``'s input allow its role; batch and length are dynamic."""
    said = f"input {decl.name}: declared {_ROLE_TEXT[decl.role]}, the graph's is {tensor.describe()}"
    if tensor.elem_type not in _ACCEPTED_TYPES[decl.role]:
        raise ExportError(said)
    if tensor.dims is None:
        return
    if len(tensor.dims) != _ROLE_RANKS[decl.role]:
        raise ExportError(said)
    if decl.axis is None:  # an image or audio input: its sizes (declared or the graph's) are checked by _fixed_sizes
        _fixed_sizes(decl, tensor)
    for position, axis in ((0, BATCH_AXIS), (1, decl.axis))[: 1 if decl.axis is None else 2]:
        if isinstance(tensor.dims[position], int) and tensor.dims[position] > 0:
            raise ExportError(
                f"input {decl.name}: the graph fixes its {axis} axis (axis {position}) at {tensor.dims[position]}; "
                "export it with that axis dynamic (dynamic_shapes, or dynamic_axes for the legacy exporter)"
            )
    if decl.role == "sequence":
        width = tensor.dims[2] if isinstance(tensor.dims[2], int) and tensor.dims[2] > 0 else None
        if width is not None and decl.features is not None and width != decl.features:
            raise ExportError(f"input {decl.name}: declared {decl.features} features, the graph's has {width}")


def _fixed_sizes(decl: InputDecl, tensor: _GraphTensor) -> tuple[int, ...]:
    """An image's or audio input's sizes past the batch: the graph's where it fixes them, else as declared; the
    two must agree."""
    dims = tuple(tensor.dims or ())[1:]
    graph = dims if dims and all(isinstance(d, int) and d > 0 for d in dims) else None
    if graph is not None and decl.sizes is not None and graph != decl.sizes:
        raise ExportError(f"input {decl.name}: declared sizes {'x'.join(map(str, decl.sizes))}, the graph's are "
                          f"{'x'.join(map(str, graph))}")
    sizes = graph or decl.sizes
    if sizes is None:
        example = "3x224x224" if decl.role == "image" else "80x3000"
        raise ExportError(f"input {decl.name}: the graph does not fix the {decl.role}'s sizes; declare them, "
                          f"e.g. --input {decl.name}:{decl.role}:{example}")
    return sizes


def _sequence_width(decl: InputDecl, tensor: _GraphTensor) -> int:
    dims = tensor.dims or ()
    width = dims[2] if len(dims) == 3 and isinstance(dims[2], int) and dims[2] > 0 else decl.features
    if width is None:
        raise ExportError(
            f"input {decl.name}: the graph does not fix the sequence's feature width; declare it, "
            f"e.g. --input {decl.name}:sequence:{decl.axis}:80"
        )
    return width


def _axes_of_dims(decls: Sequence[InputDecl], graph_inputs: Mapping[str, _GraphTensor]) -> dict[str, str]:
    """The graph's symbolic dims -> the declared axis each stands for (batch, or a length axis)."""
    axes_of: dict[str, str] = {}
    for decl in decls:
        dims = graph_inputs[decl.name].dims or ()
        for position, axis in ((0, BATCH_AXIS), (1, decl.axis))[: 1 if decl.axis is None else 2]:
            symbol = dims[position] if position < len(dims) else None
            if not isinstance(symbol, str) or not symbol:
                continue
            bound = axes_of.setdefault(symbol, axis)
            if bound != axis:
                raise ExportError(
                    f"input {decl.name}: its {axis!r} axis is the graph's dim {symbol!r}, which is also the "
                    f"{bound!r} axis: the graph says they have one size; declare them on one axis"
                )
    return axes_of


def _input_spec(decl: InputDecl, tensor: _GraphTensor, marks: str | None) -> TensorSpec:
    if decl.axis is None:  # an image or audio input
        return TensorSpec(decl.name, ROLES[decl.role], MODEL_DTYPE, (BATCH_AXIS, *_fixed_sizes(decl, tensor)))
    axes = (BATCH_AXIS, decl.axis)
    if decl.role in ("tokens", "segments"):  # their vocabulary: graph_vocabularies
        return TensorSpec(decl.name, ROLES[decl.role], "int64", axes)
    if decl.role == "sequence":
        return TensorSpec(decl.name, SEQUENCE, MODEL_DTYPE, (*axes, _sequence_width(decl, tensor)))
    # A mask marks the first tokens or sequence input declared on its axis (declare_inputs checked there is one).
    return TensorSpec(decl.name, PADDING_MASK, "bool", axes, marks=marks)


def _output_names(graph_outputs: Mapping[str, _GraphTensor], names: Sequence[str] | None) -> tuple[str, ...]:
    if not names:
        return tuple(graph_outputs)
    if len(names) != len(graph_outputs):
        raise ExportError(
            f"{len(names)} output names given, the graph has {len(graph_outputs)} outputs ({', '.join(graph_outputs)})"
        )
    if duplicate := next((name for name in names if list(names).count(name) > 1), None):
        raise ExportError(f"output name {duplicate} is given twice")
    return tuple(names)


def _embedding_width(model: onnx.ModelProto, specs: Sequence[TensorSpec]) -> int:
    """The width of the first table a tokens input's ids index (the model's width when no attention says it)."""
    for spec in specs:
        if spec.role == TOKENS:
            tables, _ = indexed_tables(model, spec.name)
            if tables:
                return tables[0].width
    return 0


def _output_specs(
    graph_outputs: Mapping[str, _GraphTensor],
    names: Sequence[str],
    axes_of: Mapping[str, str],
    inputs: Sequence[TensorSpec],
    reference: GraphReference,
) -> tuple[TensorSpec, ...]:
    """Each output's dtype and axes: from the graph's shapes where they say them all, else from two runs."""
    dtypes = {}
    for tensor, name in zip(graph_outputs.values(), names, strict=True):
        if tensor.elem_type not in _OUTPUT_TYPES:
            raise ExportError(f"output {name} is {tensor.type_name}: outputs must be float32, int64 or bool")
        dtypes[name] = _OUTPUT_TYPES[tensor.elem_type]
    declared = [_axes_from_graph(tensor, axes_of) for tensor in graph_outputs.values()]
    if None in declared:
        declared = _axes_from_runs(names, inputs, reference)
    return tuple(TensorSpec(name, OUTPUT, dtypes[name], axes) for name, axes in zip(names, declared, strict=True))


def _axes_from_graph(tensor: _GraphTensor, axes_of: Mapping[str, str]) -> tuple[str | int, ...] | None:
    """batch, then each dim: a declared length axis or a fixed size; None when a dim says neither."""
    if not tensor.dims or axes_of.get(tensor.dims[0]) != BATCH_AXIS:
        return None
    axes: list[str | int] = [BATCH_AXIS]
    for dim in tensor.dims[1:]:
        if isinstance(dim, int) and dim > 0:
            axes.append(dim)
        elif isinstance(dim, str) and axes_of.get(dim, BATCH_AXIS) != BATCH_AXIS:
            axes.append(axes_of[dim])
        else:
            return None
    return tuple(axes)


def _axes_from_runs(names, inputs: Sequence[TensorSpec], reference: GraphReference) -> list[tuple[str | int, ...]]:
    sequences = [spec.axes[1] for spec in inputs if spec.role in (TOKENS, SEQUENCE)]
    axes = list(dict.fromkeys(sequences))
    if len(axes) > len(_PROBE_LENGTHS[0]):
        raise ExportError(f"{len(axes)} length axes declared; at most {len(_PROBE_LENGTHS[0])} are supported")
    sizes = [_ProbeSizes(batch, dict(zip(axes, lengths, strict=False)))
             for batch, lengths in zip(_PROBE_BATCHES, _PROBE_LENGTHS, strict=True)]
    rng = np.random.default_rng(0)
    first, second = (reference(probe_feeds(inputs, s.batch, s.lengths, rng)) for s in sizes)
    return [output_axes(name, first[name].shape, second[name].shape, *sizes) for name in names]


class GraphReference:
    """The input graph in ORT (CPU, graph optimisations off), as parity's reference: feeds as mha-deploy models
    take them (bool masks, int64 ids), cast to the graph's own input types; outputs under the written names."""

    def __init__(self, model: onnx.ModelProto, input_types: Mapping[str, int], output_names: Mapping[str, str]):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4  # its failures are raised, in one line, not logged as well
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT's own types
            raise ExportError(f"ONNX Runtime cannot load the input graph: {first_line(exc)}") from exc
        self.input_types = {name: onnx.helper.tensor_dtype_to_np_dtype(t) for name, t in input_types.items()}
        self.output_names = dict(output_names)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: np.asarray(array).astype(self.input_types[name], copy=False) for name, array in feeds.items()}
        try:
            outputs = self.session.run(list(self.output_names), feeds)
        except Exception as exc:  # ORT's own types
            shapes = ", ".join(f"{name} {list(array.shape)}" for name, array in feeds.items())
            raise ExportError(f"the input graph fails in ONNX Runtime on {shapes}: {first_line(exc)}") from exc
        return dict(zip(self.output_names.values(), outputs, strict=True))


def _written_interface(
    model: onnx.ModelProto, decls: Sequence[InputDecl], graph_inputs: Mapping[str, _GraphTensor], names: Sequence[str]
) -> onnx.ModelProto:
    """``model`` taking bool masks and int64 ids (a Cast after each input of another type) and returning its
    outputs under ``names``; an IR version ORT accepts."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    taken = {value.name for node in graph for value in node.outputs} | {v.name for v in graph.inputs}
    taken |= set(graph.initializers)
    roles = {decl.name: decl.role for decl in decls}
    for index, value in enumerate(list(graph.inputs)):
        wanted = _WRITTEN_TYPES[roles[value.name]]
        if graph_inputs[value.name].elem_type == wanted:
            continue
        name = value.name
        value.name = fresh_name(f"{name}_{graph_inputs[name].type_name}", taken)
        written = ir.Value(name=name, type=ir.TensorType(ir.DataType(wanted)), shape=value.shape)
        cast = ir.node("Cast", [written], {"to": graph_inputs[name].elem_type}, name=fresh_name(f"cast_{name}", taken))
        value.replace_all_uses_with(cast.outputs[0])
        cast.outputs[0].name = value.name
        graph.inputs[index] = written
        if len(graph):
            graph.insert_before(graph[0], cast)
        else:
            graph.append(cast)
    for value, name in zip(graph.outputs, names, strict=True):
        if value.name != name:
            if name in taken:
                raise ExportError(f"output name {name} is already the name of a value in the graph")
            value.name = name
    written = ir.serde.serialize_model(ir_model)
    written.ir_version = min(written.ir_version, MAX_IR_VERSION)
    return written


def _declare_shapes(model: onnx.ModelProto, signature: Signature) -> None:
    """Every input's and output's shape as the Signature says it: its dynamic dims named after the declared
    axes (the exporter's own names, e.g. ``s0`` or ``sequence``, mean nothing to inspect or Triton), fixed sizes
    where the graph left them unknown."""
    specs = signature.tensors
    for value in (*model.graph.input, *model.graph.output):
        if value.name not in specs:  # an initializer listed as an input (IR < 4)
            continue
        shape = value.type.tensor_type.shape
        shape.ClearField("dim")
        for axis in specs[value.name].axes:
            dim = shape.dim.add()
            if isinstance(axis, int):
                dim.dim_value = axis
            else:
                dim.dim_param = axis


def _type_name(elem_type: int) -> str:
    try:
        return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else "untyped"


__all__ = ["GraphReference", "optimize_model"]
