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
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from mha_deploy.errors import ExportError, InputError, ParityError
from mha_deploy.metadata import (
    CACHE_HOLES,
    INT8_DYNAMIC,
    METADATA_KEY,
    QUANT_METHODS,
    QUANTIZE_CHOICES,
    WEIGHT_ONLY_BITS,
    EvalRecord,
    ModelMetadata,
    WeightOnlyRecord,
)
from mha_deploy.onnx_nodes import all_graphs, all_nodes
from mha_deploy.signature import PADDING_MASK, TOKENS, Signature

# A KV-cache file's positions input (exporters.own_kv_cache.POSITION_IDS; that module imports torch).
POSITION_IDS = "position_ids"

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
    # The token embedding tables as GatherBlockQuantized too (``--quantize-embeddings``; int4: ORT's quantizer
    # writes 4-bit tables only).
    embeddings: bool = False
    # GPTQ's calibration prompts (``--calibration``, method "gptq" only).
    calibration: TextData | None = None
    # The text the written file is judged on against the fp32 module (``--eval-data``): perplexity and greedy
    # agreement, recorded in the file; a causal LM with --kv-cache only.
    evaluation: TextData | None = None

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
                                           ("--quant-method", self.method != "rtn"),
                                           ("--quantize-embeddings", self.embeddings),
                                           ("--calibration", self.calibration is not None),
                                           ("--eval-data", self.evaluation is not None)) if on]
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
        if self.embeddings and self.kind != "int4":
            raise ExportError("--quantize-embeddings: ONNX Runtime's quantizer writes GatherBlockQuantized tables in 4 "
                              "bits only; use it with --quantize int4")
        if (self.method == "gptq") != (self.calibration is not None):
            raise ExportError("--quant-method gptq calibrates on prompts: give --calibration FILE (token ids or texts, "
                              "as generate reads them)" if self.method == "gptq" else
                              "--calibration is GPTQ's data: give --quant-method gptq with it")
        if self.method == "gptq" and self.kind != "int4":
            raise ExportError("--quant-method gptq: ONNX Runtime's GPTQ (its copy of Intel Neural Compressor's) writes "
                              "4-bit weights only; use --quantize int4, or int8 with rtn")
        if self.method == "gptq" and self.keep_head_fp32:
            raise ExportError("--quant-method gptq with --keep-head-fp32: ONNX Runtime's GPTQ path ignores the nodes "
                              "it is told to leave alone; use rtn (or hqq) to keep the head fp32")

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
        nodes = list(all_nodes(model.graph))
        nbits = [node for node in nodes if node.op_type == "MatMulNBits"]
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
            embeddings=sum(node.op_type == "GatherBlockQuantized" for node in nodes),
        )

    def evaluate(self, record: WeightOnlyRecord, reference, declared: Signature | None, model: onnx.ModelProto,
                 metadata: ModelMetadata) -> WeightOnlyRecord:
        """``record`` with the file's quality on ``self.evaluation``'s text (``evaluate_on_text``); a
        ``ParityError`` when its perplexity is past ``PERPLEXITY_RATIO_BUDGET`` times the fp32 module's."""
        if declared is None or not metadata.signature.kv_cache:
            raise ExportError(EVAL_NEEDS_CAUSAL_LM)
        evaluation = evaluate_on_text(reference, declared, model, metadata.cache_layout, self.evaluation,
                                      metadata.max_length)
        if not evaluation.ratio <= evaluation.ratio_budget:
            raise ParityError(f"--eval-data: the quantized file's perplexity {evaluation.perplexity:.4g} is "
                              f"{evaluation.ratio:.2f}x the fp32 module's {evaluation.perplexity_fp32:.4g} on "
                              f"{evaluation.source} (budget {evaluation.ratio_budget:g}x); nothing written")
        return replace(record, evaluation=evaluation)


