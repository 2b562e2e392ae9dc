"""A KV cache for a user's own causal LM, written with no cache code: the plain export rewired to take the
keys/values of earlier calls and return them grown by this call's tokens.

The route: the rewired graph still runs the module's own forward over the whole sequence, past + new tokens,
so that everything the module derives from the length (``arange`` positions, a sinusoidal table sliced by
length, a causal ``tril``, a cumulative sum over the mask) sees the length it would see in a full forward,
whatever way the module writes it; nothing has to be recognised but the attentions. The past positions'
tokens are placeholders (id 0): at each attention the keys and values of the past positions are replaced by
the cache (``present = past ++ this call's keys/values``), and since an attention is the only op through
which one position reads another, every new position then computes exactly what the full forward computes
for it. The per-token outputs are cut to the new positions. Parity per step (``check_own_cache_parity``)
proves it for each export: a module with another cross-position op (a pooling, a norm over the sequence)
fails there and is not written.

What it costs: the rewiring alone would run every per-token layer and every attention's queries over all
positions, a step as expensive as the full forward. ``narrowing`` then cuts each op to the new positions,
back from those cuts to the sources (ids, mask, positions), so that a step applies the weights to its new
tokens only and each attention reads the cache for its keys/values with this call's queries; what still
spans the whole length is the cache itself and cheap sources (the mask, a causal ``tril`` sliced to the new
rows). Measured on the tutorial GPT (d_model 512, 8 heads, 6 layers, 32k vocabulary), batch 1, 2 threads:
one token after 1023 cached ones took 15.9 ms against 519 ms for recomputing the 1024 tokens through the
same file (32x, a shared machine; ``benchmarks/generation.py`` measures it). A module with an op the
narrowing cannot prove (it is named in the export's warning) keeps the whole-sequence graph, exact but a
full forward per step.

    tokens    = Concat(zeros [batch, past_seq], input_ids)                 [batch, total_seq]
    mask      = Cast(attention_mask)                                         [batch, total_seq]
    per attention i, K = the keys as the scores MatMul reads them, [batch, heads, total_seq, d_k]:
    present.i.key   = Concat(past_key_values.i.key,   K[:, :, past_seq:])    [batch, heads, total_seq, d_k]
    present.i.value = Concat(past_key_values.i.value, V[:, :, past_seq:])
    logits    = logits over every position [:, past_seq:]                    [batch, seq, vocab]

and after ``narrowing``, the same per call with every row-wise op over ``seq`` rows: the ids are
``input_ids``, the attentions' queries [batch, heads, seq, d_k], their mask rows [past_seq:]. With
``position_ids`` asked for, a position table indexed by the rows [past_seq:] of a ``Range`` over the whole
length is indexed by ``position_ids`` [batch, seq] instead (each row's own positions), and a table computed from
those rows (rotary cos/sin) is computed from ``position_ids``; the metadata's
``positions`` records which of "input", "none" or "padded-width" the file's positions are
(``positions_kind``).

A grouped-query attention (fewer KV heads than query heads, repeated before the attention reads them as
Hugging Face's ``repeat_kv`` writes it: ``fusion.repeat_kv``) keeps its cache at the KV heads: the cache grows
where the repeat reads the KV heads, ``present.i.key = Concat(past [batch, kv_heads, past_seq, d_k], new)``, and
the attention reads past ++ new repeated, as it read new repeated (``find_attention_caches(grouped=True)``).

That is the "holes" layout: present = past ++ new, a copy of the cache per step, padding on either side kept as
holes the mask hides. Where the positions are "input" or "none", the export then rewrites the fused graph into the
"ragged" layout (``fusion.ragged_cache``, whose docstring is that file contract): each attention is
GroupQueryAttention reading and writing the cache in place, rows right-padded, and ``check_own_cache_parity``
decodes it under that contract (``layout=CACHE_RAGGED``) before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from mha_deploy.compare import compare_arrays, compare_outputs
from mha_deploy.errors import ExportError
from mha_deploy.exporters.parity import CacheCase, parity_report, torch_reference
from mha_deploy.inputs import padding_mask, right_padding_mask
from mha_deploy.metadata import (
    CACHE_HOLES,
    CACHE_RAGGED,
    POSITIONS_INPUT,
    POSITIONS_NONE,
    POSITIONS_PADDED_WIDTH,
    ParityReport,
)
from mha_deploy.onnx_nodes import rename_value
from mha_deploy.runtime.session import MHASession
from mha_deploy.signature import (
    BATCH_AXIS,
    MODEL_DTYPE,
    PADDING_MASK,
    PAST,
    PAST_AXIS,
    PRESENT,
    TOKENS,
    TOTAL_AXIS,
    Signature,
    TensorSpec,
)

# Optimum's and onnxruntime-genai's names for a decoder's inputs and its per-token output.
INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
POSITION_IDS = "position_ids"  # each row's own positions, [batch, seq], when the file takes them
_PREFIX = "kv_cache."  # names of the values this pass adds (the user's own names stay free)
_INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class AttentionCache:
    """Where one attention reads its keys and values: the scores MatMul (keys as its second input,
    [batch, heads, d_k, seq]) and the probabilities' MatMul (values as its second input)."""

    scores: str
    weighted: str
    heads: int
    head_dim: int
    # A grouped-query attention whose keys and values are a repeat of fewer heads (``fusion.repeat_kv``): the
    # cache holds the ``kv_heads`` before the repeat, and these Unsqueeze nodes (the repeat's first) read it.
    kv_heads: int | None = None
    key_repeat: str | None = None
    value_repeat: str | None = None

    @property
    def cache_heads(self) -> int:
        """The heads the cache holds: the KV heads of a grouped-query attention, else every head."""
        return self.kv_heads or self.heads


