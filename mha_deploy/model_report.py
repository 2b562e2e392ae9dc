"""What an ONNX file contains, for ``mha-deploy inspect``: needs onnx, not torch."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import onnx

from mha_deploy.compare import tolerance_words
from mha_deploy.errors import ModelFileError
from mha_deploy.metadata import (
    CACHE_HOLES,
    CACHE_LAYOUT_WORDS,
    CACHE_RAGGED,
    ENCODER_DECODER_KEY,
    METADATA_KEY,
    POSITIONS_WORDS,
    EncoderDecoderRecord,
    GenerationIds,
    ModelMetadata,
    WeightOnlyRecord,
)
from mha_deploy.onnx_nodes import (
    BIAS_PROP,
    LONG_KERNEL,
    POSITION_BIAS,
    SCORE_TERMS,
    WINDOW_MASK,
    all_nodes,
    kernel_tag,
    packing_tags,
)
from mha_deploy.signature import ID_ROLES, LAST_TOKEN, Signature
from mha_deploy.token_tables import vocabulary

# Ops that carry a whole attention, with their input roles (from the ops' schemas),
# so that inspect can say which mask input a fused op reads.
ATTENTION_INPUT_ROLES = {
    ("com.microsoft", "MultiHeadAttention"): (
        "query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value",
    ),
    ("com.microsoft", "GroupQueryAttention"): (
        "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
        "sin_cache", "position_ids", "attention_bias", "head_sink",
    ),
    ("com.microsoft", "Attention"): ("input", "weights", "bias", "mask_index", "past", "attention_bias"),
    ("", "Attention"): ("Q", "K", "V", "attn_mask", "past_key", "past_value"),
}
# Inputs that turn ORT's CPU MultiHeadAttention away from its flash path (onnxruntime
# contrib_ops/cpu/bert/multihead_attention.cc): it then materialises [batch, heads, q, kv].
_MHA_NON_FLASH_INPUTS = ("key_padding_mask", "attention_bias", "past_key", "past_value")
# The fusion gives MultiHeadAttention its native key_padding_mask / unidirectional for every mask it reads
# as key padding and/or causal: a float attention_bias is a mask it could not read.
MASK_NOT_RECOGNISED = "mask not recognised, additive attention_bias"
# An attention_bias the fusion read as a bias that masks nothing (onnx_nodes.BIAS_PROP).
BIAS_NOT_MASK = f"{POSITION_BIAS}, additive attention_bias"
_BIAS_LABELS = {
    POSITION_BIAS: BIAS_NOT_MASK,
    SCORE_TERMS: f"{SCORE_TERMS}, additive attention_bias",
    WINDOW_MASK: f"{WINDOW_MASK}, additive attention_bias",
}


@dataclass
class TensorInfo:
    name: str
    dtype: str
    dims: list[str | int]
    # An output with the batch on a later axis too (TensorSpec.spans_batch, as the metadata records it)
    spans_batch: bool = False


# What a spanning output's line adds: it is the call's, not an item's (see TensorSpec.spans_batch).
SPANS_BATCH_WORDS = ("spans the batch: each item against every item of its call, so never split into items nor "
                     "batched across requests (infer leaves it out, serve runs each request as a batch of its own)")


@dataclass
class AttentionOpInfo:
    """One attention of the model: its op, and which ORT CPU kernel runs it."""

    op: str
    name: str
    inputs: dict[str, str]  # role -> tensor name, for the inputs the op is given
    attributes: dict[str, object]
    # e.g. "GroupQueryAttention (causal)", "MultiHeadAttention (flash)", PADDING_FLASH_KERNEL
    kernel: str = ""


@dataclass
class ModelReport:
    path: str
    size_bytes: int
    ir_version: int
    opsets: dict[str, int]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    op_counts: dict[str, int]
    attention_ops: list[AttentionOpInfo] = field(default_factory=list)
    # What token packing did (exporters.token_packing), one line per tag it left
    packing: list[str] = field(default_factory=list)
    metadata: dict | None = None
    # Per tokens input: the rows of the table its ids index in the graph (token_tables), None when unknown
    token_tables: dict[str, int | None] = field(default_factory=dict)
    # One file of an encoder-decoder pair exported with --kv-cache (own_seq2seq_cache): its part, its companion
    encoder_decoder: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """What ``mha-deploy inspect`` prints: the file, its I/O, ops, each attention and its kernel, metadata.

        A fused op's inputs are listed by role (``query, key, value, key_padding_mask``): the tensors
        feeding it are the exporter's internal values, whose names say nothing to a reader.
        """
        lines = [
            f"{self.path}  ({self.size_bytes / 1e6:.2f} MB, IR {self.ir_version}, "
            f"opsets {', '.join(f'{d} {v}' for d, v in self.opsets.items())})"
        ]
        for role, tensors in (("input", self.inputs), ("output", self.outputs)):
            lines += [f"  {role:6} {t.name:18} {t.dtype:8} [{', '.join(str(d) for d in t.dims)}]"
                      + (f"  {SPANS_BATCH_WORDS}" if t.spans_batch else "") for t in tensors]
        lines.append("  ops    " + ", ".join(f"{op} x{n}" for op, n in self.op_counts.items()))
        model_inputs = {t.name for t in self.inputs}
        for op in self.attention_ops:
            attrs = ", ".join(f"{k}={_readable(v)}" for k, v in op.attributes.items())
            inputs = ", ".join(
                f"{role}={name}" if name in model_inputs and name != role else role for role, name in op.inputs.items()
            )
            lines += [f"  fused  {op.op}({inputs}) {attrs}", f"         kernel: {op.kernel}"]
        lines += [f"  packed {line}" for line in self.packing]
        meta = self.metadata
        pair = self.encoder_decoder
        if meta is None and pair is not None:
            ids = GenerationIds(**pair["generation"]).describe() if pair.get("generation") else "no ids recorded"
            attentions = ", ".join(f"{n} {kind}" for kind, n in pair["attentions"].items())
            return "\n".join([
                *lines,
                f"  encoder-decoder: the {pair['part']} of a pair exported with --kv-cache; its "
                f"{'encoder' if pair['part'] == 'decoder' else 'decoder'}: {pair['companion']} (beside it)",
                f"  attentions: {attentions} (fusion {pair['fusion']}); generation: {ids}",
                *([f"  quantization {pair['quantization']}"
                   + (f": {WeightOnlyRecord.from_dict(pair['weight_only']).describe()}"
                      if pair.get("weight_only") else "")]
                  if pair.get("quantization", "none") != "none" else []),
                *([f"  max length {pair['max_length']}: generate refuses a longer source"]
                  if pair.get("max_length") is not None else []),
                f"  {pair['parity']}",
            ])
        if meta is None:
            return "\n".join([*lines, "  metadata: none (not exported by mha-deploy)"])
        sig = meta["signature"]
        if sig.get("model") == "custom":
            padded = ", ".join(sig.get("custom_paddable", [])) or "none (items of other lengths never share a batch)"
            lines.append(
                f"  model  your own, {meta['layers']} attention(s), widest d_model={meta['d_model']} "
                f"heads={meta['num_heads']} dtype={meta['dtype']} fusion={meta['fusion']}; padded along: {padded}"
            )
        else:
            stack = f"{sig['model']} x{meta['layers']} " if sig.get("model", "mha") != "mha" else ""
            lines.append(
                f"  model  {stack}d_model={meta['d_model']} heads={meta['num_heads']} attention={sig['attention']} "
                f"mask={sig['mask']} dtype={meta['dtype']} fusion={meta['fusion']}"
            )
        lines += self._vocabulary_lines(sig)
        if meta.get("max_length") is not None:
            lines.append(f"  max length {meta['max_length']}: a longer sequence is refused before ONNX Runtime")
        if sig.get("kv_cache"):
            lines += cache_layout(Signature(**sig), meta.get("cache_layout"))
        if sig.get("kv_cache") and sig.get("model") == "custom":
            layout = meta.get("cache_layout") or CACHE_HOLES
            lines.append(f"  cache layout {layout}: {CACHE_LAYOUT_WORDS.get(layout, 'unknown')}")
        if meta.get("positions") is not None:
            lines.append(f"  positions {meta['positions']}: {POSITIONS_WORDS.get(meta['positions'], 'unknown')}")
        last = [spec["name"] for spec in sig.get("custom_outputs", []) if spec.get("role") == LAST_TOKEN]
        if last:
            lines.append(f"  last token {', '.join(last)}: each row's last real token of the call only (--logits last: "
                         "what generation reads; scoring a prompt's own tokens needs --logits all)")
        if meta.get("generation") is not None:
            ids = GenerationIds(**meta["generation"])
            lines.append(f"  generate {ids.describe()} (recorded at export: generate's defaults)")
        if meta.get("quantization", "none") != "none":
            record = WeightOnlyRecord.from_dict(meta["weight_only"]) if meta.get("weight_only") else None
            lines.append(f"  quantization {meta['quantization']}" + (f": {record.describe()}" if record else ""))
            if record is not None and record.evaluation is not None:
                lines.append(f"  quality {record.evaluation.describe()}")
        parity = meta.get("parity")
        if parity and parity.get("rel_budget") is not None:
            top1 = parity.get("top1_agreement")
            lines.append(
                f"  parity {'PASSED' if parity['passed'] else 'FAILED'}: relative error {parity['rel_err']:.3%} "
                f"against fp32 torch (budget {parity['rel_budget']:.1%})"
                + (f", top-1 agreement {top1:.1%} over {parity['top1_rows']} rows" if top1 is not None else "")
                + f", over {', '.join(parity['shapes'])}"
            )
        elif parity:
            lines.append(
                f"  parity {'PASSED' if parity['passed'] else 'FAILED'}: max abs err {parity['max_abs_err']:.3g} "
                f"at {tolerance_words(parity['atol'], parity['rtol'], parity.get('atol_per_row', False))} over "
                f"{', '.join(parity['shapes'])}"
            )
        lines.append("  versions " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
        return "\n".join(lines)

    def _vocabulary_lines(self, sig: dict) -> list[str]:
        """Per tokens or segments input, the ids it takes: the recorded vocabulary, else the graph's table, else
        unknown."""
        lines = []
        for spec in sig.get("custom_inputs", ()):
            if spec["role"] not in ID_ROLES:
                continue
            vocab, rows = spec.get("vocab"), self.token_tables.get(spec["name"])
            if vocab is not None:
                said = f"vocabulary {vocab} (ids 0 to {vocab - 1})"
            elif rows is not None:
                said = f"vocabulary not recorded; the table its ids index has {rows} rows (ids 0 to {rows - 1})"
            else:
                said = "vocabulary unknown (no table its ids index could be read): only negative ids are refused"
            lines.append(f"  {spec['role']} {spec['name']}: {said}")
        return lines


def _readable(value: object) -> object:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def cache_layout(signature: Signature, layout: str | None = None) -> list[str]:
    """How a KV-cache model's past and present tensors pair up, for ``inspect`` (``layout``: a user's causal LM's
    ``ModelMetadata.cache_layout``)."""
    query = signature.query_axis
    if signature.model == "custom" and layout == CACHE_RAGGED:
        mask = signature.mask_of(signature.query_input)
        return [
            f"  cache  past_key_values.{{i}}.key/.value -> present.{{i}}.key/.value (i < {signature.layers}, one per "
            "attention): [batch, heads, W, head_dim] in (W >= each row's past), [batch, heads, max(total, W), "
            "head_dim] out (this call's written at each row's positions; in place when bound to past's buffer)",
            f"         {mask} [batch, total]: row r's first n_r entries 1 (its tokens so far), the rest 0",
        ]
    if signature.model == "custom":
        # A user's causal LM (exporters.own_kv_cache): one graph for every call, a cache per attention.
        mask = signature.mask_of(signature.query_input)
        return [
            f"  cache  past_key_values.{{i}}.key/.value -> present.{{i}}.key/.value (i < {signature.layers}, one per "
            f"attention): [batch, heads, past_seq, head_dim] in, [batch, heads, past_seq + {query}, head_dim] out "
            "(past ++ new)",
            f"         {mask} [batch, past_seq + {query}]: every token of the sequence so far, 1 = real",
        ]
    if signature.model == "mha":
        lines = [
            "  cache  past_key -> present_key, past_value -> present_value: [batch, heads, past_seq, d_k] in, "
            f"[batch, heads, past_seq + {query}, d_k] out (past ++ new)"
        ]
    else:
        lines = [
            f"  cache  past_key_values.{{i}}.key/.value -> present.{{i}}.key/.value (i < {signature.layers}): "
            f"[batch, heads, past_seq, d_k] in, [batch, heads, past_seq + {query}, d_k] out (past ++ new)",
            "         past_key_values.{i}.encoder_key/.encoder_value -> present.{i}.encoder_key/"
            ".encoder_value: empty on the first call (computed from memory), then [batch, heads, mem_seq, "
            "d_k], passed back unchanged (memory is then not read)",
        ]
    if signature.has_padding_mask:
        lines.append(f"         key_padding_mask [batch, past_seq + {query}]: every token of the sequence so far, "
                     "True = real")
    lines.append("         an If on past_seq picks the first call's graph (past_seq 0) or the later calls'; each "
                 "one's fused attentions are listed above")
    return lines


def _tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    tensor = value.type.tensor_type
    dims: list[str | int] = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in tensor.shape.dim]
    return TensorInfo(value.name, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name, dims)


def _op_label(node: onnx.NodeProto) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _roles(node: onnx.NodeProto) -> tuple[str, ...] | None:
    """The input roles of an attention op, None for any other node."""
    return ATTENTION_INPUT_ROLES.get(((node.domain if node.domain != "ai.onnx" else ""), node.op_type))


def _attention_op(node: onnx.NodeProto, kernel: str, name: str | None = None) -> AttentionOpInfo:
    inputs = {role: value for role, value in zip(_roles(node), node.input, strict=False) if value}
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return AttentionOpInfo(_op_label(node), node.name if name is None else name, inputs, attributes, kernel)


def _kernel(node: onnx.NodeProto) -> str:
    """Which ORT CPU kernel runs the attention op ``node`` on its own (ORT 1.31, DESIGN "Attention kernels")."""
    info = _attention_op(node, "")
    causal = bool(info.attributes.get("unidirectional", 0) or info.attributes.get("is_causal", 0))
    if node.op_type == "GroupQueryAttention":
        return "GroupQueryAttention (causal)"
    if node.op_type == "MultiHeadAttention":
        labels = {"attention_bias": _bias_label(node)}
        reasons = [labels.get(role, role) for role in _MHA_NON_FLASH_INPUTS if role in info.inputs]
        reasons += ["causal"] if causal else []
        if not reasons:
            return "MultiHeadAttention (flash)"
        return f"MultiHeadAttention ({', '.join(reasons)}: materialises [batch, heads, q, kv])"
    parts = ["causal"] if causal else []
    parts += [role for role in ("mask_index", "attention_bias", "attn_mask") if role in info.inputs]
    if node.domain in ("", "ai.onnx"):
        if len([o for o in node.output if o]) > 1:
            parts.append("returns probabilities")
        return f"Attention (ONNX standard{': ' + ', '.join(parts) if parts else ''})"
    return f"Attention (packed QKV{': ' + ', '.join(parts) if parts else ''})"


def _bias_label(node: onnx.NodeProto) -> str:
    """What an attention op's attention_bias is: a bias the fusion read as one, relative score terms with the mask,
    a window mask no kernel takes, or a mask it could not read."""
    tag = next((p.value for p in node.metadata_props if p.key == BIAS_PROP), None)
    return _BIAS_LABELS.get(tag, MASK_NOT_RECOGNISED)


def _branches(node: onnx.NodeProto) -> dict[str, onnx.GraphProto]:
    return {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}


def _branch_attention(node: onnx.NodeProto, branch: str) -> onnx.NodeProto | None:
    """The one attention op an If branch consists of (Constants aside), else None."""
    graph = _branches(node).get(branch)
    nodes = [n for n in graph.node if n.op_type != "Constant"] if graph is not None else []
    return nodes[0] if len(nodes) == 1 and _roles(nodes[0]) is not None else None


def _tagged(node: onnx.NodeProto, kernel: str, initializers) -> AttentionOpInfo | None:
    """An If a fusion rule built and tagged with its kernel (``onnx_nodes.KERNEL_PROP``), reported as one attention:
    the op of its branches given the most inputs (its mask), under the If's name."""
    if LONG_KERNEL in kernel:  # short_sequence: its long branch is reported as it is, its kernel put in place
        long = attention_ops(list(_branches(node)["else_branch"].node), initializers)
        if len(long) != 1:
            return None
        (info,) = long
        info.name, info.kernel = node.name, kernel.replace(LONG_KERNEL, info.kernel)
        return info
    ops = [n for graph in _branches(node).values() for n in all_nodes(graph) if _roles(n) is not None]
    if not ops:
        return None
    return _attention_op(max(ops, key=lambda n: len([name for name in n.input if name])), kernel, node.name)


