"""Which exported graphs ORT's CUDA provider cannot run as deployed, decided from the graph alone.

No GPU is needed to decide it, so the session (``provider="cuda"`` or ``"auto"``)
and the Triton writer (``--kind gpu``) refuse such a model before ORT does
something worse: fail at the first run, or place the op on the CPU and copy
tensors to and from the GPU around it without a word.
"""

from __future__ import annotations

import onnx

from mha_deploy.errors import MHADeployError
from mha_deploy.metadata import CACHE_RAGGED, ModelMetadata
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.runtime.cache_layout import read_cache_layout

# ONNX Attention's qk_matmul_output_mode values other than 0 (the raw scores):
# ORT's CUDA Attention kernel returns NOT_IMPLEMENTED for modes 1-3 (onnxruntime
# issue 28351; onnxruntime/core/providers/cuda/llm/attention.cc). mha-deploy's
# --return-weights models use mode 3, the probabilities after softmax.
_QK_OUTPUT_MODES_WITHOUT_CUDA = (1, 2, 3)

# Dynamic int8 ops as onnxruntime.quantization.quantize_dynamic writes them (and
# ORT's CPU fusions of them). DynamicQuantizeLinear has no CUDA kernel (its only
# kernel is the CPU one, onnxruntime/core/providers/cpu/quantization/), CUDA's
# MatMulInteger takes int8 x int8 only while the quantizer feeds it uint8
# activations (onnxruntime/core/providers/cuda/math/matmul_integer.cc), and the
# contrib DynamicQuantizeMatMul / MatMulIntegerToFloat are CPU kernels.
_INT8_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"})


def cuda_unsupported(proto: onnx.ModelProto) -> str | None:
    """Why ``proto`` cannot run on ORT's CUDA provider as deployed (one line), or None."""
    ops = {node.op_type for node in all_nodes(proto.graph)}
    int8 = sorted(ops & _INT8_OPS)
    if int8:
        return (
            f"the model is int8-dynamic ({', '.join(int8)}), which ORT's CUDA provider has no kernels for: it would "
            "run every projection on the CPU with copies around it. Run it with --provider cpu, or export "
            "--dtype fp16 (without --quantize) for CUDA"
        )
    # CUDA registers GroupQueryAttention for float16 and bfloat16 only
    # (onnxruntime/contrib_ops/cuda/bert/group_query_attention.cc): an fp32 causal
    # model fused to it would run its attention on the CPU, with copies around it.
    if "GroupQueryAttention" in ops and _float_type(proto) == onnx.TensorProto.FLOAT:
        if _ragged_cache(proto):
            return RAGGED_OFF_CPU
        return (
            "the model is fp32 with GroupQueryAttention (causal --fuse mha/auto), which ORT's CUDA provider "
            "runs in fp16/bf16 only: it would run attention on the CPU. Export --dtype fp16 for CUDA, or "
            "--fuse onnx for fp32"
        )
    for node in all_nodes(proto.graph):
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and _returns_weights(node):
            return (
                "the model returns attention weights through ONNX Attention's qk_matmul_output, which ORT's "
                "CUDA Attention kernel does not implement. Run it with --provider cpu, or export it with "
                "--fuse none for CUDA"
            )
    return None


def cuda_graph_unsupported(proto: onnx.ModelProto) -> str | None:
    """Why ORT cannot capture ``proto`` in a CUDA graph, or None (checked on top of ``cuda_unsupported``)."""
    # A CUDA graph replays fixed kernels: models with control flow (If, Loop, Scan)
    # are not supported (ORT's CUDA-ExecutionProvider docs, "Using CUDA Graphs"), and
    # --fuse mha/auto puts an If around a padded attention (the padding_flash fusion
    # rule), around a causal one (causal_gqa: ORT's CPU GroupQueryAttention path by size)
    # and, in fp32, around a mask-free or padded one (short_sequence: ORT's CPU kernel by length).
    if any(node.op_type in ("If", "Loop", "Scan") for node in proto.graph.node):
        return (
            "the model has control flow (an If: --fuse mha/auto with a padding or causal mask, or in fp32), which "
            "ORT cannot capture in a CUDA graph; export it with --fuse onnx (or mask-free, with --dtype fp16) "
            "for cuda_graph"
        )
    # An fp16 causal --fuse mha file is GroupQueryAttention with no If (exporters.fusion.causal_gqa: the form CUDA's
    # kernel runs). The op reads total_sequence_length on the host, which a replayed graph does not recompute;
    # capturing it has not been run on a GPU, so it is refused rather than trusted.
    if any(node.op_type == "GroupQueryAttention" for node in proto.graph.node):
        return ("the model's causal attention is GroupQueryAttention (--fuse mha/auto), whose host-side lengths a "
                "CUDA graph would not refresh (not yet run captured on a GPU); export it with --fuse onnx for "
                "cuda_graph")
    if any(node.op_type == "NonZero" for node in proto.graph.node):
        return ("the model packs its tokens (NonZero: shapes that depend on the padding), which a CUDA graph cannot "
                "replay; export it with --no-pack-tokens or --fuse onnx for cuda_graph")
    return None


# What a ragged KV-cache file (exporters.fusion.ragged_cache) says off the CPU provider: fp32 GroupQueryAttention has
# no CUDA kernel, and KVCacheStepper keeps the cache in host buffers that ORT writes in place. The holes layout's
# attention is contrib MultiHeadAttention, which CUDA runs in fp32.
RAGGED_OFF_CPU = (
    "the file keeps a ragged KV cache (GroupQueryAttention updating it in place, export --kv-cache's default), "
    "which runs on the CPU provider only: use --provider cpu, or export it again with --kv-cache --cache-layout "
    "holes for CUDA"
)


def _ragged_cache(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` keeps the ragged KV-cache layout: as its mha-deploy metadata records, else as its graph
    reads (a file whose metadata is missing or unreadable)."""
    try:
        metadata = ModelMetadata.from_props({p.key: p.value for p in proto.metadata_props})
    except MHADeployError:
        metadata = None
    return read_cache_layout(metadata, proto.graph) == CACHE_RAGGED


def _float_type(proto: onnx.ModelProto) -> int | None:
    """The element type of the model's first float input (its sequences: x, or query), or None."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    for value in proto.graph.input:
        elem_type = value.type.tensor_type.elem_type
        if elem_type in floats:
            return elem_type
    return None


def _returns_weights(node: onnx.NodeProto) -> bool:
    mode = next((a.i for a in node.attribute if a.name == "qk_matmul_output_mode"), 0)
    # qk_matmul_output is the 4th output; the mode matters only when something reads it.
    return len(node.output) > 3 and bool(node.output[3]) and mode in _QK_OUTPUT_MODES_WITHOUT_CUDA
