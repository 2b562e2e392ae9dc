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
# What the fusion's padding_flash rule builds: If(any key padded) masked op else mask-free op.
PADDING_FLASH_KERNEL = "MultiHeadAttention (flash when no key is padded, else masked)"


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
    # e.g. "GroupQueryAttention (causal)", "MultiHeadAttention (flash when no key is padded, else masked)"
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
        # causal_gqa moves real tokens to the front (GatherND) so that seqlens_k can describe any padding.
        if query is not None and query.op_type == "GatherND":
            return "GroupQueryAttention (causal, padded tokens compacted out: any padding side)"
        return "GroupQueryAttention (causal)"
    if node.op_type == "MultiHeadAttention":
        reasons = [role for role in _MHA_NON_FLASH_INPUTS if role in info.inputs] + (["causal"] if causal else [])
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


def attention_ops(nodes: list[onnx.NodeProto]) -> list[AttentionOpInfo]:
    """One entry per attention among ``nodes`` (one graph's): fused ops, and Ifs choosing between two of them."""
    producers = {output: node for node in nodes for output in node.output if output}
    found = []
    for node in nodes:
        if _roles(node) is not None:
            found.append(_attention_op(node, _kernel(node, producers)))
        elif node.op_type == "If" and node.domain in ("", "ai.onnx"):
            branches = [_branch_attention(node, name) for name in ("then_branch", "else_branch")]
            if None in branches or branches[0].op_type != branches[1].op_type:
                # A KV-cache model's If(prefill, decode): whole graphs, each reported as its own.
                for attribute in node.attribute:
                    if attribute.type == onnx.AttributeProto.GRAPH:
                        found.extend(attention_ops(list(attribute.g.node)))
                continue
            # Report the op as it runs with its mask: the branch given more inputs.
            flash, masked = sorted(branches, key=lambda n: len([name for name in n.input if name]))
            kernels = (_kernel(flash, {}), _kernel(masked, {}))
            padding_flash = kernels[0] == "MultiHeadAttention (flash)" and "key_padding_mask" in kernels[1]
            kernel = PADDING_FLASH_KERNEL if padding_flash else " or ".join(kernels)
            found.append(_attention_op(masked, kernel, node.name))
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
    attention = attention_ops(nodes)
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
