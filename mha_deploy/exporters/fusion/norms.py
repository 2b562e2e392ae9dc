"""``fuse_norms``: every RMSNorm -> one op, and one fed by a residual Add -> one op that also returns the sum.

A Llama-style decoder (Llama, Qwen2, Mistral, Gemma, a hand-written ``x * rsqrt(mean(x^2) + eps) * w``)
exports each RMSNorm as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul/Mul (with Casts around it where the module
computes in fp32 for a lower-precision input), 2 per layer and 1 at the end. onnxruntime-genai's model builder
writes them as ``SimplifiedLayerNormalization`` and, where a residual Add feeds the norm,
``com.microsoft.SkipSimplifiedLayerNormalization`` whose fourth output is that sum (the next residual reads it).
This pass writes the same, with onnxscript's rules (``ort_fusions.rms_normalization``,
``ort_fusions.skip_normalization``) and the conditions they lack:

- the scale must be a constant of the normalised width (a rank-1 [d] weight): the op takes one scale per
  feature; a scale computed from the activations (a modulation, [batch, seq, d]) is left as it is;
- Gemma's ``x_normed * (1 + weight)``: its scale is folded to one constant here where the export's optimizer
  left the Add (it folds it up to 8192 elements, which covers today's models);
- the skip op's input, skip, gamma and bias must share one type (its ``T``; SimplifiedLayerNormalization alone
  may mix them, as the Cast-to-fp32 forms need);
- a ReduceMean that leaves keepdims and noop_with_empty_axes at their defaults (other exporters than torch's):
  upstream's pattern wants them written;
- the ``RMSNormalization`` that torch's exporter writes itself at opset 23 (onnxscript's optimizer fuses the
  written-out norm into it) is the same op: on the mha target it becomes ``SimplifiedLayerNormalization``, so
  that its residual Add joins it.

Why ``SimplifiedLayerNormalization`` and not ONNX's ``RMSNormalization`` (opset 23): the default export is
opset 22, the skip form exists only as a contrib op, and ORT 1.31 runs ``RMSNormalization`` as a function
expanded into the elementwise ops (it fails on a scale of another type than the input). For the ``onnx`` target
(runtimes without contrib ops, opset >= 23) the norms become ``RMSNormalization`` instead, only where input and
scale share a type, and no skip op is written.

Measured (ORT 1.31 CPU, 1 thread, ORT's profiler, the Llama of issue 37: hidden 512, 6 layers, 32k vocabulary;
one decode step over 191 cached positions, host shared): the 13 norms and their residual Adds take 103 kernels and
1.4-1.6 ms per step at batch 1 (1.8-2.5 ms at batch 16); fused, 13 kernels and 0.4 ms (0.8-1.1 ms). Whole steps
and generate calls moved by less than that host's noise (±5-30%) either way.

Run after the attention fusion, so that the attention patterns see the graph as torch wrote it (a Qwen3-style
q/k norm sits inside the attention's subgraph); epsilon is read from the graph's Add, never assumed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.rms_normalization import RmsNormFusion
from onnxscript.rewriter.ort_fusions.skip_normalization import SkipRmsNormFusion

from mha_deploy.exporters.fusion.constant_values import constant_array

SIMPLIFIED = "SimplifiedLayerNormalization"  # in the default domain: ORT registered it there
SKIP_SIMPLIFIED = "SkipSimplifiedLayerNormalization"  # com.microsoft
RMS_NORMALIZATION = "RMSNormalization"  # ONNX, opset 23
MIN_RMS_NORMALIZATION_OPSET = 23


def _scale_array(scale: ir.Value) -> np.ndarray | None:
    """The scale's numbers: a constant, or the sum of two constants (Gemma's ``1 + weight`` left unfolded)."""
    array = constant_array(scale)
    if array is not None:
        return array
    producer = scale.producer()
    if producer is None or producer.op_type != "Add" or producer.domain not in ("", "ai.onnx"):
        return None
    left, right = (constant_array(value) for value in producer.inputs)
    if left is None or right is None:
        return None
    total = left + right
    # the sum as the graph would compute it: numpy's promotion of a float scalar is not ONNX's
    return total.astype(scale.dtype.numpy()) if scale.dtype is not None else None


class _RmsNorm(RmsNormFusion):
    """Upstream's pattern and rewrite; the check adds what the op's scale must be, and with ``one_type`` (the onnx
    target, whose RMSNormalization ORT runs only then) that input and scale share a type."""

    def __init__(self, name: str, _mul_order: bool, one_type: bool = False):
        super().__init__(name, _mul_order)
        self._one_type = one_type

    def check(self, op, x, scale, epsilon, compute_dtype, target_dtype, **rest) -> pattern.MatchResult:
        result = super().check(op, x, scale, epsilon, compute_dtype, target_dtype, **rest)
        if not result:
            return result
        if self._one_type and x.dtype != scale.dtype:
            return result.fail("input and scale are of different types (ORT's RMSNormalization takes one)", scale)
        array = _scale_array(scale)
        if array is None:
            return result.fail("the scale is not a constant (the op takes one weight per feature)", scale)
        width = x.shape[-1] if x.shape is not None and x.shape.rank() else None
        if array.ndim != 1 or (isinstance(width, int) and array.shape[0] != width):
            return result.fail(
                f"the scale's shape {list(array.shape)} is not the normalised width [{width}] (a rank-1 weight)", scale)
        return result

    def rewrite(self, op, x, scale, epsilon, **rest):
        if constant_array(scale) is None:  # Gemma's 1 + weight: one constant
            scale = op.Constant(value=ir.tensor(_scale_array(scale)))
        return super().rewrite(op, x, scale, epsilon, **rest)


class _SkipRmsNorm(SkipRmsNormFusion):
    """Upstream's pattern, check (shapes [batch, seq, d], [d]) and rewrite; the check adds one type for all."""

    def check(self, op, input, skip, gamma, bias, simplified_layer_norm, **rest) -> pattern.MatchResult:
        result = super().check(op, input, skip, gamma, bias, simplified_layer_norm, **rest)
        if not result:
            return result
        values = [input, skip, gamma, *([bias] if self._has_bias else [])]
        if len({value.dtype for value in values}) != 1:
            return result.fail("input, skip and scale are of different types (the skip op takes one)", gamma)
        return result