def cache_signature(signature: Signature, layers: list[AttentionCache]) -> Signature:
    """The cache-free ``signature`` of a causal LM as its cache model takes it: ``input_ids`` [batch, seq],
    ``attention_mask`` int64 [batch, total_seq] (1 = real, over the cached tokens and the new ones),
    ``past_key_values.{i}.key|value`` [batch, heads, past_seq, head_dim] per attention (a grouped-query one's KV
    heads); ``logits`` [batch, seq, vocab] and ``present.{i}.key|value`` [batch, heads, total_seq, head_dim] out."""
    tokens, _, output = lm_tensors(signature)
    inputs = [
        replace(tokens, name=INPUT_IDS),
        TensorSpec(ATTENTION_MASK, PADDING_MASK, "int64", (BATCH_AXIS, TOTAL_AXIS), marks=INPUT_IDS),
    ]
    outputs = [replace(output, name=LOGITS)]
    for i, layer in enumerate(layers):
        for kind in ("key", "value"):
            axes = (BATCH_AXIS, layer.cache_heads, PAST_AXIS, layer.head_dim)
            inputs.append(TensorSpec(f"past_key_values.{i}.{kind}", PAST, MODEL_DTYPE, axes))
            axes = (BATCH_AXIS, layer.cache_heads, TOTAL_AXIS, layer.head_dim)
            outputs.append(TensorSpec(f"present.{i}.{kind}", PRESENT, MODEL_DTYPE, axes))
    return Signature.custom(tuple(inputs), tuple(outputs), signature.custom_paddable, layers=len(layers))


def lm_tensors(signature: Signature) -> tuple[TensorSpec, TensorSpec, TensorSpec]:
    """The token ids, their padding mask and the per-token logits of a causal LM, or an ``ExportError`` saying
    what a cache export needs (checked before the trace, which is the slow part)."""
    tokens = [spec for spec in signature.custom_inputs if spec.role == TOKENS]
    others = [spec for spec in signature.custom_inputs if spec.role not in (TOKENS, PADDING_MASK)]
    masks = [spec for spec in signature.custom_inputs if spec.role == PADDING_MASK]
    if len(tokens) != 1 or others or len(masks) != 1 or masks[0].marks != tokens[0].name:
        declared = ", ".join(f"{spec.name}:{spec.role}" for spec in signature.custom_inputs)
        raise ExportError(
            f"--kv-cache exports a causal language model over token ids: declare its ids and their padding "
            f"mask (--input NAME:tokens --input MASK:padding-mask), and nothing else; got {declared}"
        )
    outputs = signature.custom_outputs
    query_axis = tokens[0].axes[1]
    if len(outputs) != 1 or len(outputs[0].axes) < 2 or outputs[0].axes[1] != query_axis:
        raise ExportError(
            f"--kv-cache needs the module to return one tensor with a row per token (its logits), got "
            f"{', '.join(f'{spec.name} {spec.describe()}' for spec in outputs)}"
        )
    return tokens[0], masks[0], outputs[0]


