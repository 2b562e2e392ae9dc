"""A KV cache for a user's own encoder-decoder, written with no cache code: its plain export cut in two.

The seq2seq's forward takes source ids and mask and target ids and mask. Every value computed from the source
alone is the same on every decoding step; of those, the ones a target-dependent op reads are the boundary. In
the reference form the boundary holding the source's tokens is exactly the cross-attentions' keys and values
(the keys as the scores MatMul reads them); whatever else crosses it is derived from the source's mask alone
(its shape, a padding bias), which the decoder recomputes cheaply from ``encoder_attention_mask``. The cut:

    ENCODER file (runs once per request)
      input_ids, attention_mask (the source)           [batch, src]
      -> present.{i}.encoder.key | value                [batch, heads, src, head_dim]   per cross-attention i
    DECODER file (every step; the companion's name in its metadata)
      input_ids [batch, seq], attention_mask [batch, past + seq] (the target), encoder_attention_mask
      [batch, src], past_key_values.{i}.key|value (self-attention, as own_kv_cache grows them),
      past_key_values.{i}.encoder.key|value (the encoder's outputs, fed back unchanged)
      -> logits [batch, seq, vocab], present.{i}.key|value

The decoder's self-attentions are cached by ``own_kv_cache``'s route (placeholder target tokens for the
cached positions, each attention's past keys/values replaced by the cache) and narrowed to the new
positions (``narrowing``); the cross-attentions read the encoder's keys/values as inputs, so the encoder's
layers are not in the decoder file at all. ``KVCacheStepper`` runs the pair: the encoder on the prompt
(``present.{i}.encoder.*`` become the cross caches), then the decoder from the decoder start id.

Why cut at the cross keys/values rather than at the encoder's last hidden state: those are what every step
reads, so computing them once removes the cross projections from every step as well; and it is what
Optimum's and onnxruntime-genai's encoder-decoders cache (``.encoder.key|value``). Per-step parity at export
(``check_seq2seq_cache_parity``) against the module's full forward proves the cut for each model, nothing
written when it fails.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from mha_deploy.compare import compare_arrays
from mha_deploy.errors import ExportError, ParityError
from mha_deploy.exporters.mask_inputs import int64_masks
from mha_deploy.exporters.narrowing import (
    LengthNames,
    NarrowingRefused,
    _without_dead_nodes,
    narrow_to_new_positions,
)
from mha_deploy.exporters.own_kv_cache import (
    _PREFIX as CACHE_PREFIX,
)
from mha_deploy.exporters.own_kv_cache import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    AttentionCache,
    attach_own_caches,
    cache_signature,
    find_attention_caches,
)
from mha_deploy.exporters.parity import DEFAULT_ATOL, DEFAULT_RTOL, parity_report, torch_reference
from mha_deploy.exporters.quantize import Quantization
from mha_deploy.inputs import padding_mask
from mha_deploy.metadata import (
    ENCODER_DECODER_KEY,
    EncoderDecoderRecord,
    GenerationIds,
    ParityReport,
    WeightOnlyRecord,
)
from mha_deploy.onnx_nodes import rename_value
from mha_deploy.signature import FIXED_SHAPE_ROLES, PADDING_MASK, TOKENS, Signature, TensorSpec

ENCODER_MASK = "encoder_attention_mask"
_SOURCE_PROBE = 5  # the source length of the narrowing's probe runs: apart from its two target lengths (11, 13)


@dataclass(frozen=True)
class Seq2SeqTensors:
    """The declared source ids and mask, target ids and mask, and the per-target-token logits. A source of features
    (Whisper's ``input_features``, the audio role: [batch, mel, frames], every item the same size) has no mask."""

    source: TensorSpec
    source_mask: TensorSpec | None
    target: TensorSpec
    target_mask: TensorSpec
    logits: TensorSpec

    @property
    def features(self) -> bool:
        """Whether the source is features of a fixed size (no length axis, no mask) rather than token ids."""
        return self.source.role in FIXED_SHAPE_ROLES

    @property
    def source_inputs(self) -> tuple[str, ...]:
        return (self.source.name,) + ((self.source_mask.name,) if self.source_mask is not None else ())


def seq2seq_tensors(signature: Signature) -> Seq2SeqTensors | None:
    """The encoder-decoder's tensors when ``signature`` declares two token inputs on two axes, each with its
    padding mask, and one output with a row per target token; None when it is not that shape (a causal LM's
    checks then say what --kv-cache needs)."""
    inputs = signature.custom_inputs
    tokens = [spec for spec in inputs if spec.role == TOKENS]
    masks = {spec.marks: spec for spec in inputs if spec.role == PADDING_MASK}
    features = [spec for spec in inputs if spec.role in FIXED_SHAPE_ROLES]
    if len(tokens) == 1 and len(features) == 1 and len(inputs) == 3 and set(masks) == {tokens[0].name}:
        return _features_seq2seq(signature, features[0], tokens[0], masks[tokens[0].name])
    if len(tokens) != 2 or len(inputs) != 4 or set(masks) != {spec.name for spec in tokens}:
        return None
    by_axis = {spec.axes[1]: spec for spec in tokens}
    outputs = signature.custom_outputs
    # The logits: a row per target token (a model may also return its encoder's states: not cached, dropped).
    per_target = [spec for spec in outputs if len(spec.axes) == 3 and spec.axes[1] in by_axis]
    named = [spec for spec in per_target if spec.name == LOGITS]
    logits = named or per_target
    target_axes = {spec.axes[1] for spec in logits}
    if len(by_axis) != 2 or len(target_axes) != 1 or (len(logits) != 1 and not named):
        raise ExportError(
            "--kv-cache for an encoder-decoder needs one output with a row per target token (its logits, or one "
            f"named logits), got {', '.join(f'{spec.name} {spec.describe()}' for spec in outputs)}"
        )
    target = by_axis[target_axes.pop()]
    outputs = logits
    source = next(spec for spec in tokens if spec is not target)
    return Seq2SeqTensors(source, masks[source.name], target, masks[target.name], outputs[0])


def _features_seq2seq(signature: Signature, source: TensorSpec, target: TensorSpec,
                      target_mask: TensorSpec) -> Seq2SeqTensors:
    """An encoder-decoder whose source is features of a fixed size (Whisper): the logits are the output with a row
    per target token (one named logits where several)."""
    per_target = [spec for spec in signature.custom_outputs if len(spec.axes) == 3 and spec.axes[1] == target.axes[1]]
    logits = [spec for spec in per_target if spec.name == LOGITS] or per_target
    if len(logits) != 1:
        raise ExportError(
            "--kv-cache for an encoder-decoder needs one output with a row per target token (its logits, or one "
            f"named logits), got {', '.join(f'{spec.name} {spec.describe()}' for spec in signature.custom_outputs)}"
        )
    return Seq2SeqTensors(source, None, target, target_mask, logits[0])


@dataclass(frozen=True)
class Cut:
    """The plain graph's attentions sorted by what they read: the decoder's self-attentions (cached as a causal
    LM's), the cross-attentions (keys/values from the source), and how many run on the source alone."""

    self_layers: list[AttentionCache]
    cross_layers: list[AttentionCache]
    encoder_attentions: int


def cut_plain(plain: onnx.ModelProto, tensors: Seq2SeqTensors, attention_ops: int) -> Cut:
    """Find the boundary of the source-only subgraph and check it is the cross-attentions' keys/values; an
    ``ExportError`` naming the value otherwise (a cache for such a model would be wrong)."""
    layers = find_attention_caches(plain, attention_ops)
    graph = plain.graph
    target_side = _dependents(graph, {tensors.target.name, tensors.target_mask.name})
    source_tokens = _dependents(graph, {tensors.source.name}, through_shapes=False)
    by_name = {node.name: node for node in graph.node}
    self_layers, cross_layers, encoder = [], [], 0
    allowed: set[tuple[str, int]] = set()
    for layer in layers:
        scores, weighted = by_name[layer.scores], by_name[layer.weighted]
        queries, keys_t, values = scores.input[0], scores.input[1], weighted.input[1]
        if queries not in target_side:
            encoder += 1
        elif keys_t in target_side and values in target_side:
            self_layers.append(layer)
        elif keys_t not in target_side and values not in target_side:
            cross_layers.append(layer)
            allowed |= {(scores.name, 1), (weighted.name, 1)}
        else:
            raise ExportError(f"--kv-cache: the attention at {layer.scores} reads keys from one side and values "
                              "from the other; it is neither a self- nor a cross-attention")
    if not self_layers or not cross_layers or len(self_layers) != len(cross_layers):
        raise ExportError(
            f"--kv-cache for an encoder-decoder: found {len(self_layers)} decoder self-attention(s) and "
            f"{len(cross_layers)} cross-attention(s); a layer of each per decoder layer is what is cached"
        )
    for node in graph.node:
        if not any(out in target_side for out in node.output):
            continue
        for index, name in enumerate(node.input):
            if name in source_tokens and name not in target_side and (node.name, index) not in allowed:
                raise ExportError(
                    f"--kv-cache for an encoder-decoder: {node.op_type} {node.name} reads {name}, computed from "
                    "the source's tokens, but is not a cross-attention's keys or values; only those are passed "
                    "from the encoder to the decoder, so nothing is written"
                )
    return Cut(self_layers, cross_layers, encoder)


def _dependents(graph: onnx.GraphProto, roots: set[str], through_shapes: bool = True) -> set[str]:
    """Every value computed from ``roots`` (``through_shapes`` False: a Shape's output does not count, it reads
    the length only, which the decoder has from the source's mask)."""
    found = set(roots)
    for node in graph.node:  # topologically sorted
        if not through_shapes and node.op_type in ("Shape", "Size"):
            continue
        if any(name in found for name in node.input):
            found.update(node.output)
    return found


def encoder_model(plain: onnx.ModelProto, tensors: Seq2SeqTensors, cut: Cut) -> onnx.ModelProto:
    """The source-only subgraph: ``input_ids``, ``attention_mask`` (the source's; features: the one input under its
    own name) -> the cross keys/values."""
    model = onnx.ModelProto()
    model.CopyFrom(plain)
    graph = model.graph
    by_name = {node.name: node for node in graph.node}
    float_type = _elem_types(graph)[tensors.logits.name]
    nodes, outputs = [], []
    for i, layer in enumerate(cut.cross_layers):
        keys_t, values = by_name[layer.scores].input[1], by_name[layer.weighted].input[1]
        key, value = f"present.{i}.encoder.key", f"present.{i}.encoder.value"
        nodes += [helper.make_node("Transpose", [keys_t], [key], perm=[0, 1, 3, 2]),
                  helper.make_node("Identity", [values], [value])]
        dims = ["batch", layer.heads, "src_seq", layer.head_dim]
        outputs += [helper.make_tensor_value_info(name, float_type, dims) for name in (key, value)]
    graph.node.extend(nodes)
    graph.ClearField("output")
    graph.output.extend(outputs)
    model = _without_dead_nodes(model)
    kept = [value for value in graph.input if value.name in tensors.source_inputs]
    for value in kept:
        # Token ids and their mask under Optimum's encoder names; features keep the model's name (input_features).
        name = (value.name if tensors.features else INPUT_IDS) if value.name == tensors.source.name else ATTENTION_MASK
        rename_value(model.graph, value.name, name)
    model.graph.ClearField("input")
    model.graph.input.extend(kept)
    used = {name for node in model.graph.node for name in node.input}
    if tensors.target.name in used or tensors.target_mask.name in used:
        raise ExportError("--kv-cache: the cross-attentions' keys/values read the target; no encoder can be cut")
    return model


def decoder_model(
    plain: onnx.ModelProto, tensors: Seq2SeqTensors, cut: Cut, max_length: int | None
) -> tuple[onnx.ModelProto, str | None]:
    """The target side: the cross keys/values as inputs, the self-attentions cached as a causal LM's
    (``own_kv_cache``), narrowed to each call's new positions where that is proven (else the reason)."""
    model = onnx.ModelProto()
    model.CopyFrom(plain)
    graph = model.graph
    by_name = {node.name: node for node in graph.node}
    types = _elem_types(graph)
    float_type = types[tensors.logits.name]
    nodes, extra_inputs = [], []
    for i, layer in enumerate(cut.cross_layers):
        scores, weighted = by_name[layer.scores], by_name[layer.weighted]
        key, value = f"past_key_values.{i}.encoder.key", f"past_key_values.{i}.encoder.value"
        nodes.append(helper.make_node("Transpose", [key], [key + ".t"], perm=[0, 1, 3, 2]))
        scores.input[1], weighted.input[1] = key + ".t", value
        dims = ["batch", layer.heads, "src_seq", layer.head_dim]
        extra_inputs += [helper.make_tensor_value_info(name, float_type, dims) for name in (key, value)]
    # A private name: the source's own (input_ids, in Hugging Face's models) is the decoder's target now.
    source = CACHE_PREFIX + "source_ids"
    rename_value(graph, tensors.source.name, source)
    if tensors.source_mask is not None:
        # The source's tokens are read for their shape only now (the check in cut_plain): zeros of the mask's shape.
        rename_value(graph, tensors.source_mask.name, ENCODER_MASK)
        nodes += [
            helper.make_node("Shape", [ENCODER_MASK], [source + ".shape"]),
            helper.make_node("ConstantOfShape", [source + ".shape"], [source],
                             value=helper.make_tensor("zero", TensorProto.INT64, [1], [0])),
        ]
        mask_info = helper.make_tensor_value_info(ENCODER_MASK, types[tensors.source_mask.name], ["batch", "src_seq"])
        extra_inputs.insert(0, mask_info)
    else:
        # Features of a fixed size: whatever the decoder still reads of them (their batch) from zeros of their shape,
        # the batch the target's.
        fixed = [int(size) for size in tensors.source.axes[1:]]
        nodes += [
            helper.make_node("Shape", [tensors.target.name], [source + ".batch"], start=0, end=1),
            helper.make_node("Constant", [], [source + ".rest"], value=helper.make_tensor(
                "rest", TensorProto.INT64, [len(fixed)], fixed)),
            helper.make_node("Concat", [source + ".batch", source + ".rest"], [source + ".shape"], axis=0),
            helper.make_node("ConstantOfShape", [source + ".shape"], [source],
                             value=helper.make_tensor("zero", types[tensors.source.name], [1], [0])),
        ]
    graph.node.extend(nodes)
    kept = [value for value in graph.input if value.name != source]
    graph.ClearField("input")
    graph.input.extend(kept)
    graph.input.extend(extra_inputs)  # declared for the sort; attach_own_caches sets the target's interface

    lm = Signature.custom((tensors.target, tensors.target_mask), (tensors.logits,))
    cached = cache_signature(lm, cut.self_layers)
    # attach_own_caches sets the causal LM's interface and sorts before the inputs it does not know are declared
    # again (just below): onnx_ir's warning about them, once per input, says nothing to a user.
    serde_log = logging.getLogger("onnx_ir.serde")
    level = serde_log.level
    serde_log.setLevel(logging.ERROR)
    try:
        attached = attach_own_caches(_sorted_model(model), lm, cached, cut.self_layers)
    finally:
        serde_log.setLevel(level)
    attached.graph.input.extend(extra_inputs)
    attached = _without_dead_nodes(attached)

    def feeds(batch: int, past: int, seq: int) -> dict[str, np.ndarray]:
        result = {INPUT_IDS: np.zeros((batch, seq), np.int64), ATTENTION_MASK: np.ones((batch, past + seq), np.int64)}
        if tensors.source_mask is not None:
            result[ENCODER_MASK] = np.ones((batch, _SOURCE_PROBE), onnx.helper.tensor_dtype_to_np_dtype(
                types[tensors.source_mask.name]))
        for value in attached.graph.input:
            if value.name.startswith("past_key_values."):
                _, heads, _, head_dim = (d.dim_value for d in value.type.tensor_type.shape.dim)
                length = _SOURCE_PROBE if ".encoder." in value.name else past
                result[value.name] = np.zeros((batch, heads, length, head_dim), np.float32)
        return result

    names = LengthNames(CACHE_PREFIX + "past_seq", CACHE_PREFIX + "end", INPUT_IDS, ATTENTION_MASK)
    try:
        return _shapes_without_zeros(narrow_to_new_positions(attached, names, feeds, max_length)[0], source), None
    except NarrowingRefused as exc:
        return _shapes_without_zeros(attached, source), str(exc)


def _shapes_without_zeros(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    """``model`` with each ``Shape`` of the source's zeros read off the shape they were made from, the zeros gone,
    when only ``Shape`` ops read them (the check in ``cut_plain``: the decoder needs the source's length and batch,
    never its values). Why: Whisper's zeros are [batch, 80, 3000] floats, 7.7 MB written on every decoding step
    at batch 8 for two integers."""
    graph = model.graph
    readers = [node for node in graph.node if source in node.input]
    made = [node for node in graph.node if source in node.output]
    if not readers or len(made) != 1 or made[0].op_type != "ConstantOfShape" or \
            any(node.op_type != "Shape" for node in readers):
        return model
    shape = made[0].input[0]
    reading = {id(node) for node in readers}
    nodes = []
    for node in graph.node:
        if id(node) not in reading:
            nodes.append(node)
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if not attributes:
            nodes.append(helper.make_node("Identity", [shape], list(node.output), name=node.name))
            continue
        # Shape's start/end (negative from the end, clamped) are Slice's on the one axis of the shape tensor.
        bounds = [f"{node.name}.start", f"{node.name}.end"]
        nodes += [
            helper.make_node("Constant", [], [bounds[0]], value=helper.make_tensor(
                bounds[0], TensorProto.INT64, [1], [attributes.get("start", 0)])),
            helper.make_node("Constant", [], [bounds[1]], value=helper.make_tensor(
                bounds[1], TensorProto.INT64, [1], [attributes.get("end", 2**62)])),
            helper.make_node("Slice", [shape, *bounds], list(node.output), name=node.name),
        ]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return _without_dead_nodes(model)


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    return {value.name: value.type.tensor_type.elem_type for value in (*graph.input, *graph.output, *graph.value_info)}


def _sorted_model(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.serde.deserialize_model(model)
    ir_model.graph.sort()
    return ir.serde.serialize_model(ir_model)


# --- parity, call by call --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seq2SeqCase:
    """One decoding run checked at export: ``batch`` sources ``source_len`` long padded on ``source_padding``'s
    side; a target prompt of ``prompt`` tokens (1: the decoder start alone) padded on ``target_padding``'s side
    (each row its own length), then ``steps`` one-token calls and a ``chunk``-token call."""

    batch: int
    source_len: int
    source_padding: str
    prompt: int
    target_padding: str
    steps: int
    chunk: int

    @property
    def calls(self) -> list[int]:
        return [self.prompt] + [1] * self.steps + ([self.chunk] if self.chunk else [])

    @property
    def label(self) -> str:
        return (f"batch {self.batch}, source {self.source_len} ({self.source_padding} padding), target prompt "
                f"{self.prompt} ({self.target_padding} padding)")


SEQ2SEQ_CACHE_CASES = (
    Seq2SeqCase(1, 4, "none", 1, "none", 2, 3),
    Seq2SeqCase(3, 7, "right", 1, "none", 3, 3),
    Seq2SeqCase(3, 6, "left", 1, "none", 2, 4),
    Seq2SeqCase(3, 6, "right", 5, "left", 2, 3),
    Seq2SeqCase(3, 5, "left", 6, "right", 1, 3),
)


def capped_seq2seq_cases(cases: Sequence[Seq2SeqCase], max_length: int | None) -> tuple[Seq2SeqCase, ...]:
    if max_length is None:
        return tuple(cases)
    return tuple(replace(c, source_len=min(c.source_len, max_length),
                         prompt=max(1, min(c.prompt, max_length - c.steps - c.chunk))) for c in cases)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def check_seq2seq_cache_parity(
    reference: torch.nn.Module, declared: Signature, tensors: Seq2SeqTensors, encoder: onnx.ModelProto,
    decoder: onnx.ModelProto, cases: Sequence[Seq2SeqCase], atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
    seed: int = 0, rel_budget: float | None = None, pad_id: int | None = None,
) -> ParityReport:
    """The encoder once, then the decoder call by call, against ``reference``'s one forward over the whole
    target (its ``declared`` cache-free inputs): each call's logits on every real target row, named by the
    case and call where they differ; within ``rel_budget`` relative error instead of atol/rtol (quantized files).

    ``pad_id``: the real target tokens are drawn without it. A model may number its target positions by the ids
    that are not the pad id (M2M100: a cumulative sum over ``ids != pad``), so one forward over a target holding it
    numbers the tokens after it one lower; a cached step, as transformers' own cached forward, numbers a token by
    how many came before it. Padding is marked by the mask, never by a real token's id."""
    encoder_session, decoder_session = _session(encoder), _session(decoder)
    dtypes = {port.name: port.type for port in decoder_session.get_inputs()}
    source_mask_type = np.bool_ if dtypes.get(ENCODER_MASK) == "tensor(bool)" else np.int64
    comparisons, failures, labels = [], [], []
    for index, case in enumerate(cases):
        rng = np.random.default_rng(seed + index)
        if tensors.features:  # every item of the fixed size, nothing padded: the case's source length is unused
            source = rng.standard_normal((case.batch, *tensors.source.axes[1:])).astype(np.float32)
            source_real = None
        else:
            source_real = padding_mask(case.batch, case.source_len, case.source_padding, rng)
            source = rng.integers(0, tensors.source.vocab or 2, (case.batch, case.source_len))
            source[~source_real] = 0
        total = sum(case.calls)
        target = rng.integers(0, tensors.target.vocab or 2, (case.batch, total))
        if pad_id is not None:  # the next id in its place (id 0 where it is the last)
            target[target == pad_id] = (pad_id + 1) % (tensors.target.vocab or 2)
        target_real = np.ones((case.batch, total), bool)
        target_real[:, : case.prompt] = padding_mask(case.batch, case.prompt, case.target_padding, rng)
        target[~target_real] = 0
        labels.append(case.label)
        sources = {tensors.source.name: source}
        if tensors.source_mask is not None:
            sources[tensors.source_mask.name] = source_real
        expected = torch_reference(reference, declared, {
            **sources, tensors.target.name: target, tensors.target_mask.name: target_real})[tensors.logits.name]
        if tensors.features:
            source_feeds, encoder_mask = {tensors.source.name: source}, {}
        else:
            source_feeds = {INPUT_IDS: source,
                            ATTENTION_MASK: source_real.astype(_input_type(encoder_session, ATTENTION_MASK))}
            encoder_mask = {ENCODER_MASK: source_real.astype(source_mask_type)}
        encoded = dict(zip([o.name for o in encoder_session.get_outputs()], encoder_session.run(None, source_feeds),
                           strict=True))
        past = {}
        for port in decoder_session.get_inputs():
            if port.name.startswith("past_key_values.") and ".encoder." not in port.name:
                past[port.name] = np.zeros((case.batch, port.shape[1], 0, port.shape[3]), np.float32)
        cross = {name.replace("present.", "past_key_values.", 1): value for name, value in encoded.items()}
        outputs = [o.name for o in decoder_session.get_outputs()]
        start = 0
        for call, length in enumerate(case.calls, 1):
            end = start + length
            result = dict(zip(outputs, decoder_session.run(None, {
                INPUT_IDS: target[:, start:end], ATTENTION_MASK: target_real[:, :end].astype(np.int64),
                **encoder_mask, **past, **cross}), strict=True))
            comparison = compare_arrays(LOGITS, result[LOGITS][target_real[:, start:end]],
                                        expected[:, start:end][target_real[:, start:end]], atol, rtol,
                                        rel_budget, atol_per_row=True)
            comparisons.append(comparison)
            if not comparison.passed:
                failures.append(f"{case.label}: call {call} of {len(case.calls)} ({length} token(s) after {start}): "
                                f"{comparison.summary()}")
            past = {name: result[name.replace("past_key_values.", "present.", 1)] for name in past}
            start = end
    return parity_report(comparisons, labels, failures, atol, rtol, rel_budget=rel_budget)


def _input_type(session: ort.InferenceSession, name: str):
    port = next(p for p in session.get_inputs() if p.name == name)
    return np.bool_ if port.type == "tensor(bool)" else np.int64


# --- the export --------------------------------------------------------------------------------------------------


@dataclass
class Seq2SeqExport:
    """The two files' models, checked, and what the export found and did."""

    encoder: onnx.ModelProto
    decoder: onnx.ModelProto
    parity: ParityReport
    fusion: str
    warnings: list[str]
    attentions: tuple[int, int, int]  # encoder self, decoder self, cross
    quantization: str = "none"
    weight_only: WeightOnlyRecord | None = None  # the decoder's


def build_seq2seq_cache(
    reference: torch.nn.Module, declared: Signature, plain: onnx.ModelProto, attention_ops: int,
    max_length: int | None, cases: Sequence[Seq2SeqCase] | None = None, atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL, fuse: str = "auto", quantize: Quantization | None = None, pad_id: int | None = None,
    source_mask_dtype: str = "bool",
) -> Seq2SeqExport:
    """``plain`` (the cache-free export of ``declared``) as an encoder file and a decoder file with a cache, each
    attention fused (``fuse`` "auto" or "mha": the mha target, auto falling back to the unfused graph with a
    warning), both quantized as ``quantize`` asks (weight-only: the parity then within its relative budget),
    checked call by call against ``reference`` (real target tokens drawn without ``pad_id``); ``ParityError`` naming
    the failing call."""
    from mha_deploy.exporters.fusion import fuse_attention

    quantize = quantize or Quantization()
    # The encoder has no logits: its head is the decoder's.
    encoder_quantize = replace(quantize, keep_head_fp32=False)

    tensors = seq2seq_tensors(declared)
    cut = cut_plain(plain, tensors, attention_ops)
    encoder = encoder_model(plain, tensors, cut)
    decoder, refused = decoder_model(plain, tensors, cut, max_length)
    warnings = [f"--kv-cache: each step runs the whole target's forward ({refused})"] if refused else []
    cases = cases or capped_seq2seq_cases(SEQ2SEQ_CACHE_CASES, max_length)
    counts = (cut.encoder_attentions, len(cut.self_layers) + len(cut.cross_layers))

    def fused(target: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        models = []
        for model, expected in zip((encoder, decoder), counts, strict=True):
            result, report = fuse_attention(model, target)
            if target != "none" and (not report.complete or report.fused != expected):
                raise ExportError(f"{report.summary()}, expected {expected} fused")
            # source_mask_dtype int64 (export --hf): the source's mask 1/0 as a tokenizer gives it (the encoder's
            # attention_mask, the decoder's encoder_attention_mask), as the target's already is; cast to bool
            # inside, after fusion, so the fused attentions are the bool mask's.
            models.append(int64_masks(result, (ATTENTION_MASK, ENCODER_MASK)) if source_mask_dtype == "int64"
                          else result)
        return encoder_quantize.apply(models[0]), quantize.apply(models[1])

    def checked(encoder_model: onnx.ModelProto, decoder_model: onnx.ModelProto) -> ParityReport:
        return check_seq2seq_cache_parity(reference, declared, tensors, encoder_model, decoder_model, cases, atol,
                                          rtol, rel_budget=quantize.rel_budget, pad_id=pad_id)

    target = "mha" if fuse == "auto" else fuse
    try:
        fused_encoder, fused_decoder = fused(target)
        report = checked(fused_encoder, fused_decoder)
        if not report.passed and fuse == "auto" and target != "none":
            raise ParityError(report.summary())
    except (ExportError, ParityError) as exc:
        if fuse != "auto" or target == "none":
            raise
        warnings.append(f"--fuse auto: {target} fusion not used ({exc}); exported the unfused graphs")
        target = "none"
        fused_encoder, fused_decoder = encoder_quantize.apply(encoder), quantize.apply(decoder)
        report = checked(fused_encoder, fused_decoder)
    if not report.passed:
        raise ParityError(f"{report.summary()}; failures: {'; '.join(report.failures[:5])}; nothing written")
    return Seq2SeqExport(fused_encoder, fused_decoder, report, target, warnings,
                         (cut.encoder_attentions, len(cut.self_layers), len(cut.cross_layers)),
                         quantize.kind, quantize.record(fused_decoder))


def encoder_path(decoder: Path) -> Path:
    """The encoder file written beside ``decoder``: ``mt.onnx`` -> ``mt.encoder.onnx``."""
    return decoder.with_name(f"{decoder.stem}.encoder{decoder.suffix or '.onnx'}")


def record(model: onnx.ModelProto, entry: EncoderDecoderRecord) -> None:
    """``entry`` in ``model``'s metadata (under ``ENCODER_DECODER_KEY``), replacing an earlier one."""
    for prop in list(model.metadata_props):
        if prop.key == ENCODER_DECODER_KEY:
            model.metadata_props.remove(prop)
    model.metadata_props.add(key=ENCODER_DECODER_KEY, value=json.dumps(entry.to_dict()))




@dataclass
class PairFusion:
    """The fusion of both files, as ``echo_export`` prints it."""

    target: str
    attentions: tuple[int, int, int]

    def summary(self) -> str:
        encoder, self_attn, cross = self.attentions
        verb = "fused" if self.target != "none" else "left unfused"
        return (f"fusion {self.target}: encoder {encoder} self-attention(s); decoder {self_attn} self- and {cross} "
                f"cross-attention(s), all {verb}")


@dataclass
class Seq2SeqExportResult:
    """What ``export_model(..., kv_cache=True)`` returns for an encoder-decoder: the decoder file (``path``, what
    ``generate`` takes) and its encoder beside it (``encoder_path``)."""

    path: Path
    encoder_path: Path
    parity: ParityReport
    fusion: PairFusion
    generation: GenerationIds | None
    max_length: int | None
    warnings: list[str]
    packing: None = None
    quantization: str = "none"
    weight_only: WeightOnlyRecord | None = None


def write_seq2seq_pair(built: Seq2SeqExport, output: Path, generation: GenerationIds | None,
                       max_length: int | None) -> Seq2SeqExportResult:
    """Both files written, or neither: each to a temporary first, renamed only once both are whole."""
    from mha_deploy.atomic import atomic_path

    encoder_file = encoder_path(output)
    attentions = dict(zip(("encoder self", "decoder self", "cross"), built.attentions, strict=True))
    parity = built.parity.summary()
    record(built.decoder, EncoderDecoderRecord("decoder", encoder_file.name, generation, built.fusion, attentions,
                                               parity, max_length, built.quantization, built.weight_only))
    record(built.encoder, EncoderDecoderRecord("encoder", output.name, generation, built.fusion, attentions, parity,
                                               max_length, built.quantization, built.weight_only))
    encoder_in_place = False
    try:
        with atomic_path(output) as decoder_tmp:
            with atomic_path(encoder_file) as encoder_tmp:
                onnx.save_model(built.encoder, encoder_tmp)
                onnx.save_model(built.decoder, decoder_tmp)
            encoder_in_place = True
    except BaseException:
        if encoder_in_place:  # the decoder's rename failed after the encoder's: no encoder without its decoder
            encoder_file.unlink(missing_ok=True)
        raise
    return Seq2SeqExportResult(output, encoder_file, built.parity, PairFusion(built.fusion, built.attentions),
                               generation, max_length, built.warnings, quantization=built.quantization,
                               weight_only=built.weight_only)
