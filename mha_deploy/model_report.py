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
    ("com.microsoft", "Attention"): ("input", "weights", "bias", "mask_index", "past", "attention_bias"),
    ("", "Attention"): ("Q", "K", "V", "attn_mask", "past_key", "past_value"),
}


@dataclass
class TensorInfo:
    name: str
    dtype: str
    dims: list[str | int]


@dataclass
class AttentionOpInfo:
    op: str
    name: str
    inputs: dict[str, str]  # role -> tensor name, for the inputs the op is given
    attributes: dict[str, object]


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


def _attention_op(node: onnx.NodeProto) -> AttentionOpInfo:
    roles = ATTENTION_INPUT_ROLES[(node.domain, node.op_type)]
    inputs = {role: name for role, name in zip(roles, node.input, strict=False) if name}
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return AttentionOpInfo(_op_label(node), node.name, inputs, attributes)


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
    for function in model.functions:
        nodes.extend(function.node)
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
        attention_ops=[_attention_op(n) for n in nodes if (n.domain, n.op_type) in ATTENTION_INPUT_ROLES],
        metadata=asdict(metadata) if metadata else None,
    )