def find_attention_caches(plain: onnx.ModelProto, expected: int, grouped: bool = False) -> list[AttentionCache]:
    """Each attention of the plain export in graph order, with the MatMuls that read its keys and values;
    an ``ExportError`` unless every one of the ``expected`` attentions is found in the reference form
    (a Softmax over Q·Kᵀ scores, its probabilities times V, 4-D keys and values with static heads).
    ``grouped``: where every attention's keys and values are a repeat of fewer KV heads (``fusion.repeat_kv``),
    each records them, and ``attach_own_caches`` keeps the cache at those heads (never repeated)."""
    from mha_deploy.exporters.fusion.pipeline import _score_nodes, unfused_attentions

    model = ir.serde.deserialize_model(plain)
    found = unfused_attentions(model)
    caches, problems = [], []
    for node in found:
        scores = _score_nodes(node) if node.op_type == "Softmax" else None
        weighted = _probabilities_matmul(node) if scores else None
        if scores is None or weighted is None:
            problems.append(f"{node.name}: not a Softmax over Q·Kᵀ times V (an {node.op_type} op)")
            continue
        keys_t, values = scores[-1].inputs[1], weighted.inputs[1]
        dims = [_static_dims(keys_t), _static_dims(values)]
        if None in dims or dims[0][0] != dims[1][0] or dims[0][1] != dims[1][2]:
            problems.append(f"{node.name}: keys/values are not [batch, heads, seq, d_k] with static heads")
            continue
        caches.append(AttentionCache(scores[-1].name, weighted.name, dims[1][0], dims[1][2]))
    if grouped and not problems:
        caches = _grouped(caches, {node.name: node for node in model.graph})
    if problems or len(caches) != expected or not caches:
        raise ExportError(
            f"--kv-cache: {len(caches)} of {expected} attention(s) found where a cache can be attached"
            f"{' (' + '; '.join(problems[:3]) + ')' if problems else ''}; a cache for the rest would be "
            "silently wrong, so nothing is written"
        )
    return caches