def quantize_weights(model: onnx.ModelProto, quantization: Quantization) -> onnx.ModelProto:
    """Every MatMul of ``model`` with a constant 2-D weight as MatMulNBits (``quantization``: bits, block size,
    symmetry, method; the LM head kept fp32 if asked), the token embedding tables as GatherBlockQuantized if asked,
    everything else as it was: attentions, inputs, outputs, the metadata. Raises ``ExportError`` when nothing is
    quantized or the quantizer fails."""
    with _quiet_quantizer():  # its import configures logging (_quiet_quantizer)
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            GPTQWeightOnlyQuantConfig,
            HQQWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

    bits = WEIGHT_ONLY_BITS[quantization.kind]
    working = onnx.ModelProto.FromString(model.SerializeToString())
    excluded = []
    if quantization.keep_head_fp32:
        excluded = [node.name for node in _named_heads(working)]
    # The quantizer's own block_size, symmetry and accuracy level: the GPTQ path reads them off the quantizer, the
    # others off their configs.
    options = {"block_size": quantization.block_size, "is_symmetric": quantization.symmetric,
               "accuracy_level": ACCURACY_LEVEL, "nodes_to_exclude": excluded}
    if quantization.method == "hqq":
        config = HQQWeightOnlyQuantConfig(block_size=quantization.block_size, bits=bits)
    elif quantization.method == "gptq":
        _check_gptq_blocks(working, quantization)
        # GPTQ finds nodes again by name (ONNXModel.get_node, its topological sort): unnamed ones would collide.
        _name_nodes(working)
        feeds = [prompt_feeds(working, ids) for ids in quantization.calibration.prompts]
        # GPTQ's own block_size is how many columns one of its update steps takes (128, its default), not the
        # scales' block, which is the quantizer's.
        config = GPTQWeightOnlyQuantConfig(calibration_data_reader=_Feeds(feeds))
    else:
        config = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                              accuracy_level=ACCURACY_LEVEL, bits=bits)
    quantized = _run_quantizer(MatMulNBitsQuantizer, working, config, options, quantization.kind)
    if quantization.embeddings:
        tables = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                              bits=4, op_types_to_quantize=("Gather",))
        quantized = _run_quantizer(MatMulNBitsQuantizer, quantized, tables,
                                   {"nodes_to_exclude": _gathers_but_token_tables(quantized)}, "--quantize-embeddings")
        if not any(node.op_type == "GatherBlockQuantized" for node in all_nodes(quantized.graph)):
            raise ExportError("--quantize-embeddings: no Gather reads a constant table by the token ids (inputs "
                              f"{', '.join(_token_inputs(quantized)) or 'of token ids: none'}); drop the flag")
    _drop_repeated_initializers(quantized)
    quantized.ir_version = min(quantized.ir_version, model.ir_version)
    _keep_node_props(model, quantized)
    if not any(node.op_type == "MatMulNBits" for node in all_nodes(quantized.graph)):
        raise ExportError(f"--quantize {quantization.kind}: the graph has no MatMul with a constant 2-D weight to "
                          "quantize (nothing would be smaller or faster); export without --quantize")
    return quantized


