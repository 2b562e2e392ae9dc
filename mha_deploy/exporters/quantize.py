"""Quantization of the weights around the fused attentions, which stay float.

Two kinds. Weight-only (``--quantize int4|int8``): every MatMul with a constant weight becomes contrib
``MatMulNBits`` through ONNX Runtime's own quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``), the
weights stored in blocks of ``block_size`` along K with a scale (and a zero point unless symmetric) per block; at
``accuracy_level`` 4 ORT's CPU kernel quantizes each activation row to int8 per block and runs int8 dot products.
A decoder at batch 1 reads every weight once per token, so its speed follows the weight bytes: int4 reads about
a sixth of fp32's. Dynamic int8 (``--quantize int8-dynamic``): onnxruntime.quantization's dynamic path (weights
int8 per tensor, activations quantized per call), the projections of an encoder's large batches.

Neither claims fp32 parity: the export measures the error against the fp32 torch module (``Quantization.rel_budget``)
and records it with the top-1 agreement of logits outputs.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx

from mha_deploy.errors import ExportError
from mha_deploy.metadata import INT8_DYNAMIC, QUANT_METHODS, QUANTIZE_CHOICES, WEIGHT_ONLY_BITS, WeightOnlyRecord
from mha_deploy.onnx_nodes import all_nodes

# Where ORT's dynamic-quantized MatMul kernels run (MatMulInteger /
# DynamicQuantizeMatMul have CPU kernels only in ORT 1.31).
INT8_PROVIDERS = ("cpu",)
_NBITS_LOGGER = "onnxruntime.quantization.matmul_nbits_quantizer"


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Keep onnxruntime.quantization's advice out of the output.

    It logs "Please consider to run pre-processing before quantization" through
    the root logger (``logging.warning``), which also installs a stderr handler
    on the root logger for good when it has none; the MatMulNBits quantizer logs
    its progress at INFO on its module's logger and calls ``logging.basicConfig(
    level=INFO)`` when imported, which would print every library's INFO records
    from then on. The advice does not apply (the exporter's graph is already
    shape-inferred and optimized), so its records are dropped, and a handler-less
    root logger gets a NullHandler while the quantizer is imported and runs (so
    that basicConfig configures nothing). Errors still raise.
    """
    root = logging.getLogger()
    # A filter on the root logger does not see records logged to a module's logger: each gets its own.
    loggers = [root, logging.getLogger(_NBITS_LOGGER)]

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname

    placeholder = logging.NullHandler() if not root.handlers else None
    if placeholder is not None:
        root.addHandler(placeholder)
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)
        if placeholder is not None:
            root.removeHandler(placeholder)


def quantize_int8_dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
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
                    # reduce_range (7-bit weights): on a CPU without VNNI (AVX2 alone) ORT's uint8 x int8 kernel
                    # adds pairs of products in int16 (vpmaddubsw), which saturates on full-range weights. Measured
                    # on such a host, d_model 64: 14-34% relative error without it, 1.4-2.1% with it; on a VNNI host
                    # both were within the budget. per_channel was measured: no better.
                    source, target, weight_type=QuantType.QInt8, per_channel=False, reduce_range=True,
                    op_types_to_quantize=["MatMul"],
                )
        except Exception as exc:  # the quantizer raises bare Exceptions and assertion errors
            raise ExportError(f"int8-dynamic quantization failed: {type(exc).__name__}: {exc}") from exc
        quantized = onnx.load_model(target)
    quantized.ir_version = min(quantized.ir_version, model.ir_version)
    # The quantizer records its own shape-inference flag; keep only what the exporter wrote.
    keep = {p.key: p.value for p in model.metadata_props}
    del quantized.metadata_props[:]
    for key, value in keep.items():
        quantized.metadata_props.add(key=key, value=value)
    _keep_node_props(model, quantized)
    return quantized


def _keep_node_props(model: onnx.ModelProto, quantized: onnx.ModelProto) -> None:
    """The nodes' metadata (the fusion rules' kernel tags, token packing's record), put back on the nodes the
    quantizers rebuilt without it (the Ifs whose branches they quantized), found by their first output, a name
    unique in the model."""
    props = {node.output[0]: list(node.metadata_props)
             for node in all_nodes(model.graph) if node.output and node.metadata_props}
    for node in all_nodes(quantized.graph):
        if node.output and node.output[0] in props and not node.metadata_props:
            node.metadata_props.extend(props[node.output[0]])


