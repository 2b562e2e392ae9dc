"""``fuse_attention``: every reference-MHA subgraph of a model -> one attention op.

The chain, per target (own rules marked *, the rest is upstream
``onnxscript.rewriter.ort_fusions``):

    * masked_fill_bias        Where-masked scores -> additive bias, so upstream matches
      sdpa                    MatMul/scale/(Add mask)/Softmax/MatMul -> SDPA (private op)
      mha                     SDPA + head split/merge -> com.microsoft.MultiHeadAttention
    mha:
    * projection_shape        keeps upstream's mask Expand from blocking the bias fusion
      mha_bias                fold q/k/v projection biases into the op
      attention (packed_qkv)  self-attention MHA -> com.microsoft.Attention (packed weights)
    * native_mask             float bias -> key_padding_mask / mask_index + unidirectional
    onnx:
    * onnx_attention          MHA -> standard Attention (attn_mask bool, is_causal)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter.ort_fusions.attention import fuse_attention as fuse_packed_attention
from onnxscript.rewriter.ort_fusions.mha import fuse_mha2
from onnxscript.rewriter.ort_fusions.mha_bias import fuse_mha_bias
from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa
from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha

from mha_deploy.errors import ExportError
from mha_deploy.exporters.fusion.masked_fill_bias import fuse_masked_fill_bias
from mha_deploy.exporters.fusion.native_mask import fuse_native_mask
from mha_deploy.exporters.fusion.onnx_attention import fuse_onnx_attention
from mha_deploy.exporters.fusion.onnx_attention_weights import fuse_onnx_attention_weights
from mha_deploy.exporters.fusion.projection_shape import fuse_projection_shape
from mha_deploy.model_report import ATTENTION_INPUT_ROLES

FUSION_TARGETS = ("mha", "onnx", "none")
# ORT 1.31 rejects IR version 14; 10 is what it accepts for opset 23.
MAX_IR_VERSION = 10
MIN_ONNX_ATTENTION_OPSET = 23
_FUSION_DOMAIN = "ai.onnxruntime._fusion"
# The mask inputs worth reporting; the ops a fusion produces and their input
# roles are the ones `mha-deploy inspect` knows (model_report).
_MASK_ROLES = {"key_padding_mask", "attention_bias", "mask_index", "attn_mask"}
# Ops that sit between the scores MatMul and the Softmax in an attention subgraph.
_SCORE_OPS = {"Add", "Sub", "Mul", "Div", "Where", "Cast"}


@dataclass
class FusedOp:
    """One attention op in the fused model."""

    op_type: str  # "com.microsoft.MultiHeadAttention", "Attention", ...
    name: str
    # Which mask inputs the op reads (input role -> tensor name); empty when unmasked.
    mask_inputs: dict[str, str] = field(default_factory=dict)
    attributes: dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        """One line, e.g. ``com.microsoft.MultiHeadAttention(key_padding_mask; num_heads=8, unidirectional=1)``."""
        attributes = ", ".join(
            f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in sorted(self.attributes.items())
        )
        masks = ", ".join(self.mask_inputs) or "no mask"
        return f"{self.op_type}({masks}; {attributes})"


@dataclass
class FusionReport:
    """What ``fuse_attention`` found and did."""

    target: str
    found: int  # attention subgraphs (Softmax over MatMul scores) in the input model
    remaining: int  # attention Softmaxes still in the output model (unfused subgraphs)
    ops: list[FusedOp] = field(default_factory=list)
    rule_counts: dict[str, int] = field(default_factory=dict)

    @property
    def fused(self) -> int:
        return len(self.ops)

    @property
    def complete(self) -> bool:
        """True when every attention subgraph became one attention op (or the target is "none")."""
        return self.target == "none" or (self.remaining == 0 and self.fused == self.found)

    def summary(self) -> str:
        kinds = sorted({op.op_type for op in self.ops})
        return (
            f"fusion {self.target}: {self.found} attention subgraph(s) found, {self.fused} fused"
            f"{' into ' + ', '.join(kinds) if kinds else ''}, {self.remaining} left unfused"
        )


def _producer_type(value: ir.Value | None) -> str | None:
    node = value.producer() if value is not None else None
    return node.op_type if node is not None else None


def _is_attention_softmax(node: ir.Node) -> bool:
    """A Softmax over MatMul scores whose probabilities feed a MatMul: the heart of an attention."""
    if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return False
    value = node.inputs[0]
    for _ in range(6):
        op_type = _producer_type(value)
        if op_type == "MatMul":
            break
        if op_type not in _SCORE_OPS:
            return False
        # Walk towards the scores: the operand that is not a constant/mask.
        producer = value.producer()
        value = producer.inputs[2] if op_type == "Where" else producer.inputs[0]
    else:
        return False
    consumers = [use.node for use in node.outputs[0].uses()]
    return any(c.op_type == "MatMul" for c in consumers) or any(
        c.op_type == "Where" and any(u.node.op_type == "MatMul" for u in c.outputs[0].uses()) for c in consumers
    )


def attention_softmaxes(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph.all_nodes() if _is_attention_softmax(node)]


def _fused_ops(model: ir.Model) -> list[FusedOp]:
    ops = []
    for node in model.graph.all_nodes():
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        if key not in ATTENTION_INPUT_ROLES:
            continue
        masks = {
            role: value.name
            for role, value in zip(ATTENTION_INPUT_ROLES[key], node.inputs, strict=False)
            if role in _MASK_ROLES and value is not None
        }
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        attributes = {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}
        op_type = f"{key[0]}.{key[1]}" if key[0] else key[1]
        ops.append(FusedOp(op_type, node.name or "", masks, attributes))
    return ops


def _check_weights_supported(model: ir.Model, target: str) -> None:
    if target == "onnx":  # standard Attention outputs them (onnx_attention_weights)
        return
    outputs = set(model.graph.outputs)
    for node in attention_softmaxes(model):
        if node.outputs[0] in outputs:
            raise ExportError(
                f"the model returns attention weights ({node.outputs[0].name}), which the fused "
                f"{target!r} attention ops cannot output (com.microsoft.MultiHeadAttention/Attention have "
                "no softmax-probabilities output); use --fuse onnx or --fuse none, or drop --return-weights"
            )


def _run_chain(model: ir.Model, target: str, packed_qkv: bool) -> dict[str, int]:
    counts = {}
    counts["masked_fill_bias"] = fuse_masked_fill_bias(model, apply_shape_inference=True)
    if target == "onnx":
        counts["onnx_attention_weights"] = fuse_onnx_attention_weights(model)
    counts["sdpa"] = fuse_sdpa(model, apply_shape_inference=True)
    counts["mha"] = fuse_mha2(model)
    if target == "mha":
        counts["projection_shape"] = fuse_projection_shape(model)
        common_passes.RemoveUnusedNodesPass()(model)
        counts["mha_bias"] = fuse_mha_bias(model)
        if packed_qkv:
            common_passes.RemoveUnusedNodesPass()(model)
            counts["packed_attention"] = fuse_packed_attention(model)
    # An SDPA that the head split/merge patterns missed still becomes an MHA.
    counts["sdpa_via_mha"] = replace_sdpa_by_mha(model)
    if target == "mha":
        counts["native_mask"] = fuse_native_mask(model)
    else:
        counts["onnx_attention"] = fuse_onnx_attention(model)
    _omit_unused_present_outputs(model)
    # Layers of a stack build identical masks (Cast/Expand of one padding input): share them.
    common_passes.CommonSubexpressionEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    return counts


def _omit_unused_present_outputs(model: ir.Model) -> None:
    """An Attention emitted for its weights output also has present_key/value outputs: mark them omitted."""
    for node in model.graph.all_nodes():
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and len(node.outputs) == 4:
            for value in node.outputs[1:3]:
                if not value.uses() and value not in model.graph.outputs:
                    value.name = ""


def _finish_opsets(model: ir.Model, original: set[str]) -> None:
    """Drop opset imports the chain added but no remaining node uses; add com.microsoft if used."""
    domains = {node.domain for node in model.graph.all_nodes()}
    for domain in list(model.opset_imports):
        if domain not in original and domain not in domains:
            del model.opset_imports[domain]
    if "com.microsoft" in domains:
        model.opset_imports.setdefault("com.microsoft", 1)


def fuse_attention(
    model: onnx.ModelProto, target: str, *, packed_qkv: bool = False
) -> tuple[onnx.ModelProto, FusionReport]:
    """Fuse every reference-MHA subgraph of ``model`` into one attention op of ``target``.

    ``target``: "mha" (ORT contrib ``MultiHeadAttention``; with ``packed_qkv``,
    self-attention becomes contrib ``Attention``), "onnx" (standard ``Attention``,
    opset >= 23) or "none" (model returned unchanged). The input model is not
    modified. Inputs, outputs, metadata_props and an IR version ORT accepts are kept.
    A subgraph that no rule matched stays as it was: check ``report.complete``.

    ``packed_qkv`` is off by default: on ORT 1.31 CPU fp32 (benchmarks/fusion.py,
    d_model 512, 8 heads, 2 threads) packed ``Attention`` was within about 10% of
    ``MultiHeadAttention`` either way at (8,128), (32,64), (1,1024) and 5-12%
    slower at (1,4096): not measurably faster.
    """
    if target not in FUSION_TARGETS:
        raise ExportError(f"fusion target must be one of {', '.join(FUSION_TARGETS)}, got {target!r}")
    ir_model = ir.serde.deserialize_model(model)
    found = len(attention_softmaxes(ir_model))
    if target == "none" or found == 0:
        return model, FusionReport(target, found, remaining=found)
    if target == "onnx" and ir_model.opset_imports.get("", 0) < MIN_ONNX_ATTENTION_OPSET:
        raise ExportError(
            f"--fuse onnx needs opset >= {MIN_ONNX_ATTENTION_OPSET} (standard Attention), the model has "
            f"{ir_model.opset_imports.get('', 0)}; export with a newer opset or use --fuse mha"
        )
    _check_weights_supported(ir_model, target)
    original_domains = set(ir_model.opset_imports)
    counts = _run_chain(ir_model, target, packed_qkv)
    _finish_opsets(ir_model, original_domains)
    report = FusionReport(target, found, len(attention_softmaxes(ir_model)), _fused_ops(ir_model), counts)
    fused = ir.serde.serialize_model(ir_model)
    fused.ir_version = min(model.ir_version, MAX_IR_VERSION)
    _check_interface_kept(model, fused)
    # The rewriter merges the shapes it infers for new values into the graph
    # outputs they replace (an Attention's weights output came back as
    # [batch, 4, seq, 0]): the declared interface is the export's, restore it.
    del fused.graph.output[:]
    fused.graph.output.extend(model.graph.output)
    return fused, report


def _check_interface_kept(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    def interface(m):
        return (
            [i.name for i in m.graph.input],
            [o.name for o in m.graph.output],
            sorted((p.key, p.value) for p in m.metadata_props),
        )

    if interface(before) != interface(after):
        raise ExportError(
            "attention fusion changed the model's inputs, outputs or metadata; this is a bug in "
            "mha_deploy.exporters.fusion, export with --fuse none meanwhile"
        )
