"""What an ONNX file contains, for ``mha-deploy inspect``: needs onnx, not torch."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from mha_deploy.errors import ModelFileError
from mha_deploy.metadata import METADATA_KEY, ModelMetadata

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
_MHA_INPUT_LABELS = {"attention_bias": MASK_NOT_RECOGNISED}
# What the fusion's padding_flash rule builds: If(any key padded) keys cut to the longest row's real ones,
# then the op mask-free if every row fills the cut, else masked; else the op mask-free.
PADDING_FLASH_KERNEL = (
    "MultiHeadAttention (flash when no key is padded or every row has as many real keys, "
    "else masked over the longest row's real keys)"
)
# What the causal_gqa rule builds: If(score bytes <= N) GQA without present outputs (ORT's CPU kernel
# then materialises [batch, heads, q, kv]) else GQA with them (its tiled path). N read from the graph.
GQA_BY_SIZE = "scores materialised up to {} MB, tiled beyond"
_GQA_CAUSAL = "GroupQueryAttention (causal{})"
# What the short_sequence rule builds: If(kv_len <= N and score bytes <= M) standard Attention (ORT's CPU
# kernel materialises [batch, heads, q, kv]) else MultiHeadAttention (flash, or padding_flash's If when masked);
# N and M read from the graph.
SHORT_SEQUENCE = "; up to {} keys and {} MB of scores the standard Attention op (materialising)"
# causal_gqa moves real tokens to the front (GatherND) so that seqlens_k can describe any padding.
_GQA_COMPACTED = ", padded tokens compacted out: any padding side"


@dataclass
class TensorInfo:
    name: str
    dtype: str
    dims: list[str | int]


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
    metadata: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def all_nodes(graph: onnx.GraphProto):
    """Every node of ``graph``, including those in its subgraphs (the branches of the fusions' Ifs)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from all_nodes(subgraph)


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


def _kernel(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> str:
    """Which ORT CPU kernel runs the attention op ``node`` (ORT 1.31, DESIGN "Attention kernels")."""
    info = _attention_op(node, "")
    causal = bool(info.attributes.get("unidirectional", 0) or info.attributes.get("is_causal", 0))
    if node.op_type == "GroupQueryAttention":
        query = producers.get(info.inputs.get("query", ""))
        return _GQA_CAUSAL.format(_GQA_COMPACTED if query is not None and query.op_type == "GatherND" else "")
    if node.op_type == "MultiHeadAttention":
        reasons = [_MHA_INPUT_LABELS.get(role, role) for role in _MHA_NON_FLASH_INPUTS if role in info.inputs]
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


def _branch_attention(node: onnx.NodeProto, branch: str) -> onnx.NodeProto | None:
    """The one attention op an If branch consists of (Constants aside), else None."""
    graph = next((a.g for a in node.attribute if a.name == branch), None)
    nodes = [n for n in graph.node if n.op_type != "Constant"] if graph is not None else []
    return nodes[0] if len(nodes) == 1 and _roles(nodes[0]) is not None else None


def _padded_mask(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> str | None:
    """The mask an If asks "is any token padded?" of (Cast(ReduceMax(Cast(Equal(mask, 0)))), the fusions'
    condition), else None."""
    source = producers.get(node.input[0])
    for op_type in ("Cast", "ReduceMax", "Cast"):
        if source is None or source.op_type != op_type:
            return None
        source = producers.get(source.input[0])
    return source.input[0] if source is not None and source.op_type == "Equal" else None


def _padding_cut(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> AttentionOpInfo | None:
    """padding_flash's If, reported as one attention reading the model's mask; None for any other If."""
    mask = _padded_mask(node, producers)
    flash = _branch_attention(node, "else_branch")
    then = next((a.g for a in node.attribute if a.name == "then_branch"), None)
    if mask is None or flash is None or then is None or _kernel(flash, {}) != "MultiHeadAttention (flash)":
        return None
    inner = [n for n in then.node if n.op_type == "If"]
    cut = [_branch_attention(inner[0], name) for name in ("then_branch", "else_branch")] if len(inner) == 1 else []
    if len(cut) != 2 or any(op is None or op.op_type != flash.op_type for op in cut):
        return None
    info = _attention_op(flash, PADDING_FLASH_KERNEL, node.name)
    info.inputs["key_padding_mask"] = mask
    return info


def gqa_by_size_kernel(compacted: bool, max_mb: float | None) -> str:
    """The kernel string of causal_gqa's If: GQA materialising scores up to ``max_mb``, tiled beyond."""
    limit = GQA_BY_SIZE.format(f"{max_mb:g}" if max_mb is not None else "?")
    return _GQA_CAUSAL.format(f"{_GQA_COMPACTED if compacted else ''}; {limit}")


def _constant(name: str, producers: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto]):
    """The value of ``name`` when a Constant node or an initializer holds it, else None."""
    if name in initializers:
        return onnx.numpy_helper.to_array(initializers[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return onnx.numpy_helper.to_array(value) if value is not None else None
    return None


def _at_most(condition: str, producers, initializers) -> float | None:
    """The N of ``LessOrEqual(x, N)`` (the size conditions of causal_gqa's and short_sequence's Ifs) producing
    ``condition``; None if it is not one."""
    node = producers.get(condition)
    if node is None or node.op_type != "LessOrEqual":
        return None
    limit = _constant(node.input[1], producers, initializers)
    return float(limit) if limit is not None and limit.size == 1 else None


def _by_size(branches: list[onnx.NodeProto]) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """(materialising, tiled) when an If's two branches are GroupQueryAttention on the same inputs, one asking
    for present outputs (causal_gqa): else None."""
    if any(b.op_type != "GroupQueryAttention" for b in branches) or branches[0].input != branches[1].input:
        return None
    materialising, tiled = sorted(branches, key=lambda n: len([name for name in n.output if name]))
    asks_presents = len([name for name in tiled.output if name]) > 1
    return (materialising, tiled) if asks_presents and len(materialising.output) == 1 else None


def short_sequence_kernel(long_kernel: str, keys_max: int, scores_max_mb: float) -> str:
    """The kernel string of short_sequence's If: ``long_kernel`` beyond the bounds, standard Attention within."""
    return long_kernel + SHORT_SEQUENCE.format(f"{keys_max:d}", f"{scores_max_mb:g}")


def _short_sequence(node: onnx.NodeProto, producers, initializers) -> AttentionOpInfo | None:
    """short_sequence's If (standard Attention within the bounds, MultiHeadAttention or padding_flash's If
    beyond), reported as the attention of its long branch with both kernels; None for any other If."""
    condition = producers.get(node.input[0])
    if condition is None or condition.op_type != "And":
        return None
    keys, score_bytes = (_at_most(name, producers, initializers) for name in condition.input)
    graphs = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    if keys is None or score_bytes is None or set(graphs) != {"then_branch", "else_branch"}:
        return None
    standard = [n for n in graphs["then_branch"].node if _roles(n) is not None]
    if [(n.domain or "", n.op_type) for n in standard] != [("", "Attention")]:
        return None
    inner = {**initializers, **{t.name: t for t in graphs["else_branch"].initializer}}
    long = attention_ops(list(graphs["else_branch"].node), inner)
    if len(long) != 1:
        return None
    (info,) = long
    info.name = node.name
    info.kernel = short_sequence_kernel(info.kernel, int(keys), score_bytes / 2**20)
    return info


def attention_ops(
    nodes: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto] | None = None
) -> list[AttentionOpInfo]:
    """One entry per attention among ``nodes`` (one graph's, whose ``initializers`` and those of the graphs
    enclosing it are given): fused ops, and Ifs choosing between two of them."""
    initializers = initializers or {}
    producers = {output: node for node in nodes for output in node.output if output}
    found = []
    for node in nodes:
        if _roles(node) is not None:
            found.append(_attention_op(node, _kernel(node, producers)))
        elif node.op_type == "If" and node.domain in ("", "ai.onnx"):
            if (cut := _padding_cut(node, producers)) is not None:
                found.append(cut)
                continue
            if (short := _short_sequence(node, producers, initializers)) is not None:
                found.append(short)
                continue
            branches = [_branch_attention(node, name) for name in ("then_branch", "else_branch")]
            if None in branches or branches[0].op_type != branches[1].op_type:
                inner = [
                    attention_ops(list(a.g.node), {**initializers, **{t.name: t for t in a.g.initializer}})
                    for a in node.attribute
                    if a.type == onnx.AttributeProto.GRAPH
                ]
                if _padded_mask(node, producers) is not None and [len(ops) for ops in inner] == [1, 1]:
                    # causal_gqa's If(any token padded): the op on compacted tokens (then) or as they are.
                    found.append(inner[0][0])
                else:
                    # A KV-cache model's If(prefill, decode): whole graphs, each reported as its own.
                    found.extend(op for ops in inner for op in ops)
                continue
            if (by_size := _by_size(branches)) is not None:
                materialising, _ = by_size
                # The branches read the outer graph's values: its producers say whether q was compacted.
                compacted = "compacted" in _kernel(materialising, producers)
                max_bytes = _at_most(node.input[0], producers, initializers)
                max_mb = max_bytes / 2**20 if max_bytes is not None else None
                found.append(_attention_op(materialising, gqa_by_size_kernel(compacted, max_mb), node.name))
                continue
            # Two copies of one op otherwise: report the one given more inputs (its mask).
            plain, masked = sorted(branches, key=lambda n: len([name for name in n.input if name]))
            kernels = dict.fromkeys((_kernel(plain, {}), _kernel(masked, {})))
            found.append(_attention_op(masked, " or ".join(kernels), node.name))
    return found


def describe_model(path: str | os.PathLike) -> ModelReport:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ModelFileError(f"{path}: not a readable ONNX model ({exc})") from exc
    if not model.graph.node and not model.graph.input:
        raise ModelFileError(f"{path}: not a readable ONNX model (empty graph)")
    nodes = list(model.graph.node)
    attention = attention_ops(nodes, {t.name: t for t in model.graph.initializer})
    for function in model.functions:
        nodes.extend(function.node)
        attention += attention_ops(list(function.node))
    props = {p.key: p.value for p in model.metadata_props}
    metadata = None
    if METADATA_KEY in props:
        metadata = ModelMetadata.from_json(props[METADATA_KEY], str(path))
    return ModelReport(
        path=str(path),
        size_bytes=path.stat().st_size,
        ir_version=model.ir_version,
        opsets={(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        inputs=[_tensor_info(v) for v in model.graph.input],
        outputs=[_tensor_info(v) for v in model.graph.output],
        op_counts=dict(Counter(_op_label(n) for n in nodes).most_common()),
        attention_ops=attention,
        metadata=asdict(metadata) if metadata else None,
    )