def attention_ops(
    nodes: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto] | None = None
) -> list[AttentionOpInfo]:
    """One entry per attention among ``nodes`` (one graph's, whose ``initializers`` and those of the graphs
    enclosing it are given): fused ops, and Ifs choosing between two of them."""
    initializers = initializers or {}
    found = []
    for node in nodes:
        if _roles(node) is not None:
            found.append(_attention_op(node, _kernel(node)))
        elif node.op_type == "If" and node.domain in ("", "ai.onnx"):
            kernel = kernel_tag(node)
            if kernel is not None and (tagged := _tagged(node, kernel, initializers)) is not None:
                found.append(tagged)
                continue
            branches = [_branch_attention(node, name) for name in ("then_branch", "else_branch")]
            if None in branches or branches[0].op_type != branches[1].op_type:
                # A KV-cache model's If(prefill, decode): whole graphs, each reported as its own.
                for graph in _branches(node).values():
                    found += attention_ops(list(graph.node), {**initializers, **{t.name: t for t in graph.initializer}})
                continue
            # Two copies of one op otherwise: report the one given more inputs (its mask).
            plain, masked = sorted(branches, key=lambda n: len([name for name in n.input if name]))
            kernels = dict.fromkeys((_kernel(plain), _kernel(masked)))
            found.append(_attention_op(masked, " or ".join(kernels), node.name))
    return found


