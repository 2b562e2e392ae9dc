"""A model file's recorded metadata checked against its graph when the file is loaded.

The metadata (d_model, heads, dtype, signature) decides how inputs are checked
and how items are batched. A file whose metadata was edited, or whose graph was
replaced under it, would otherwise be trusted into wrong answers: keys
right-padded for a model that is not causal, a mask the graph does not read.
So a session refuses such a file with ``ModelFileError``, after three checks:

- the declared inputs and outputs: element types, ranks, d_model and heads
  where the graph fixes them, and no axis fixed that the metadata says varies;
- heads and causality, where the graph states them: fused attention nodes'
  attributes, or the constant ``[heads, d_k]`` of an unfused graph's head split;
- each token input's vocabulary against the table its ids index in the graph
  (``mha_deploy.token_tables``): a recorded vocabulary past the table is refused,
  and where none is recorded the table's size is what ids are checked against;
- the mask mode, by behaviour (it cannot be read off every graph): a probe item
  is run alone, then in a batch with a longer item, padded as the batch planner
  pads (zeros at the end of each axis the metadata says may be padded, padding
  masks marking them): its outputs must not change beyond rounding (or a
  quantized model's budget), nor the longer item's. A model said to be causal must also give the
  same outputs for earlier positions when its last token changes.

Behaviour is checked only in the direction that can never refuse a sound
model: a model that is causal, or reads its mask, without saying so is slower
to batch but never wrong, and "this output does not depend on that token"
cannot be told from "depends on it by less than a float's resolution".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from mha_deploy.errors import ModelFileError
from mha_deploy.inputs import random_item, right_padding_mask
from mha_deploy.metadata import INT8_DYNAMIC, ModelMetadata
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.signature import FIXED_AXES, ID_ROLES, PADDING_MASK, Signature, TensorSpec
from mha_deploy.token_tables import vocabulary

_ELEMENT_TYPES = {
    "float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bool": onnx.TensorProto.BOOL,
    "int64": onnx.TensorProto.INT64,
}
# Largest relative error ||batched - alone|| / ||alone|| that padding may cause, by the model's float type.
# A mask the graph ignores, or padding a model that is not causal, moves outputs by 10% and more.
PROBE_REL_ERR = {"float32": 1e-3, "float16": 2e-2}
INT8_PROBE_REL_ERR = 0.05

# ORT's contrib attention ops (com.microsoft), with a num_heads attribute; ONNX's own Attention has q_num_heads.
_CONTRIB_ATTENTION = ("MultiHeadAttention", "Attention", "GroupQueryAttention")

RunFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def check_declared_io(proto: onnx.ModelProto, metadata: ModelMetadata, source: str) -> None:
    """Element type, rank and fixed sizes of every input and output the metadata lists, as the graph declares them."""
    declared = {v.name: v.type.tensor_type for v in (*proto.graph.input, *proto.graph.output)}
    sizes = metadata.fixed_sizes
    for spec in (*metadata.signature.inputs, *metadata.signature.outputs):
        if spec.name not in declared:
            _refuse(source, f"its metadata lists {spec.name!r}, which the graph lacks")
        tensor = declared[spec.name]
        dtype = spec.numpy_dtype(metadata.dtype)
        if tensor.elem_type != _ELEMENT_TYPES.get(dtype):
            found = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type) if tensor.elem_type else "no type"
            _refuse(source, f"{spec.name} is {found} in the graph, {dtype} in its metadata")
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if len(dims) != len(spec.axes):
            _refuse(source, f"{spec.name} has rank {len(dims)} in the graph, {len(spec.axes)} ({_axes(spec)}) in "
                            "its metadata")
        for position, (axis, dim) in enumerate(zip(spec.axes, dims, strict=True)):
            fixed = dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
            if isinstance(axis, int):  # a custom model's fixed size
                if fixed is not None and fixed != axis:
                    _refuse(source, f"{spec.name}'s axis {position} is {fixed} in the graph, {axis} in its metadata")
                continue
            if axis in FIXED_AXES and fixed is not None and fixed != sizes[axis]:
                _refuse(source, f"{spec.name} has {axis} {fixed} in the graph, {sizes[axis]} in its metadata")
            if axis not in FIXED_AXES and fixed is not None:
                _refuse(source, f"{spec.name}'s axis {position} ({axis}) is fixed at {fixed} in the graph; its "
                                "metadata says it varies")


def check_branch_ranks(proto: onnx.ModelProto, source: str) -> None:
    """Every If returns tensors of one rank whichever branch runs (ranks as declared, else as onnx infers them):
    an output whose rank follows the inputs' values would pass the probes and parity on the branch they take,
    then be cut per item at the wrong axes on the other."""
    branch_outputs = [
        value for node in all_nodes(proto.graph) if node.op_type == "If"
        for attribute in node.attribute if attribute.type == onnx.AttributeProto.GRAPH for value in attribute.g.output
    ]
    if any(_rank(value) is None for value in branch_outputs):
        # Types the graph leaves out of its branches' outputs (mha-deploy's own files declare them all, so a load
        # pays for no inference); where onnx cannot infer them (its own error types), the declared ranks are
        # checked all the same.
        with contextlib.suppress(Exception):
            proto = onnx.shape_inference.infer_shapes(proto)
    for node in all_nodes(proto.graph):
        if node.op_type != "If":
            continue
        branches = {a.name: a.g for a in node.attribute if a.name in ("then_branch", "else_branch")}
        if len(branches) != 2:
            continue
        for position, (then, other) in enumerate(zip(branches["then_branch"].output, branches["else_branch"].output,
                                                     strict=False)):
            ranks = [_rank(then), _rank(other)]
            if None not in ranks and ranks[0] != ranks[1]:
                node_label = f"If node {node.name!r}" if node.name else "an If node"
                raise ModelFileError(
                    f"{source}: {node_label} returns {node.output[position]!r} with rank {ranks[0]} from its then "
                    f"branch and {ranks[1]} from its else branch, so the model's output shape depends on its inputs' "
                    "values: make both branches return the same rank and export the model again"
                )


def _rank(value: onnx.ValueInfoProto) -> int | None:
    tensor = value.type.tensor_type
    return len(tensor.shape.dim) if value.type.HasField("tensor_type") and tensor.HasField("shape") else None


def graph_heads(proto: onnx.ModelProto, d_model: int) -> set[int]:
    """Head counts the graph states: fused attention attributes, or an unfused head split's constant [heads, d_k]."""
    found = set()
    # Fused ops may sit in an If's branches (the fusion's padding and causal rules put them there).
    for node in all_nodes(proto.graph):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in _CONTRIB_ATTENTION and "num_heads" in attributes:
            found.add(int(attributes["num_heads"]))
        elif node.op_type == "Attention" and "q_num_heads" in attributes:  # ONNX Attention (opset 23)
            found.add(int(attributes["q_num_heads"]))
    if found:
        return found
    return {heads for heads, d_k in head_splits(proto) if heads * d_k == d_model}


