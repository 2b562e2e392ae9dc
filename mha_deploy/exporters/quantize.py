"""Dynamic int8 quantization of the projections, attention kept fused."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

from mha_deploy.errors import ExportError
from mha_deploy.onnx_nodes import KERNEL_PROP, all_nodes

# Where ORT's dynamic-quantized MatMul kernels run (MatMulInteger /
# DynamicQuantizeMatMul have CPU kernels only in ORT 1.31).
INT8_PROVIDERS = ("cpu",)


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Keep onnxruntime.quantization's advice out of the output.

    It logs "Please consider to run pre-processing before quantization" through
    the root logger (``logging.warning``), which also installs a stderr handler
    on the root logger for good when it has none. The advice does not apply
    (the exporter's graph is already shape-inferred and optimized), so its
    records are dropped and a handler-less root logger gets a NullHandler while
    the quantizer runs. Errors still raise.
    """
    root = logging.getLogger()

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname

    placeholder = logging.NullHandler() if not root.handlers else None
    if placeholder is not None:
        root.addHandler(placeholder)
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)
        if placeholder is not None:
            root.removeHandler(placeholder)


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
            with _quiet_quantizer():
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
    _keep_kernel_tags(model, quantized)
    return quantized


def _keep_kernel_tags(model: onnx.ModelProto, quantized: onnx.ModelProto) -> None:
    """The fusion rules' kernel tags, put back on the nodes the quantizer rebuilt without them (the Ifs whose
    branches it quantized), found by their first output, a name unique in the model."""
    tags = {
        node.output[0]: prop.value
        for node in all_nodes(model.graph)
        for prop in node.metadata_props
        if prop.key == KERNEL_PROP and node.output
    }
    for node in all_nodes(quantized.graph):
        if node.output and node.output[0] in tags and not any(p.key == KERNEL_PROP for p in node.metadata_props):
            node.metadata_props.add(key=KERNEL_PROP, value=tags[node.output[0]])