def _run_quantizer(quantizer_class, model: onnx.ModelProto, config, options: dict, what: str) -> onnx.ModelProto:
    try:
        # GPTQ prints a progress bar on stdout, where export's report goes.
        with _quiet_quantizer(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            # HQQ hands numpy's read-only weights to torch.from_numpy, which warns; it only reads them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            quantizer = quantizer_class(model, algo_config=config, **options)
            quantizer.process()
    except Exception as exc:  # the quantizer raises bare Exceptions and assertion errors
        raise ExportError(f"{what} quantization failed: {type(exc).__name__}: {exc}") from exc
    return quantizer.model.model


def _check_gptq_blocks(model: onnx.ModelProto, quantization: Quantization) -> None:
    """ONNX Runtime 1.31's GPTQ (neural_compressor/weight_only.py, make_matmul_weight_only_node) packs two 4-bit
    zero points a byte over the whole weight, not per column: a weight with an odd number of blocks along K gets
    its columns' zero points shifted, and the reshape after fails. Refused before, saying what avoids it."""
    if quantization.symmetric:
        return
    constants = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:  # GPTQ quantizes the top graph only
        weight = constants.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weight is not None and len(weight.dims) == 2 and -(-weight.dims[0] // quantization.block_size) % 2:
            raise ExportError(
                f"--quant-method gptq: ONNX Runtime's GPTQ packs 4-bit zero points across columns when a weight has "
                f"an odd number of blocks along K (here {weight.dims[0]} in blocks of {quantization.block_size}); "
                "add --symmetric (no zero points), or a --block-size that divides every K an even number of times")


class _Feeds:
    """ORT's CalibrationDataReader protocol (``get_next`` until None) over prepared feeds; GPTQ deep-copies the
    reader before it reads it, so each copy starts from the first."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds, self.next = feeds, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.next == len(self.feeds):
            return None
        self.next += 1
        return self.feeds[self.next - 1]

    def __iter__(self):
        return iter(self.get_next, None)


def _signature(model: onnx.ModelProto) -> Signature | None:
    props = {p.key: p.value for p in model.metadata_props}
    return ModelMetadata.from_props(props).signature if METADATA_KEY in props else None


def _token_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs holding token ids: the ``tokens`` role of the file's Signature where it has one, else
    Optimum's names (an encoder-decoder's files record no Signature)."""
    signature = _signature(model)
    if signature is not None and signature.model == "custom":
        # A KV-cache file's position_ids are ids too, of positions: the tables they index (rotary cos/sin, learned
        # positions) are no token embedding.
        return [spec.name for spec in signature.custom_inputs if spec.role == TOKENS and spec.name != POSITION_IDS]
    return [value.name for value in model.graph.input if value.name in ("input_ids", "decoder_input_ids")]


def prompt_feeds(model: onnx.ModelProto, ids: Sequence[int]) -> dict[str, np.ndarray]:
    """One prompt as ``model``'s inputs take it on a first call: the ids [1, seq], a padding mask of ones, empty
    caches (past length 0), positions 0..seq-1. GPTQ reads the activations these give each MatMul."""
    tokens = set(_token_inputs(model))
    signature = _signature(model)
    masks = {spec.name for spec in signature.custom_inputs if spec.role == PADDING_MASK} if signature else set()
    masks |= {"attention_mask"}
    ids = np.asarray(ids, np.int64)[None]
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if value.name in tokens:
            feeds[value.name] = ids.astype(dtype)
        elif value.name in masks:
            feeds[value.name] = np.ones(ids.shape, dtype)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(ids.shape[1], dtype=dtype)[None]
        elif value.name.startswith("past_key_values.") and len(dims) == 4:
            # [batch, heads, past_seq, head_dim]: one row, nothing cached yet
            feeds[value.name] = np.zeros((1, dims[1] or 0, 0, dims[3] or 0), dtype)
        else:
            raise ExportError(f"--calibration feeds a language model token ids (their mask, an empty cache, "
                              f"positions); this graph also takes {value.name}, which prompts do not give")
    return feeds


# What token ids pass through on their way to an embedding table without ceasing to be ids.
_ID_PASSTHROUGH = {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Slice", "Concat", "Expand"}


def _gathers_but_token_tables(model: onnx.ModelProto) -> list[str]:
    """The names of every Gather but those reading a constant float table [rows, width] by the token ids (through
    casts and reshapes): ORT's quantizer takes every Gather of a constant when Gather is asked for, and a shape's
    Gather or a rotary cos/sin cache is no embedding. Unnamed Gathers are given names (it excludes by name)."""
    tokens = set(_token_inputs(model))
    floats = {t.name for t in _all_initializers(model.graph)
              if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and len(t.dims) == 2}
    producers = {out: node for node in all_nodes(model.graph) for out in node.output}

    def from_tokens(name: str, depth: int = 0) -> bool:
        if name in tokens:
            return True
        node = producers.get(name)
        if node is None or depth > 8 or node.op_type not in _ID_PASSTHROUGH:
            return False
        # any input: a KV-cache file's ids reach the table through a Concat and Slice (the new tokens' columns)
        return any(from_tokens(source, depth + 1) for source in node.input if source)

    _name_nodes(model, "Gather")
    return [node.name for node in all_nodes(model.graph) if node.op_type == "Gather"
            and not (node.input[0] in floats and from_tokens(node.input[1]))]


def _name_nodes(model: onnx.ModelProto, op_type: str | None = None) -> None:
    """A name unique in ``model`` for each unnamed ``op_type`` node (None: any): ORT's quantizers pick nodes by
    name."""
    taken = {node.name for node in all_nodes(model.graph)}
    for index, node in enumerate(n for n in all_nodes(model.graph) if op_type in (None, n.op_type)):
        if not node.name:
            node.name = f"{node.op_type.lower()}_{index}"
            while node.name in taken:
                node.name += "_"
            taken.add(node.name)


def constant_weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MatMul and Gemm nodes of ``model`` (subgraphs included) whose second input is an initializer."""
    constants = {tensor.name for tensor in _all_initializers(model.graph)}
    return [node for node in all_nodes(model.graph)
            if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in constants]


def _all_initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    for sub in all_graphs(graph):
        yield from sub.initializer


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
    for graph in all_graphs(model.graph):
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


# --- quality on the user's text (--eval-data) -------------------------------------------------------------------

# Greedy tokens generated from each prompt by both (--eval-tokens): enough to see the quantized file drift from the
# module's choices, few enough that the fp32 side (a full forward per token, no cache) stays quick.
DEFAULT_EVAL_TOKENS = 16
# Perplexity on the user's text is reported, and refused past this ratio to the fp32 module's. Generous on
# purpose: a trained model's int4 costs a few percent and a random tiny one's a few tenths of a percent (measured:
# docs/precision.md), while a broken scale multiplies it; what is acceptable between is the user's call, which
# the recorded figures inform. The relative logit error on the parity cases stays the first budget.
PERPLEXITY_RATIO_BUDGET = 1.5
EVAL_NEEDS_CAUSAL_LM = ("--eval-data judges a causal LM exported with --kv-cache (perplexity of its logits, greedy "
                        "tokens through its cache); this export is not one")


@dataclass(frozen=True)
class TextData:
    """Prompts of token ids read from ``source`` (``--eval-data``, ``--calibration``); ``new_tokens``: how many
    greedy tokens an evaluation generates from each."""

    source: str
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int = DEFAULT_EVAL_TOKENS


def read_text_data(path: str | Path, tokenizer: str | Path | None = None,
                   new_tokens: int = DEFAULT_EVAL_TOKENS) -> TextData:
    """The prompts of a file as ``generate`` reads them (JSONL with ``input_ids`` or ``prompt`` text, Parquet, npz,
    safetensors), texts through ``tokenizer`` (a tokenizer.json); an ``InputError`` naming the first unusable one."""
    from mha_deploy.batch.generation import PromptTokenizer, read_prompts

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    prompts = list(read_prompts(path, PromptTokenizer(tokenizer) if tokenizer is not None else None))
    bad = next((prompt for prompt in prompts if prompt.problem is not None), None)
    if bad is not None:
        hint = "" if tokenizer is not None else (" (texts need a tokenizer.json: beside the model, in the --hf "
                                                 "folder)")
        raise InputError(f"{path}: {bad.problem}{hint}")
    if not prompts:
        raise InputError(f"{path}: no prompts")
    if type(new_tokens) is not int or new_tokens < 1:
        raise InputError(f"--eval-tokens must be a positive integer, got {new_tokens!r}")
    return TextData(path.name, tuple(tuple(int(i) for i in p.input_ids) for p in prompts), new_tokens)


def evaluate_on_text(reference, declared: Signature, model: onnx.ModelProto, cache_layout: str | None,
                     data: TextData, max_length: int | None = None) -> EvalRecord:
    """``model`` (a causal LM with a KV cache, in memory) against ``reference`` (the fp32 module taking
    ``declared``'s ids and padding mask) on ``data``'s prompts, one at a time: the perplexity of each over the
    prompts' next tokens (one call over each prompt), and greedy tokens of each, ``data.new_tokens`` from every
    prompt (the file through ``runtime.generation`` and its cache, as users run it; the module by a full forward
    per token). A prompt longer than ``max_length`` less the new tokens keeps its last tokens."""
    import onnxruntime as ort

    from mha_deploy.exporters.own_kv_cache import lm_tensors
    from mha_deploy.exporters.parity import torch_reference
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    tokens, mask, output = lm_tensors(declared)
    options = ort.SessionOptions()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    stepper = KVCacheStepper(session, cache_layout=cache_layout or CACHE_HOLES)
    room = None if max_length is None else max_length - data.new_tokens
    if room is not None and room < 1:
        raise ExportError(f"--eval-tokens {data.new_tokens}: the model takes {max_length} tokens at most")

    def module_logits(ids: np.ndarray) -> np.ndarray:  # [seq, vocab]
        feeds = {tokens.name: ids[None], mask.name: np.ones((1, len(ids)), bool)}
        return torch_reference(reference, declared, feeds)[output.name][0]

    nll = {"file": 0.0, "module": 0.0}
    scored, agreement, identical = 0, 0.0, 0
    for prompt in data.prompts:
        ids = np.asarray(prompt[-room:] if room is not None else prompt, np.int64)
        if tokens.vocab is not None and (ids.min() < 0 or ids.max() >= tokens.vocab):
            raise InputError(f"{data.source}: token ids must lie in [0, {tokens.vocab}), the model's vocabulary")
        if len(ids) > 1:
            targets = ids[1:]
            file_logits = stepper.prefill(ids[None], np.ones((1, len(ids)), np.int64), every_position=True)[0]
            for name, logits in (("file", file_logits), ("module", module_logits(ids))):
                nll[name] -= float(_log_softmax(logits[:-1])[np.arange(len(targets)), targets].sum())
            scored += len(targets)
        quantized = generate(stepper, [ids.tolist()], max_new_tokens=data.new_tokens, eos_token_id=[]).tokens[0]
        grown = ids
        for _ in range(data.new_tokens):  # greedy through the module's full forward: no cache to trust
            grown = np.append(grown, np.int64(module_logits(grown)[-1].argmax()))
        fp32 = grown[len(ids):]
        differ = np.flatnonzero(np.asarray(quantized[: len(fp32)]) != fp32)
        same = int(differ[0]) if len(differ) else len(fp32)
        agreement += same / data.new_tokens
        identical += same == data.new_tokens
    if scored == 0:
        raise InputError(f"{data.source}: perplexity needs prompts of at least 2 tokens")
    return EvalRecord(data.source, len(data.prompts), scored, float(np.exp(nll["file"] / scored)),
                      float(np.exp(nll["module"] / scored)), data.new_tokens, agreement / len(data.prompts),
                      identical, PERPLEXITY_RATIO_BUDGET)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
