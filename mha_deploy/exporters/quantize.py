"""Dynamic int8 quantization of the projections, attention kept fused."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from mha_deploy.errors import ExportError

# Where ORT's dynamic-quantized MatMul kernels run (MatMulInteger /
# DynamicQuantizeMatMul have CPU kernels only in ORT 1.31).
INT8_PROVIDERS = ("cpu",)


def quantize_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Quantize every MatMul with a constant weight to int8 (weights per tensor, activations per call).

    The attention op itself stays float: its QK^T and softmax are where int8
    would cost the most accuracy for the least time.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp, "fp32.onnx"), Path(tmp, "int8.onnx")
        # Without the fusion's intermediate shapes: the quantizer re-infers them, and a shape the rewriter left
        # on a value it replaced (seen on users' models: a classifier head's) fails that inference.
        model = onnx.ModelProto.FromString(model.SerializeToString())
        del model.graph.value_info[:]
        onnx.save_model(model, source)
        try:
            quantize_dynamic(
                # per_channel and reduce_range were measured: no better (or worse) accuracy here.
                source, target, weight_type=QuantType.QInt8, per_channel=False, op_types_to_quantize=["MatMul"]
            )
        except Exception as exc:  # the quantizer raises bare Exceptions and assertion errors
            raise ExportError(f"int8 quantization failed: {type(exc).__name__}: {exc}") from exc
        quantized = onnx.load_model(target)
    quantized.ir_version = min(quantized.ir_version, model.ir_version)
    # The quantizer records its own shape-inference flag; keep only what the exporter wrote.
    keep = {p.key: p.value for p in model.metadata_props}
    del quantized.metadata_props[:]
    for key, value in keep.items():
        quantized.metadata_props.add(key=key, value=value)
    return quantized