DEFAULT_BLOCK_SIZE = 32
# MatMulNBits' accuracy_level 4: activations quantized to int8 per block, int8 dot products (ORT's fastest CPU
# path, what onnxruntime-genai's builder writes for CPU).
ACCURACY_LEVEL = 4
# ||quantized - fp32 torch|| / ||fp32 torch|| past which the file is refused: a broken quantizer, not rounding.
# Measured on the parity cases (random weights; docs/precision.md): int4 RTN, block 32, 8.4% on the tutorial GPT's
# logits per step (d_model 32, and its d_model 512 bench build alike), 8.9-9.4% on the lone block's output
# (d_model 64 and 512, every fusion target); int8 0.8-0.9%. One projection's scales doubled gives 30%
# (tests/exporters/test_quantize.py). The budgets leave int4 about 3x and int8 about 5x its measured error.
REL_ERR_BUDGETS = {"int4": 0.25, "int8": 0.05, INT8_DYNAMIC: 0.05}
# Dynamic int8 projections, d_model 512, measured ||int8 - fp32|| / ||fp32||: 1.2% at 8x128, up to 2.9% on short
# padded sequences (each query averages few keys, so quantization noise averages out less). 5% passes those and
# still refuses a model whose output projection is off by 10% (tests/exporters/test_quantize.py).
INT8_REL_ERR_BUDGET = REL_ERR_BUDGETS[INT8_DYNAMIC]
# What walking back from a logits output to the LM head's MatMul passes through: ops that move, cast or add a
# bias to the head's product without mixing its rows.
_HEAD_PASSTHROUGH = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Add", "Slice", "Gather"}