def _grouped(caches: list[AttentionCache], nodes: dict[str, ir.Node]) -> list[AttentionCache]:
    """``caches`` with their KV heads where every attention's keys (``Transpose(repeat, [0, 1, 3, 2])`` as the
    scores read them) and values are a repeat of the same fewer heads; else ``caches`` as they are (all or none:
    one cache shape for every layer)."""
    from mha_deploy.exporters.fusion.repeat_kv import repeated_heads

    grouped = []
    for layer in caches:
        keys_t = nodes[layer.scores].inputs[1]
        transpose = keys_t.producer()
        if transpose is None or transpose.op_type != "Transpose" \
                or list(transpose.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
            return caches
        key, value = repeated_heads(transpose.inputs[0]), repeated_heads(nodes[layer.weighted].inputs[1])
        if key is None or value is None or (key.kv_heads, key.groups) != (value.kv_heads, value.groups) \
                or key.kv_heads * key.groups != layer.heads or not key.unsqueeze.name or not value.unsqueeze.name \
                or len({key.unsqueeze.name, value.unsqueeze.name}) != 2:
            return caches
        grouped.append(replace(layer, kv_heads=key.kv_heads, key_repeat=key.unsqueeze.name,
                               value_repeat=value.unsqueeze.name))
    if len({layer.kv_heads for layer in grouped}) != 1:
        return caches
    return grouped


def _probabilities_matmul(softmax: ir.Node) -> ir.Node | None:
    """The MatMul that weights values by ``softmax``'s probabilities (directly, or through a Where that zeroes
    fully-masked rows)."""
    probabilities = [softmax.outputs[0]]
    probabilities += [u.node.outputs[0] for u in softmax.outputs[0].uses() if u.node.op_type == "Where"]
    for value in probabilities:
        for use in value.uses():
            if use.node.op_type == "MatMul" and use.idx == 0:
                return use.node
    return None


def _static_dims(value: ir.Value) -> tuple[int, int, int] | None:
    """(dim 1, dim 2, dim 3) of a rank-4 value, None unless dims 1 and the head dim are static."""
    shape = value.shape
    if shape is None or shape.rank() != 4:
        return None
    dims = [shape[i] if isinstance(shape[i], int) else None for i in (1, 2, 3)]
    return tuple(dims) if dims[0] is not None else None  # the seq dim may be symbolic


def attach_own_caches(
    plain: onnx.ModelProto, signature: Signature, cached: Signature, layers: list[AttentionCache]
) -> onnx.ModelProto:
    """``plain`` (the cache-free export of ``signature``) rewired to ``cached``'s cache interface."""
    model = onnx.ModelProto()
    model.CopyFrom(plain)
    graph = model.graph
    tokens, mask, output = lm_tensors(signature)
    types = {value.name: value.type for value in (*graph.input, *graph.output, *graph.value_info)}
    float_type = types[output.name].tensor_type.elem_type
    for name in (tokens.name, mask.name, output.name):
        rename_value(graph, name, _PREFIX + name)
    past = _PREFIX + "past_seq"
    nodes = [
        helper.make_node("Shape", ["past_key_values.0.key"], [past], start=2, end=3),
        helper.make_node("Shape", [INPUT_IDS], [_PREFIX + "batch"], start=0, end=1),
        helper.make_node("Concat", [_PREFIX + "batch", past], [_PREFIX + "past_shape"], axis=0),
        helper.make_node("ConstantOfShape", [_PREFIX + "past_shape"], [_PREFIX + "past_ids"],
                         value=helper.make_tensor("zero", TensorProto.INT64, [1], [0])),
        helper.make_node("Concat", [_PREFIX + "past_ids", INPUT_IDS], [_PREFIX + tokens.name], axis=1),
        helper.make_node("Identity", [ATTENTION_MASK], [_PREFIX + "whole_mask"]),
        helper.make_node("Cast", [_PREFIX + "whole_mask"], [_PREFIX + mask.name],
                         to=types[mask.name].tensor_type.elem_type),
        _int64_constant(_PREFIX + "end", _INT64_MAX),
        _int64_constant(_PREFIX + "seq_axis", 2),
        _int64_constant(_PREFIX + "token_axis", 1),
    ]
    # The whole sequence's values keep the length the plain graph gave them: the fusion's mask reading
    # matches the keys' length to the queries' by these shapes.
    whole_mask = onnx.TypeProto()
    whole_mask.CopyFrom(types[mask.name])
    whole_mask.tensor_type.elem_type = TensorProto.INT64
    shapes = [(_PREFIX + tokens.name, types[tokens.name]), (_PREFIX + mask.name, types[mask.name]),
              (_PREFIX + "whole_mask", whole_mask)]
    by_name = {node.name: node for node in graph.node}
    for i, layer in enumerate(layers):
        scores, weighted = by_name[layer.scores], by_name[layer.weighted]
        keys_t, values = scores.input[1], weighted.input[1]
        key, value = f"{_PREFIX}{i}.key", f"{_PREFIX}{i}.value"
        if layer.kv_heads is not None:
            # Grouped-query: the cache grows the KV heads where the repeat reads them, so the attention reads
            # past ++ new repeated as it read new repeated, and the cache holds each KV head once.
            for repeat, past_name, grown in ((layer.key_repeat, f"past_key_values.{i}.key", key),
                                             (layer.value_repeat, f"past_key_values.{i}.value", value)):
                unsqueeze = by_name[repeat]
                source = unsqueeze.input[0]  # [batch, kv_heads, seq, d_k]
                nodes += [*_grown(source, past_name, grown, past),
                          helper.make_node("Identity", [grown], [past_name.replace("past_key_values", "present")])]
                unsqueeze.input[0] = grown
                if source in types:
                    shapes.append((grown, types[source]))
            continue
        nodes += [
            helper.make_node("Transpose", [keys_t], [key + ".new"], perm=[0, 1, 3, 2]),
            *_grown(key + ".new", f"past_key_values.{i}.key", key, past),
            helper.make_node("Transpose", [key], [key + ".t"], perm=[0, 1, 3, 2]),
            helper.make_node("Identity", [key], [f"present.{i}.key"]),
            *_grown(values, f"past_key_values.{i}.value", value, past),
            helper.make_node("Identity", [value], [f"present.{i}.value"]),
        ]
        scores.input[1], weighted.input[1] = key + ".t", value
        if values in types:  # [batch, heads, seq, d_k]; the keys as the scores read them [batch, heads, d_k, seq]
            transposed = onnx.TypeProto()
            transposed.CopyFrom(types[values])
            dims = transposed.tensor_type.shape.dim
            if len(dims) == 4:
                swapped = [onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()]
                swapped[0].CopyFrom(dims[3])
                swapped[1].CopyFrom(dims[2])
                dims[2].CopyFrom(swapped[0])
                dims[3].CopyFrom(swapped[1])
            shapes += [(key, types[values]), (key + ".t", transposed), (value, types[values])]
    nodes.append(helper.make_node("Slice", [_PREFIX + output.name, past, _PREFIX + "end", _PREFIX + "token_axis"],
                                  [LOGITS]))
    graph.node.extend(nodes)
    for name, value_type in shapes:
        graph.value_info.add(name=name).type.CopyFrom(value_type)
    _set_interface(graph, cached, float_type)
    return _sorted(model)


def narrowed_own_caches(
    cached_model: onnx.ModelProto, cached: Signature, max_length: int | None, position_ids: bool = False
) -> tuple[onnx.ModelProto, Signature, str | None]:
    """``cached_model`` (``attach_own_caches``'s) with every row-wise op computing this call's positions only
    (``narrowing``), its signature, and None; or ``cached_model`` as it is and the reason narrowing was refused
    (the op that stopped it), for the export to warn with. ``max_length``: the longest sequence the module
    takes. ``position_ids``: take each row's positions from a ``position_ids`` input where the module's are
    a Range or a count of the mask's tokens indexing a table or computing one (rotary cos/sin; the signature then
    has it)."""
    from mha_deploy.exporters.narrowing import LengthNames, NarrowingRefused, narrow_to_new_positions

    def feeds(batch: int, past: int, seq: int) -> dict[str, np.ndarray]:
        caches = {name: np.zeros((batch, cached.tensors[name].axes[1], past, cached.tensors[name].axes[3]),
                                 np.float32) for name in cached.cache_pairs}
        return {INPUT_IDS: np.zeros((batch, seq), np.int64),
                ATTENTION_MASK: np.ones((batch, past + seq), np.int64), **caches}

    names = LengthNames(_PREFIX + "past_seq", _PREFIX + "end", INPUT_IDS, ATTENTION_MASK)
    try:
        narrowed, taken = narrow_to_new_positions(cached_model, names, feeds, max_length,
                                                  POSITION_IDS if position_ids else None)
    except NarrowingRefused as exc:
        return cached_model, cached, str(exc)
    return narrowed, with_position_ids(cached, max_length) if taken else cached, None


def with_position_ids(cached: Signature, max_length: int | None) -> Signature:
    """``cached`` taking ``position_ids`` int64 [batch, seq] after ``input_ids``: indices into the module's
    position table (its rows bound them, as a vocabulary bounds token ids)."""
    ids = cached.tensors[INPUT_IDS]
    spec = replace(ids, name=POSITION_IDS, vocab=max_length)
    inputs = list(cached.custom_inputs)
    inputs.insert(inputs.index(ids) + 1, spec)
    return replace(cached, custom_inputs=tuple(inputs))


def positions_kind(model: onnx.ModelProto, cached: Signature, max_length: int | None = None) -> str | None:
    """How ``model``'s positions work, for a scheduler deciding which rows may share a batch: "input" (it takes
    ``position_ids``, and given each row's own, a row's logits do not move with its padding: any rows share a batch),
    "none" (it takes none, and a row's logits do not move with its padding: no positions, or positions counted from
    the mask), "padded-width" (they move: positions are column indices of the padded batch, so only rows of one
    length share a batch exactly). None when a module taking at most ``max_length`` tokens is too short to measure.

    Measured on one prompt laid out three ways in one batch: packed at the front (right-padded), behind padded
    columns (left-padded), and split by padded columns (a hole, as a right-padded prompt leaves before the tokens
    generated after it). Padding before a row alone cannot tell: a rotary model's scores depend only on how far
    apart two tokens are, which a uniform shift keeps; a hole changes it."""
    vocab, pad = cached.tensors[INPUT_IDS].vocab or 2, 2
    length = 5 if max_length is None else min(5, max_length - pad)
    if length < 2:  # a hole needs a token on either side
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    width, split = length + pad, length // 2
    columns = np.arange(width)
    real = np.stack([columns < length,  # packed
                     columns >= pad,  # behind padding
                     (columns < split) | (columns >= split + pad)])  # a hole after the first tokens
    ids = np.zeros(real.shape, np.int64)
    ids[real] = np.tile(np.arange(1, length + 1) % vocab, len(real))
    feeds = {INPUT_IDS: ids, ATTENTION_MASK: real.astype(np.int64)}
    for name in cached.cache_pairs:
        feeds[name] = np.zeros((len(real), cached.tensors[name].axes[1], 0, cached.tensors[name].axes[3]), np.float32)
    takes_positions = POSITION_IDS in cached.tensors
    if takes_positions:  # each token's count of real tokens before it, as a generator gives them
        feeds[POSITION_IDS] = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    logits = session.run([LOGITS], feeds)[0]
    rows = [logits[row][real[row]] for row in range(len(real))]
    same = all(np.allclose(rows[0], row, atol=1e-4, rtol=1e-4) for row in rows[1:])
    if not same:
        return POSITIONS_PADDED_WIDTH
    return POSITIONS_INPUT if takes_positions else POSITIONS_NONE


def _int64_constant(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value]))