rms_norm_rules = pattern.RewriteRuleSet([
    _RmsNorm.rule("RmsNorm (scale first)", _mul_order=False),
    _RmsNorm.rule("RmsNorm (scale last)", _mul_order=True),
])
_one_type_rms_norm_rules = pattern.RewriteRuleSet([
    _RmsNorm.rule("RmsNorm (scale first, one type)", _mul_order=False, one_type=True),
    _RmsNorm.rule("RmsNorm (scale last, one type)", _mul_order=True, one_type=True),
])
# Upstream's order: a bias added before the residual, after it, none.
skip_rms_norm_rules = pattern.RewriteRuleSet([
    _SkipRmsNorm.rule("SkipRmsNorm (bias first)", has_bias=True, bias_pre_add=True),
    _SkipRmsNorm.rule("SkipRmsNorm (bias after)", has_bias=True, bias_pre_add=False),
    _SkipRmsNorm.rule("SkipRmsNorm", has_bias=False),
])


def fuse_norms(model: ir.Model, target: str = "mha") -> dict[str, int]:
    """Fuse every RMSNorm of ``model`` in place; the count per rule: ``rms_norm`` (norms written out, fused),
    ``rms_normalization`` (ONNX RMSNormalization ops turned into SimplifiedLayerNormalization for ``mha``, the
    other way round for ``onnx``), ``skip_rms_norm`` (norms that took their residual Add, mha target)."""
    _spell_out_reduce_mean_defaults(model)
    if target != "mha" and model.opset_imports.get("", 0) < MIN_RMS_NORMALIZATION_OPSET:
        return {"rms_norm": 0}  # no standard op to write, and the target is for runtimes without ORT's
    counts = {"rms_norm": (rms_norm_rules if target == "mha" else _one_type_rms_norm_rules).apply_to_model(model)}
    if target == "mha":
        # torch's exporter writes RMSNormalization itself at opset 23 (onnxscript's optimizer fuses the written-out
        # norm into it): the same op for ORT's kernel, so that the residual Add can join it too.
        counts["rms_normalization"] = _rename(model, RMS_NORMALIZATION, SIMPLIFIED)
        counts["skip_rms_norm"] = skip_rms_norm_rules.apply_to_model(model)
        # The skip op replaces the residual Add where the norm ended: a reader of the sum placed between the
        # two would now come before its producer.
        model.graph.sort()
    else:
        counts["rms_normalization"] = _rename(model, SIMPLIFIED, RMS_NORMALIZATION)
    if counts["rms_norm"]:
        common_passes.RemoveUnusedNodesPass()(model)  # a Gemma scale's Add, folded into the op's constant
    return counts


def _spell_out_reduce_mean_defaults(model: ir.Model) -> None:
    """Upstream's pattern matches a ReduceMean whose keepdims and noop_with_empty_axes are written; torch writes
    them, other exporters leave them at their defaults (1 and 0). Written out, the node means the same."""
    for node in model.graph.all_nodes():
        if node.op_type == "ReduceMean" and node.domain in ("", "ai.onnx"):
            for name, default in (("keepdims", 1), ("noop_with_empty_axes", 0)):
                if name not in node.attributes:
                    node.attributes[name] = ir.AttrInt64(name, default)


def _rename(model: ir.Model, op_from: str, op_to: str) -> int:
    """``op_from`` nodes as ``op_to``: RMSNormalization and SimplifiedLayerNormalization share inputs, attributes
    (axis, epsilon, stash_type, the same defaults) and numbers. Only where input and scale share a type: ORT 1.31
    runs RMSNormalization as a function that needs one."""
    count = 0
    for node in model.graph.all_nodes():
        if (node.op_type == op_from and node.domain in ("", "ai.onnx") and len(node.outputs) == 1
                and node.inputs[0].dtype == node.inputs[1].dtype):
            node.op_type = op_to
            count += 1
    return count


def norm_ops(nodes) -> dict[str, int]:
    """How many of each fused norm op ``nodes`` (onnx NodeProtos) hold, by ``domain.Op`` name in name order, e.g.
    ``{"SimplifiedLayerNormalization": 1, "com.microsoft.SkipSimplifiedLayerNormalization": 4}``."""
    counts: dict[str, int] = {}
    for node in nodes:
        if node.op_type in (SIMPLIFIED, SKIP_SIMPLIFIED, RMS_NORMALIZATION):
            name = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