def head_splits(proto: onnx.ModelProto) -> set[tuple[int, int]]:
    """(heads, d_k) of each head split of an unfused graph: Reshape(x, Concat(batch, seq, [heads], [d_k])) as
    the reference form writes it, or Concat(batch, [-1], [heads], [d_k]) (``view(batch, -1, heads, d_k)``).
    One of heads and d_k may be -1 where x's last axis has a fixed size: Hugging Face's
    ``view(*shape[:-1], -1, head_dim)`` splits x's width into heads of head_dim."""
    graph = proto.graph
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    constants[node.output[0]] = attribute.t
    producers = {output: node for node in graph.node for output in node.output}
    widths = _last_axes(proto)
    found = set()
    for node in graph.node:
        shape = producers.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if shape is None or shape.op_type != "Concat" or len(shape.input) != 4:
            continue
        heads, d_k = (_scalar(constants.get(name)) for name in shape.input[2:])
        width = widths.get(node.input[0])
        if heads == -1 and d_k and d_k > 0 and width and width % d_k == 0:
            heads = width // d_k
        elif d_k == -1 and heads and heads > 0 and width and width % heads == 0:
            d_k = width // heads
        if heads and d_k and heads > 0 and d_k > 0:
            found.add((heads, d_k))
    return found


def _last_axes(proto: onnx.ModelProto) -> dict[str, int]:
    """Value name -> the fixed size of its last axis, where the graph records one."""
    sizes = {}
    for value in (*proto.graph.input, *proto.graph.value_info, *proto.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
            sizes[value.name] = dims[-1].dim_value
    return sizes


def check_heads(proto: onnx.ModelProto, metadata: ModelMetadata, source: str) -> None:
    heads = graph_heads(proto, metadata.d_model)
    if metadata.signature.model == "custom":
        # A user's model may hold attentions of several widths and head counts: its metadata records the most
        # heads one of them splits into (what sizes its largest score tensor), as the graph states them.
        if heads and metadata.num_heads != max(heads):
            _refuse(source, f"the graph's attentions split up to {max(heads)} heads, its metadata says "
                            f"{metadata.num_heads}")
        return
    if heads and heads != {metadata.num_heads}:
        _refuse(source, f"the graph splits {', '.join(map(str, sorted(heads)))} heads, its metadata says "
                        f"{metadata.num_heads}")


def with_graph_vocabularies(proto: onnx.ModelProto, metadata: ModelMetadata, source: str) -> ModelMetadata:
    """``metadata`` with each token input's vocabulary bounded by the table its ids index in the graph: where
    the metadata records none (a table the export could not read), the table's rows, so that an id past the
    table is refused by the validator instead of failing inside ONNX Runtime. A recorded vocabulary past the
    table is refused: ids the metadata allows would fail at run time."""
    signature = metadata.signature
    specs = []
    for spec in signature.custom_inputs:
        rows = vocabulary(proto, spec.name) if spec.role in ID_ROLES else None
        if rows is not None:
            if spec.vocab is not None and spec.vocab > rows:
                _refuse(source, f"its metadata gives {spec.name} a vocabulary of {spec.vocab}, the table its ids "
                                f"index in the graph has {rows} rows")
            spec = replace(spec, vocab=spec.vocab or rows)
        specs.append(spec)
    if tuple(specs) == signature.custom_inputs:
        return metadata
    return replace(metadata, signature=replace(signature, custom_inputs=tuple(specs)))


def graph_causality(proto: onnx.ModelProto) -> set[bool]:
    """Whether each fused attention node of the graph is causal (empty for an unfused graph)."""
    found = set()
    for node in all_nodes(proto.graph):  # in If branches too, as in graph_heads
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "GroupQueryAttention":  # ORT's GQA always masks causally
            found.add(True)
        elif node.op_type in _CONTRIB_ATTENTION and "num_heads" in attributes:
            found.add(bool(attributes.get("unidirectional", 0)))
        elif node.op_type == "Attention":
            found.add(bool(attributes.get("is_causal", 0)))
    return found


def check_causality(proto: onnx.ModelProto, metadata: ModelMetadata, source: str) -> None:
    """A lone MHA's fused attention is causal exactly when its mask mode says so (stacks mix both kinds)."""
    signature = metadata.signature
    causal = graph_causality(proto)
    if signature.model == "mha" and causal and causal != {signature.is_causal}:
        _refuse(source, f"the graph's attention is {'' if True in causal else 'not '}causal, its metadata's mask "
                        f"mode is {signature.mask!r}")


@dataclass(frozen=True)
class BatchingChange:
    """An item's output that moved when another item shared its batch (``batching_change``)."""

    output: str
    error: float  # relative: ||batched - alone|| / ||alone||
    other: str  # the item that shared the batch: "shorter" or "longer"
    padded: str  # the axes padded in the batch, or "none"


def batching_change(
    run: RunFn, signature: Signature, fixed_sizes: Mapping[str, int], dtype: str, budget: float
) -> BatchingChange | None:
    """Run a probe item alone and in a batch with a longer item (padded as the batch planner pads, along
    ``signature``'s paddable axes), and the longer item alone: the first output that moves beyond ``budget``
    between the two, or None. What the load check runs in ORT, and the export in torch before writing."""
    paddable = signature.paddable_axes
    rng = np.random.default_rng(0)
    short = {axis: 2 + i for i, axis in enumerate(signature.sequence_axes)}
    long = {axis: length + 3 if axis in paddable else length for axis, length in short.items()}

    def item(lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        return random_item(signature, dict(fixed_sizes), dict(lengths), rng, dtype)

    probe, longer = item(short), item(long)
    together = run(_padded_batch([probe, longer], signature))
    for row, (one, lengths) in enumerate(((probe, short), (longer, long))):
        alone = run(_padded_batch([one], signature))
        for spec in signature.item_outputs:  # one spanning the batch is the call's, not an item's
            cut = (row, *(slice(0, lengths[axis]) if axis in lengths else slice(None) for axis in spec.axes[1:]))
            batched, expected = together[spec.name][cut].astype(np.float64), alone[spec.name][0].astype(np.float64)
            error = np.linalg.norm(batched - expected) / max(float(np.linalg.norm(expected)), 1e-30)
            if not error <= budget:  # NaN fails too
                padded = ", ".join(sorted(axis for axis in paddable if short[axis] != long[axis])) or "none"
                return BatchingChange(spec.name, float(error), "shorter" if row == 0 else "longer", padded)
    return None


def check_batching(run: RunFn, metadata: ModelMetadata, source: str) -> None:
    """A probe item's outputs alone and padded in a batch agree; so do a longer item's alone and batched."""
    signature = metadata.signature
    if signature.kv_cache:
        return  # a cache model decodes one batch at a time: check_cache_behaviour probes it instead
    change = batching_change(run, signature, metadata.fixed_sizes, metadata.dtype, _budget(metadata))
    if change is not None:
        _refuse(
            source,
            f"its {change.output} changes by {change.error:.1%} when a {change.other} item shares its batch "
            f"(padded axes: {change.padded}), so its mask mode {signature.mask!r} "
            f"({signature.attention}-attention, {signature.model}) does not describe the graph",
        )


def check_causal_behaviour(run: RunFn, metadata: ModelMetadata, source: str) -> None:
    """If the metadata says the queries' own sequence is causal, a later token cannot move an earlier output."""
    signature = metadata.signature
    if signature.kv_cache or not (signature.is_causal or signature.model == "decoder"):
        return
    rng = np.random.default_rng(1)
    lengths = {axis: 4 for axis in signature.sequence_axes}
    item = random_item(signature, metadata.fixed_sizes, lengths, rng, metadata.dtype)
    changed = {**item, signature.query_input: item[signature.query_input].copy()}
    changed[signature.query_input][-1] = rng.standard_normal(metadata.d_model)
    before, after = run(_padded_batch([item], signature)), run(_padded_batch([changed], signature))
    for spec in signature.outputs:
        earlier = (0, *(slice(0, 3) if axis == signature.query_axis else slice(None) for axis in spec.axes[1:]))
        expected, got = before[spec.name][earlier].astype(np.float64), after[spec.name][earlier].astype(np.float64)
        error = np.linalg.norm(got - expected) / max(float(np.linalg.norm(expected)), 1e-30)
        if not error <= _budget(metadata):
            _refuse(
                source,
                f"its {spec.name} at earlier positions changes by {error:.1%} when the last token changes, so "
                f"its mask mode {signature.mask!r} (causal) does not describe the graph",
            )


def check_cache_behaviour(run: RunFn, metadata: ModelMetadata, source: str) -> None:
    """A KV-cache model's cache must mean what its metadata says: 4 tokens at once, and 3 then 1 fed with
    the first call's present outputs as past, give the same outputs and the same final cache."""
    signature = metadata.signature
    if not signature.kv_cache:
        return
    rng = np.random.default_rng(2)
    query = signature.query_input
    # x, and a decoder's memory (3 tokens, the same on every call)
    sequences = {
        name: rng.standard_normal((1, 4 if name == query else 3, metadata.d_model)).astype(metadata.dtype)
        for name in signature.sequence_inputs
    }
    if signature.model == "custom":  # a causal LM over token ids (exporters.own_kv_cache)
        sequences = {query: random_item(signature, metadata.fixed_sizes, {signature.query_axis: 4}, rng,
                                        metadata.dtype)[query][None]}
    x = sequences[query]
    output = signature.output_names[0]
    # Each cache empty as its own spec sizes it: a grouped-query model's caches hold fewer heads than its queries.
    sizes = signature.axis_sizes(1, 1, 0, **metadata.fixed_sizes)
    empty = {name: np.zeros(signature.tensors[name].shape(sizes), metadata.dtype) for name in signature.cache_pairs}

    def call(tokens: np.ndarray, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        total = tokens.shape[1] + past[signature.growing_caches[0]].shape[2]
        masks = {
            name: np.ones((1, total if marks == query else sequences[marks].shape[1]), signature.tensors[name].dtype)
            for name, marks in signature.padding_masks.items()
        }
        # A file that takes each row's positions (exporters.own_kv_cache) continues them from the cache.
        positions = {"position_ids": np.arange(total - tokens.shape[1], total)[None]} \
            if "position_ids" in signature.tensors else {}
        return run({**sequences, query: tokens, **past, **masks, **positions})

    whole = call(x, empty)
    first = call(x[:, :3], empty)
    second = call(x[:, 3:], {past: first[present] for past, present in signature.cache_pairs.items()})
    pieces = {
        # A last-token output (--logits last) holds the last token's only: the second call's.
        output: second[output] if output in signature.last_token_outputs else
        np.concatenate([first[output], second[output]], axis=1),
        **{present: second[present] for present in signature.cache_pairs.values()},
    }
    for name, got in pieces.items():
        expected = whole[name].astype(np.float64)
        shape_ok = got.shape == expected.shape
        error = np.linalg.norm(got - expected) / max(float(np.linalg.norm(expected)), 1e-30) if shape_ok else np.inf
        if not error <= _budget(metadata):
            _refuse(
                source,
                f"its {name} differs by {error:.1%} between one call of 4 tokens and 3 then 1 through its cache "
                f"(shapes {got.shape} and {expected.shape}), so it is not the KV cache its metadata declares",
            )


def _padded_batch(items: list[dict[str, np.ndarray]], signature: Signature) -> dict[str, np.ndarray]:
    """Right-padded with zeros, masks marking real positions, images and audio stacked: what
    ``mha_deploy.batch.planner.collate`` feeds."""
    feeds: dict[str, np.ndarray] = {name: np.stack([item[name] for item in items])
                                    for name in signature.fixed_shape_inputs}
    lengths: dict[str, list[int]] = {}
    for spec in signature.inputs:
        if spec.name in signature.sequence_inputs:
            arrays = [item[spec.name] for item in items]
            longest = max(len(a) for a in arrays)
            batch = np.zeros((len(arrays), longest, *arrays[0].shape[1:]), arrays[0].dtype)
            for row, array in enumerate(arrays):
                batch[row, : len(array)] = array
            feeds[spec.name] = batch
            lengths[spec.name] = [len(a) for a in arrays]
    for spec in signature.inputs:
        if spec.role == PADDING_MASK:
            # in the mask's own dtype: bool, or a Hugging Face file's int64 1/0
            feeds[spec.name] = right_padding_mask(lengths[spec.marks], feeds[spec.marks].shape[1]).astype(spec.dtype)
    return feeds


def _budget(metadata: ModelMetadata) -> float:
    if metadata.quantization == INT8_DYNAMIC:
        # Dynamic int8 quantizes each batch with its own scale: other items move an item's outputs a little.
        parity = metadata.parity
        return max(INT8_PROBE_REL_ERR, parity.rel_budget if parity and parity.rel_budget else 0.0)
    if metadata.quantization != "none":
        # Weight-only int4/int8 (MatMulNBits at accuracy_level 4) rounds each activation row to int8: a prompt run
        # in one call or through the cache differs by the fp32 kernels' rounding, which now and then flips a
        # rounding step (0.2% measured on the tutorial GPT's d_model 512 build at int4). A mask or cache that is
        # not what the metadata says moves outputs by 10% and more.
        return INT8_PROBE_REL_ERR
    return PROBE_REL_ERR.get(metadata.dtype, PROBE_REL_ERR["float16"])


def _scalar(tensor: onnx.TensorProto | None) -> int | None:
    """A one-element int tensor's value (-1 included: a reshape's "the rest"), else None."""
    if tensor is None or tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    values = numpy_helper.to_array(tensor).ravel()
    return int(values[0]) if values.size == 1 and (values[0] > 0 or values[0] == -1) else None


def _axes(spec: TensorSpec) -> str:
    return spec.describe()


def _refuse(source: str, problem: str) -> None:
    error = ModelFileError(
        f"{source}: {problem}; the file was edited after export or is damaged: export it again with `mha-deploy export`"
    )
    error.problem = problem  # what the exporter, running this check before it writes, reports in its own words
    raise error