def _grown(new: str, past_name: str, grown: str, past: str) -> list[onnx.NodeProto]:
    """grown = past ++ new[:, :, past_seq:]: the cache grown by this call's positions."""
    cut = f"{grown}.cut"
    return [
        helper.make_node("Slice", [new, past, _PREFIX + "end", _PREFIX + "seq_axis"], [cut]),
        helper.make_node("Concat", [past_name, cut], [grown], axis=2),
    ]


def _set_interface(graph: onnx.GraphProto, cached: Signature, float_type: int) -> None:
    """The graph's inputs and outputs as ``cached`` declares them (the placeholders' old ones dropped)."""
    dtypes = {MODEL_DTYPE: float_type, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}

    def info(spec: TensorSpec) -> onnx.ValueInfoProto:
        dims = [axis if isinstance(axis, int) else str(axis) for axis in spec.axes]
        return helper.make_tensor_value_info(spec.name, dtypes[spec.dtype], dims)

    graph.ClearField("input")
    graph.input.extend(info(spec) for spec in cached.custom_inputs)
    graph.ClearField("output")
    graph.output.extend(info(spec) for spec in cached.custom_outputs)


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its nodes in topological order (the new ones were appended)."""
    ir_model = ir.serde.deserialize_model(model)
    ir_model.graph.sort()
    return ir.serde.serialize_model(ir_model)


# A prompt, one-token steps, then a several-token step; batch 1 unpadded, prompts padded on the right, the
# left and both (each row its own length), and a prompt past the 256 keys where the fused kernels change.
OWN_CACHE_CASES = (
    CacheCase(1, 1, 2, 3, "none"),
    CacheCase(3, 7, 2, 3, "right"),
    CacheCase(3, 6, 2, 4, "left"),
    CacheCase(2, 260, 1, 3, "mixed"),
)


def capped_cache_cases(cases: Sequence[CacheCase], max_length: int | None) -> tuple[CacheCase, ...]:
    """``cases`` with every whole sequence at most ``max_length`` tokens (the prompt shortened)."""
    if max_length is None:
        return tuple(cases)
    return tuple(replace(c, prefill=max(1, min(c.prefill, max_length - c.steps - c.chunk))) for c in cases)


# The ragged layout's calls (exporters.fusion.ragged_cache): a several-token step only at batch 1 (chunk is
# ignored on more rows), prompts right-padded with rows of different lengths, a prompt past 256 keys.
RAGGED_CACHE_CASES = (
    CacheCase(1, 1, 2, 3, "none"),
    CacheCase(3, 7, 3, 0, "right"),
    CacheCase(2, 260, 2, 0, "right"),
)


# A quantized file's cache after the calls against its own one call's. The attention kernels differ between a
# prompt and a one-token step by fp32 rounding (1e-7), and MatMulNBits at accuracy_level 4 rounds activations to
# int8, which turns such a difference into a whole rounding step now and then; later layers' keys and values move
# by that (measured at int4 on the tutorial GPT's bench build, 6 layers: 1e-7 in layers 0-2, then 5.5e-4, 1.2e-3,
# 4.3e-3). A wrong cache (a stale row, a shifted position) is off by tens of percent.
QUANTIZED_CACHE_REL_ERR = 0.05


def check_own_cache_parity(
    reference: torch.nn.Module,
    declared: Signature,
    session: MHASession | PlainRuns,
    cases: Sequence[CacheCase],
    atol: float,
    rtol: float,
    seed: int = 0,
    layout: str = CACHE_HOLES,
    rel_budget: float | None = None,
) -> ParityReport:
    """A causal LM's cache ``session`` decoding each case call by call (a prompt, then steps) against
    ``reference``, the module's one forward over the whole sequence (its ``declared`` cache-free inputs): each
    call's logits on every real row, named by the call where they differ; and the cache after the last call
    against the cache one call over the whole sequence returns, on real positions.

    ``layout`` CACHE_HOLES: every row's calls take the same columns (a prompt padded on the case's side, then
    the steps); CACHE_RAGGED (``fusion.ragged_cache``'s contract): prompts right-padded, each row's steps at its
    own length, positions each row's own, the several-token call only at batch 1; ``session`` then a
    ``PlainRuns``. ``rel_budget`` (a quantized file): each call's logits pass within that relative error of the
    module's instead of atol/rtol, and the cache after the calls within ``QUANTIZED_CACHE_REL_ERR`` of one call's."""
    tokens, mask, output = lm_tensors(declared)
    cache_budget = None if rel_budget is None else min(rel_budget, QUANTIZED_CACHE_REL_ERR)
    comparisons, failures, labels = [], [], []
    for index, case in enumerate(cases):
        rng = np.random.default_rng(seed + index)
        calls = _ragged_calls(case, rng) if layout == CACHE_RAGGED else _column_calls(case, rng)
        real = right_padding_mask(calls.lengths, calls.width)
        if layout != CACHE_RAGGED:  # a ragged row's later tokens follow its prompt within the prompt's width
            real[:, : case.prefill] = calls.prompt
        ids = rng.integers(0, tokens.vocab or 2, real.shape)
        ids[~real] = 0  # what the validator hands ONNX Runtime
        label = case.label(declared)
        labels.append(label)
        expected = torch_reference(reference, declared, {tokens.name: ids, mask.name: real})[output.name]
        past = {name: np.zeros((case.batch, *_cache_dims(session, name, 0)), np.float32)
                for name in session.signature.cache_pairs}
        for call, (columns, done) in enumerate(calls.calls, 1):
            # columns [batch, seq]: each row's positions this call; done [batch]: its tokens so far after it
            rows = np.arange(case.batch)[:, None]
            given = columns < done[:, None]
            ragged_mask = right_padding_mask(done, done.max())
            feeds = {INPUT_IDS: np.where(given, ids[rows, np.minimum(columns, calls.width - 1)], 0),
                     ATTENTION_MASK: ragged_mask if layout == CACHE_RAGGED else real[:, : done.max()], **past}
            if POSITION_IDS in session.signature.tensors:
                feeds[POSITION_IDS] = columns
            result = session.run(feeds)
            want, shown = expected[rows, np.minimum(columns, calls.width - 1)], real[rows, columns] & given
            if LOGITS in session.signature.last_token_outputs:  # --logits last: each row's last real token's
                last = shown.shape[1] - 1 - np.argmax(shown[:, ::-1], axis=1)
                want = want[np.arange(len(last)), last][:, None]
            for comparison in compare_outputs(
                session.signature, {LOGITS: result[LOGITS]}, {LOGITS: want}, shown,
                atol, rtol, rel_budget, names=[LOGITS], atol_per_row=True,
            ):
                comparisons.append(comparison)
                if not comparison.passed:
                    failures.append(f"{label} call {call} of {len(calls.calls)} ({columns.shape[1]} token(s) "
                                    f"after {columns[0, 0]}{'' if case.batch == 1 else ' in row 0'}): "
                                    f"{comparison.summary()}")
            past = {name: result[present] for name, present in session.signature.cache_pairs.items()}
        empty = {name: np.zeros((case.batch, *_cache_dims(session, name, 0)), np.float32) for name in past}
        whole = session.run({INPUT_IDS: ids, ATTENTION_MASK: real, **_column_positions(session, case.batch, 0,
                                                                                       calls.width), **empty})
        for name, present in session.signature.cache_pairs.items():
            # [batch, heads, total, d_k] -> [batch, total, heads, d_k]: the real positions' rows
            got, want = (np.moveaxis(a[:, :, : calls.width], 2, 1)[real] for a in (past[name], whole[present]))
            comparison = compare_arrays(present, got, want, atol, rtol, cache_budget, atol_per_row=True)
            comparisons.append(comparison)
            if not comparison.passed:
                failures.append(f"{label}: {present} after the calls is not one call's ({comparison.summary()})")
    return parity_report(comparisons, labels, failures, atol, rtol, rel_budget=rel_budget)


class PlainRuns:
    """A ragged-layout file run on the CPU provider with plain numpy feeds, ORT's graph optimisations off (so that
    they cannot mask a bad rewrite): the validator of ``MHASession`` reads a mask by the holes convention (its last
    ``seq`` columns are this call's tokens) and would zero a shorter row's new token."""

    def __init__(self, model: onnx.ModelProto, signature: Signature):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.signature = signature
        self._session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: np.asarray(array, np.int64 if name in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) else None)
                 for name, array in feeds.items()}
        names = list(self.signature.output_names)
        return dict(zip(names, self._session.run(names, feeds), strict=True))


@dataclass(frozen=True)
class _Calls:
    """A case's calls: ``calls`` (each row's positions [batch, seq], each row's tokens after it [batch]),
    ``prompt`` the first call's real tokens [batch, prefill], ``lengths`` each row's whole length, ``width``
    the longest."""

    calls: list[tuple[np.ndarray, np.ndarray]]
    prompt: np.ndarray
    lengths: np.ndarray
    width: int


def _column_calls(case: CacheCase, rng: np.random.Generator) -> _Calls:
    """Every row's calls over the same columns: the prompt padded on the case's side, then the steps."""
    prompt = padding_mask(case.batch, case.prefill, case.padding, rng)
    calls, start = [], 0
    for length in case.calls:
        columns = np.broadcast_to(np.arange(start, start + length), (case.batch, length)).copy()
        calls.append((columns, np.full(case.batch, start + length)))
        start += length
    return _Calls(calls, prompt, np.full(case.batch, start), start)


def _ragged_calls(case: CacheCase, rng: np.random.Generator) -> _Calls:
    """Each row's calls from its own length: the prompt right-padded (rows of different lengths), one-token
    steps at each row's next position, then the several-token call at batch 1 only."""
    padding = "none" if case.padding == "none" else "right"
    prompt = padding_mask(case.batch, case.prefill, padding, rng)
    done = prompt.sum(axis=1)
    calls = [(np.broadcast_to(np.arange(case.prefill), (case.batch, case.prefill)).copy(), done)]
    steps = [1] * case.steps + ([case.chunk] if case.batch == 1 and case.chunk else [])
    for length in steps:
        columns = done[:, None] + np.arange(length)[None]
        done = done + length
        calls.append((columns, done))
    return _Calls(calls, prompt, done, int(done.max()))


def _column_positions(session: MHASession, batch: int, start: int, end: int) -> dict[str, np.ndarray]:
    """``position_ids`` as the module computes them (the padded batch's column indices), where the file
    takes them."""
    if POSITION_IDS not in session.signature.tensors:
        return {}
    return {POSITION_IDS: np.broadcast_to(np.arange(start, end), (batch, end - start)).copy()}


def _cache_dims(session: MHASession, name: str, length: int) -> tuple[int, int, int]:
    _, heads, _, head_dim = session.signature.tensors[name].axes
    return heads, length, head_dim