@dataclass(frozen=True)
class Quantization:
    """What ``--quantize`` asks for. ``kind``: "none", "int4"/"int8" (weight-only MatMulNBits) or "int8-dynamic".
    Weight-only only: ``block_size`` along K (a power of two, at least 16: MatMulNBits' constraint),
    ``symmetric`` (no zero points), ``keep_head_fp32`` (the MatMul producing the logits output left fp32: the
    layer whose error reaches the logits undamped), ``method`` (QUANT_METHODS)."""

    kind: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = False
    keep_head_fp32: bool = False
    method: str = "rtn"

    @classmethod
    def of(cls, value: str | Quantization) -> Quantization:
        return value if isinstance(value, Quantization) else cls(value)

    @property
    def weight_only(self) -> bool:
        return self.kind in WEIGHT_ONLY_BITS

    @property
    def rel_budget(self) -> float | None:
        """The relative error parity allows (None: fp32 parity, atol/rtol)."""
        return REL_ERR_BUDGETS.get(self.kind)

    def check(self) -> None:
        if self.kind not in QUANTIZE_CHOICES:
            raise ExportError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.kind!r}")
        if not self.weight_only:
            asked = [flag for flag, on in (("--block-size", self.block_size != DEFAULT_BLOCK_SIZE),
                                           ("--symmetric", self.symmetric), ("--keep-head-fp32", self.keep_head_fp32),
                                           ("--quant-method", self.method != "rtn")) if on]
            if asked:
                raise ExportError(f"{', '.join(asked)}: options of weight-only quantization; use them with "
                                  "--quantize int4 or int8")
            return
        if self.method not in QUANT_METHODS:
            raise ExportError(f"quant method must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}")
        size = self.block_size
        if type(size) is not int or size < 16 or size & (size - 1):
            raise ExportError(f"--block-size {size}: MatMulNBits takes a power of two of at least 16 (32 is the "
                              "default; 64 or 128 give smaller files and a larger error)")
        if self.method == "hqq" and self.kind == "int8":
            # HQQ writes float zero points, which only ORT's unpacked kernel takes, and that one runs 2 and 4 bits.
            raise ExportError("--quant-method hqq: ONNX Runtime's CPU kernel runs HQQ's 8-bit weights nowhere (its "
                              "float zero points take the unpacked path, 2 and 4 bits only); use --quantize int4 "
                              "with hqq, or int8 with rtn")
        if self.method == "hqq" and self.symmetric:
            raise ExportError("--quant-method hqq fits a zero point per block: drop --symmetric, or use rtn")

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` quantized as asked (a new model; ``model`` is left as it was)."""
        if self.kind == INT8_DYNAMIC:
            return quantize_int8_dynamic(model)
        if self.weight_only:
            return quantize_weights(model, self)
        return model

    def record(self, model: onnx.ModelProto) -> WeightOnlyRecord | None:
        """What ``model``, quantized by ``apply``, holds, read off its graph (None unless weight-only)."""
        if not self.weight_only:
            return None
        nbits = [node for node in all_nodes(model.graph) if node.op_type == "MatMulNBits"]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nbits[0].attribute} if nbits else {}
        return WeightOnlyRecord(
            bits=int(attributes.get("bits", WEIGHT_ONLY_BITS[self.kind])),
            block_size=int(attributes.get("block_size", self.block_size)),
            symmetric=self.symmetric,
            method=self.method,
            accuracy_level=int(attributes.get("accuracy_level", 0)),
            matmuls=len(nbits),
            fp32_matmuls=len(constant_weight_matmuls(model)),
            head_fp32=self.keep_head_fp32,
        )


def quantize_weights(model: onnx.ModelProto, quantization: Quantization) -> onnx.ModelProto:
    """Every MatMul of ``model`` with a constant 2-D weight as MatMulNBits (``quantization``: bits, block size,
    symmetry, method; the LM head kept fp32 if asked), everything else as it was: attentions, inputs, outputs,
    the metadata. Raises ``ExportError`` when nothing is quantized or the quantizer fails."""
    with _quiet_quantizer():  # its import configures logging (_quiet_quantizer)
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            HQQWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

    bits = WEIGHT_ONLY_BITS[quantization.kind]
    working = onnx.ModelProto.FromString(model.SerializeToString())
    excluded = []
    if quantization.keep_head_fp32:
        excluded = [node.name for node in _named_heads(working)]
    if quantization.method == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=quantization.block_size, bits=bits)
    else:
        config = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                              accuracy_level=ACCURACY_LEVEL, bits=bits)
    try:
        with _quiet_quantizer(), warnings.catch_warnings():
            # HQQ hands numpy's read-only weights to torch.from_numpy, which warns; it only reads them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            quantizer = MatMulNBitsQuantizer(working, nodes_to_exclude=excluded, algo_config=config)
            quantizer.process()
    except Exception as exc:  # the quantizer raises bare Exceptions and assertion errors
        raise ExportError(f"{quantization.kind} quantization failed: {type(exc).__name__}: {exc}") from exc
    quantized = quantizer.model.model
    _drop_repeated_initializers(quantized)
    quantized.ir_version = min(quantized.ir_version, model.ir_version)
    _keep_node_props(model, quantized)
    if not any(node.op_type == "MatMulNBits" for node in all_nodes(quantized.graph)):
        raise ExportError(f"--quantize {quantization.kind}: the graph has no MatMul with a constant 2-D weight to "
                          "quantize (nothing would be smaller or faster); export without --quantize")
    return quantized


def constant_weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMul and Gemm nodes of ``model`` (subgraphs included) whose second input is an initializer."""
    constants = {tensor.name for tensor in _all_initializers(model.graph)}
    return [node for node in all_nodes(model.graph)
            if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in constants]


def _all_initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_initializers(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_initializers(subgraph)


def lm_heads(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMuls with a constant weight that produce ``model``'s logits outputs (outputs named as
    ``compare.is_logits`` names them), found walking back from each through ops that move, cast or add a bias
    to a product (an If: through each branch); empty when the model has no logits output or no such MatMul."""
    from mha_deploy.compare import is_logits

    constants = {tensor.name for tensor in _all_initializers(model.graph)}
    heads: list[onnx.NodeProto] = []

    def walk(graph: onnx.GraphProto, name: str, depth: int = 0) -> None:
        producer = next((node for node in graph.node if name in node.output), None)
        if producer is None or depth > 32:
            return
        if producer.op_type in ("MatMul", "Gemm"):
            if len(producer.input) > 1 and producer.input[1] in constants:
                heads.append(producer)
            return
        if producer.op_type == "If":
            index = list(producer.output).index(name)
            for attribute in producer.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g, attribute.g.output[index].name, depth + 1)
            return
        if producer.op_type in _HEAD_PASSTHROUGH and producer.input:
            # the data input: the first non-constant one (Add's bias and Reshape's shape are constants)
            data = next((i for i in producer.input if i and i not in constants), None)
            if data is not None:
                walk(graph, data, depth + 1)

    for output in model.graph.output:
        if is_logits(output.name):
            walk(model.graph, output.name)
    return heads


def _named_heads(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """``lm_heads`` of ``model``, each given a name unique in the model (the quantizer excludes nodes by name);
    raises when there is none to keep."""
    heads = lm_heads(model)
    if not heads:
        outputs = ", ".join(o.name for o in model.graph.output)
        raise ExportError(f"--keep-head-fp32: no MatMul with a constant weight produces a logits output (outputs: "
                          f"{outputs}); name the LM head's output logits (--output logits), or drop the flag")
    taken = {node.name for node in all_nodes(model.graph)}
    for index, node in enumerate(heads):
        if not node.name or sum(n.name == node.name for n in all_nodes(model.graph)) > 1:
            name = f"lm_head_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
    return heads


def _drop_repeated_initializers(model: onnx.ModelProto) -> None:
    """Keep one of each initializer name per graph: the quantizer writes a weight's blocks and scales once per
    MatMul reading it (one weight read by several MatMuls, e.g. in both branches of an If), each the same."""
    for graph in (model.graph, *(a.g for n in all_nodes(model.graph) for a in n.attribute
                                 if a.type == onnx.AttributeProto.GRAPH)):
        seen: dict[str, bytes] = {}
        kept = []
        for tensor in graph.initializer:
            data = tensor.SerializeToString()
            if tensor.name in seen:
                if seen[tensor.name] != data:
                    raise ExportError(f"weight-only quantization wrote two different tensors named {tensor.name}: "
                                      "a fault of the export, please report it")
                continue
            seen[tensor.name] = data
            kept.append(tensor)
        if len(kept) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(kept)