def load_model_file(path: str | os.PathLike) -> onnx.ModelProto:
    """The ONNX file at ``path``, its weights' bytes not read (``session_file.read_graph``: names, types, shapes
    and small constants are what the report and the metadata readers use); ``ModelFileError`` if there is none."""
    # Imported here: mha_deploy.runtime's package loads onnxruntime, which importing this module should not.
    from mha_deploy.runtime.session_file import read_graph

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        model = read_graph(path)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ModelFileError(f"{path}: not a readable ONNX model ({exc})") from exc
    if not model.graph.node and not model.graph.input:
        raise ModelFileError(f"{path}: not a readable ONNX model (empty graph)")
    return model


def read_metadata(path: str | os.PathLike) -> ModelMetadata:
    """What an exported file says about itself (d_model, heads, Signature...), without running it."""
    model = load_model_file(path)
    return ModelMetadata.from_props({p.key: p.value for p in model.metadata_props}, str(path))


def describe_model(path: str | os.PathLike) -> ModelReport:
    path = Path(path)
    model = load_model_file(path)
    nodes = list(model.graph.node)
    attention = attention_ops(nodes, {t.name: t for t in model.graph.initializer})
    for function in model.functions:
        nodes.extend(function.node)
        attention += attention_ops(list(function.node))
    props = {p.key: p.value for p in model.metadata_props}
    metadata = None
    if METADATA_KEY in props:
        metadata = ModelMetadata.from_json(props[METADATA_KEY], str(path))
    pair = EncoderDecoderRecord.from_json(props[ENCODER_DECODER_KEY], str(path)) if ENCODER_DECODER_KEY in props \
        else None
    spanning = set(metadata.signature.batch_outputs) if metadata else set()
    return ModelReport(
        path=str(path),
        size_bytes=path.stat().st_size,
        ir_version=model.ir_version,
        opsets={(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        inputs=[_tensor_info(v) for v in model.graph.input],
        outputs=[replace(_tensor_info(v), spans_batch=v.name in spanning) for v in model.graph.output],
        op_counts=dict(Counter(_op_label(n) for n in nodes).most_common()),
        attention_ops=attention,
        packing=packing_tags(model.graph),
        metadata=_metadata_dict(metadata) if metadata else None,
        token_tables={spec.name: vocabulary(model, spec.name) for spec in metadata.signature.custom_inputs
                      if spec.role in ID_ROLES} if metadata else {},
        encoder_decoder=pair.to_dict() if pair is not None else None,
    )


def _metadata_dict(metadata: ModelMetadata) -> dict:
    """The metadata as a dict, its generation ids as recorded (``GenerationIds.to_dict``: unset ones left out)."""
    raw = asdict(metadata)
    if metadata.generation is not None:
        raw["generation"] = metadata.generation.to_dict()
    return raw
