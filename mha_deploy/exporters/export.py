"""``export_mha``: reference module in, checked ONNX file out (or nothing at all)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import torch

from mha_deploy.atomic import atomic_path
from mha_deploy.errors import (
    ExportError,
    ModelFileError,
    ModelFileExportError,
    ParityError,
    first_line,
    raises_export_errors,
)
from mha_deploy.exporters.fusion import FusionReport, fuse_attention
from mha_deploy.exporters.fusion.ragged_cache import RaggedRefused, to_ragged_cache
from mha_deploy.exporters.fusion.rotary_gqa import fuse_into_gqa_checked
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.kv_cache import CacheProjection, attach_caches, decode_on_mha, prefill_or_decode
from mha_deploy.exporters.last_token_logits import (
    LOGITS_CHOICES,
    last_token_signature,
    lm_head_refusal,
    logits_at_every_position,
    logits_at_last_token,
)
from mha_deploy.exporters.mask_inputs import masks_as_declared
from mha_deploy.exporters.own_kv_cache import (
    OWN_CACHE_CASES,
    POSITION_IDS,
    RAGGED_CACHE_CASES,
    PlainRuns,
    attach_own_caches,
    cache_signature,
    capped_cache_cases,
    check_own_cache_parity,
    find_attention_caches,
    lm_tensors,
    narrowed_own_caches,
    positions_kind,
)
from mha_deploy.exporters.own_model import (
    Declared,
    InputDecl,
    ModuleState,
    count_attentions,
    declare_model,
    graph_vocabularies,
    load_checkpoint,
    position_tables,
    trace_failure,
)
from mha_deploy.exporters.own_seq2seq_cache import (
    Seq2SeqExportResult,
    build_seq2seq_cache,
    seq2seq_tensors,
    write_seq2seq_pair,
)
from mha_deploy.exporters.parity import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    CacheCase,
    ParityCase,
    check_cache_parity,
    check_parity,
    default_cases,
)
from mha_deploy.exporters.precision import DTYPES, FP16_ATOL, FP16_RTOL, to_float16
from mha_deploy.exporters.quantize import EVAL_NEEDS_CAUSAL_LM, Quantization
from mha_deploy.exporters.reference_form import reference_attention, without_fast_path
from mha_deploy.exporters.stack_graphs import decoder_cache_graphs, export_stack_onnx, stack_graph
from mha_deploy.exporters.token_packing import PackingReport, pack_model, packing_masks
from mha_deploy.exporters.torch_export import DEFAULT_OPSET, ROTARY_OPSET, export_onnx
from mha_deploy.metadata import (
    CACHE_HOLES,
    CACHE_LAYOUT_AUTO,
    CACHE_LAYOUT_CHOICES,
    CACHE_RAGGED,
    FUSE_CHOICES,
    INT8_DYNAMIC,
    MAX_OPSET,
    METADATA_KEY,
    MIN_OPSET,
    POSITIONS_INPUT,
    POSITIONS_NONE,
    GenerationIds,
    ModelMetadata,
    ParityReport,
    Signature,
)
from mha_deploy.models.attention import MASK_FILL_VALUE, MultiHeadAttention
from mha_deploy.models.transformer import Decoder, Encoder
from mha_deploy.onnx_nodes import default_opset
from mha_deploy.runtime.model_check import graph_heads, head_splits
from mha_deploy.runtime.session import MHASession, check_model_before_writing

# --fuse auto, per mask mode: the fastest exact path on ORT's CPU provider. Full block
# (projections + attention), self-attention, d_model 512, 8 heads, fp32, 2 threads, ORT 1.31.1,
# denormals flushed (MHASession); medians in ms from one run of
#   mha-deploy bench --mask none,padding,padding-25%,causal,padding-causal,padding-causal-25% \
#       --shapes 8x128,1x1024,32x64,1x4096 --memory-shapes 2x4096 --quiet-wait-s 60
# (the whole table is docs/bench.txt):
#
#   mask mode, (1,4096)        mha: kernel                                        mha    onnx    none
#   none                       MultiHeadAttention (flash)                         134     175     175
#   padding, every key real    If -> MultiHeadAttention (flash)                   135     228     340
#   padding, last 1/4 padded   If -> keys cut to the real ones, MHA (flash)       108     228     337
#   causal                     If -> GroupQueryAttention (tiled)                  107     230     395
#   padding-causal             If (nothing padded) -> the same                    108     236     397
#   padding-causal, 1/4 padded If -> tokens compacted and cut, GQA (tiled)         77     238     401
#
# Up to 256 keys every mask mode runs the standard Attention op under mha too (short_sequence); causal
# GroupQueryAttention materialises its scores up to 64 MB and runs tiled beyond (causal_gqa): at (1,1024)
# causal takes 12.7 ms on mha against 14.6 on onnx. At (8,128) and (32,64) the targets are within 3% of
# each other for every mask mode, mha ahead; at (1,1024) and (1,4096) mha is fastest for every mask mode.
# mha also builds no mask tensor beyond 256 keys and keeps run memory at (2,4096) within 120-165 MB for
# every mask mode, where onnx needs 1.1-1.4 GB (a float [batch, 1, q_len, kv_len] attn_mask, and ORT's
# standard Attention materialises the scores).
AUTO_TARGETS = {"none": "mha", "padding": "mha", "causal": "mha", "padding-causal": "mha"}
# A KV-cache model (--kv-cache), by the one-token step it exists for (d_model 512, 8 heads, 2 threads,
# ORT 1.31.1, graph optimizations "all", medians over interleaved blocks of 10 calls, host shared):
#
#   decode graph                                              (1,4096)  (8,1024)  (1,1024)
#   MultiHeadAttention with past_key/past_value (mha)          2.29 ms   5.09      1.41
#   plain graph: Concat onto the cache, masked attention       3.09      6.22      1.95
#   the pipeline's MultiHeadAttention, mask as attention_bias  15.1      -         1.5   (an earlier, quieter run;
#     over the concatenated cache                                                        the plain graph took 5.0
#                                                                                        and 1.4 there)
#
# GroupQueryAttention cannot take this cache: its seqlens_k says where each row's real keys end, not
# where a padded prefill left holes. The prefill (past_seq 0) is the cache-free causal model and is fused
# like it (exporters.kv_cache): GroupQueryAttention on the mha target.
AUTO_TARGET_KV_CACHE = "mha"
# Only the standard Attention op can also output the softmax probabilities.
AUTO_TARGET_RETURNING_WEIGHTS = "onnx"
_RECORDED_PACKAGES = ("mha-deploy", "torch", "onnx", "onnxscript", "onnxruntime-gpu", "onnxruntime")


@dataclass
class ExportResult:
    path: Path
    metadata: ModelMetadata
    parity: ParityReport
    fusion: FusionReport
    # None when the export does not try to pack tokens: --no-pack-tokens, fp16, KV caches, no paddable padding
    # mask, a target other than mha
    packing: PackingReport | None = None
    # Things the user should know that did not stop the export (e.g. auto fell back to no fusion).
    warnings: list[str] = field(default_factory=list)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _RECORDED_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def set_metadata(model: onnx.ModelProto, metadata: ModelMetadata) -> None:
    for prop in list(model.metadata_props):
        if prop.key == METADATA_KEY:
            model.metadata_props.remove(prop)
    model.metadata_props.add(key=METADATA_KEY, value=metadata.to_json())


def write_model_atomically(model: onnx.ModelProto, path: Path) -> None:
    with atomic_path(path) as tmp:
        onnx.save_model(model, tmp)


def auto_fusion_target(signature: Signature) -> str:
    """What ``--fuse auto`` picks: the fastest target measured for the mask mode (``AUTO_TARGETS``), or
    ``onnx`` to return weights. A stack's mask mode is its padding; its causal self-attention is fused
    like a lone causal MHA's."""
    if signature.kv_cache:
        return AUTO_TARGET_KV_CACHE
    return AUTO_TARGET_RETURNING_WEIGHTS if signature.return_weights else AUTO_TARGETS[signature.mask]


def _optimised(
    plain: onnx.ModelProto, target: str, quantize: Quantization, dtype: str, attention_ops: int,
    pack_by: Sequence[str] = (),
    rows_only: Sequence[str] | None = None,
) -> tuple[onnx.ModelProto, FusionReport, PackingReport | None]:
    """``plain`` fused for ``target``, its tokens packed by the padding masks ``pack_by`` (target mha only: onnx
    is the target for CUDA graphs, whose shapes must not depend on the data), quantized and cast as asked;
    ``plain`` itself is left as it was."""
    # fp16 is the CUDA deployment: no short_sequence If there, so that a CUDA graph can capture the mask-free
    # model (pipeline.fuse_attention).
    fused, report = fuse_attention(plain, target, short_sequences=dtype != "float16")
    if not report.complete:
        raise ExportError(
            f"{report.summary()}: --fuse {target} needs every attention subgraph fused; "
            "use --fuse none (or auto) to export the unfused graph"
        )
    if target != "none" and report.fused + len(report.softcapped) != attention_ops:
        raise ExportError(f"{report.summary()}, expected {attention_ops}: the graph holds attentions no rule knows")
    packing = None
    if pack_by and target == "mha":
        fused, packing = pack_model(fused, pack_by, rows_only)
    fused = quantize.apply(fused)
    if dtype == "float16":
        fused = to_float16(fused)
    return fused, report, packing


@dataclass
class FirstCall:
    """A KV-cache model's first call (past_seq 0): the cache-free graph, and how its caches are computed."""

    model: onnx.ModelProto
    projections: list[CacheProjection]


def _cache_projection(source: str, attention: MultiHeadAttention, present_key: str, present_value: str):
    def weights(linear):
        # nn.Linear computes x @ weight.T + bias; a bias-free one adds zeros.
        weight = linear.weight.detach().numpy().T
        bias = linear.bias.detach().numpy() if linear.bias is not None else np.zeros(weight.shape[1], weight.dtype)
        return weight, bias

    return CacheProjection(source, present_key, present_value, *weights(attention.W_k), *weights(attention.W_v))


def _optimised_kv_cache(
    decode: onnx.ModelProto, first: FirstCall, target: str, metadata: ModelMetadata, attention_ops: int
) -> tuple[onnx.ModelProto, FusionReport]:
    """The first call (its ``attention_ops`` attentions) fused for ``target``, its caches attached, behind an
    If on the cache's length; decode calls on contrib MultiHeadAttention with past for ``mha``, on the plain
    graph for ``onnx`` (the target for runtimes without contrib ops) and ``none``. Why:
    ``AUTO_TARGET_KV_CACHE``."""
    signature = metadata.signature
    if target == "mha":
        decode = decode_on_mha(
            decode, metadata.num_heads, MASK_FILL_VALUE, attention_ops, signature.mask_of(signature.query_input),
            signature.mask_of(signature.memory_input),
        )
    fused, report, _ = _optimised(first.model, target, Quantization(), "float32", attention_ops)
    prefill = attach_caches(fused, first.projections, metadata.num_heads, signature.output_names)
    model = prefill_or_decode(prefill, decode, signature.growing_caches[0])
    if metadata.dtype == "float16":
        model = to_float16(model)
    return model, report


def _checked(module, model: onnx.ModelProto, atol, rtol, parity_cases, quantize: Quantization,
             declared: Signature | None = None, layout: str = CACHE_HOLES) -> ParityReport:
    # Parity runs on the in-memory model on the CPU provider, which every
    # machine has, so that a failed check never leaves a file behind. ORT's own
    # graph optimisations stay off so that they cannot mask a bad fusion. A quantized model is judged by its
    # relative error against the fp32 reference instead of atol/rtol (Quantization.rel_budget).
    budget = quantize.rel_budget
    if layout == CACHE_RAGGED:
        # A ragged file's calls break the validator's holes convention (own_kv_cache.PlainRuns).
        session = PlainRuns(model, ModelMetadata.from_props({p.key: p.value for p in model.metadata_props}).signature)
        return check_own_cache_parity(module, declared, session, parity_cases, atol, rtol, layout=layout,
                                      rel_budget=budget)
    session = MHASession(model.SerializeToString(), provider="cpu", optimization="disabled")
    if declared is not None:
        # A user's causal LM with a cache: ``module`` as declared (``declared``, without the cache) is the reference.
        return check_own_cache_parity(module, declared, session, parity_cases, atol, rtol, layout=layout,
                                      rel_budget=budget)
    if session.signature.kv_cache:
        # ``module`` is then the cache-free reference: one causal forward of the whole sequence.
        return check_cache_parity(module, session, parity_cases, atol=atol, rtol=rtol, rel_budget=budget)
    return check_parity(module, session, parity_cases, atol=atol, rtol=rtol, rel_budget=budget)


@dataclass(frozen=True)
class ExportOptions:
    """How to turn a torch graph into the written model (see ``export_mha``)."""

    opset: int = DEFAULT_OPSET
    atol: float | None = None
    rtol: float | None = None
    parity_cases: tuple[ParityCase, ...] | None = None
    fuse: str = "auto"
    # "none", "int4", "int8", "int8-dynamic", or a Quantization with the weight-only options
    quantize: str | Quantization = "none"
    dtype: str = "fp32"
    # Per-token ops on real tokens only (token_packing), where the padding allows it and it pays
    pack_tokens: bool = True
    # A causal LM's --kv-cache file: "last" computes the LM head at each row's last real token only
    # (exporters.last_token_logits), "all" at every position; "auto": last for a causal LM's --kv-cache file (a
    # generator reads nothing else; its first token comes sooner and its logits memory goes), else all
    logits: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "quantize", Quantization.of(self.quantize))

    def check(self) -> None:
        if self.fuse not in FUSE_CHOICES:
            raise ExportError(f"fuse must be one of {', '.join(FUSE_CHOICES)}, got {self.fuse!r}")
        self.quantize.check()
        if self.logits not in LOGITS_CHOICES:
            raise ExportError(f"logits must be one of {', '.join(LOGITS_CHOICES)}, got {self.logits!r}")
        if self.dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise ExportError(
                f"opset {self.opset} is not supported: the exporter writes opsets {MIN_OPSET} to {MAX_OPSET} "
                f"(default {DEFAULT_OPSET})"
            )
        if self.dtype != "fp32" and self.quantize.kind != "none":
            raise ExportError(f"--quantize {self.quantize.kind} quantizes an fp32 model: use it with --dtype fp32")

    @property
    def tolerance(self) -> tuple[float, float]:
        half = self.dtype == "fp16"
        atol = self.atol if self.atol is not None else (FP16_ATOL if half else DEFAULT_ATOL)
        rtol = self.rtol if self.rtol is not None else (FP16_RTOL if half else DEFAULT_RTOL)
        return atol, rtol


def _check_output(output: str | os.PathLike) -> Path:
    output = Path(output)
    if output.suffix != ".onnx":
        raise ExportError(f"output path must end in .onnx, got {output}")
    if output.is_dir():
        raise ExportError(f"output path {output} is a directory")
    return output


def export_mha(
    mha: MultiHeadAttention,
    output: str | os.PathLike,
    signature: Signature | None = None,
    opset: int = DEFAULT_OPSET,
    atol: float | None = None,
    rtol: float | None = None,
    parity_cases: tuple[ParityCase, ...] | tuple[CacheCase, ...] | None = None,
    fuse: str = "auto",
    quantize: str | Quantization = "none",
    dtype: str = "fp32",
    pack_tokens: bool = True,
) -> ExportResult:
    """Export ``mha`` for ``signature``, fuse its attention, check parity against torch, and write ``output``.

    ``fuse``: "mha" (ORT contrib MultiHeadAttention), "onnx" (standard Attention,
    opset 23), "none", or "auto" (``auto_fusion_target``; falls back to
    "none" with a warning when fusion fails or breaks parity).
    ``quantize``: "int4" / "int8" weight-only MatMulNBits, "int8-dynamic" dynamic int8 projections (CPU
    only), or a ``Quantization`` (block size, symmetry, LM head, method); parity then means a relative error
    within the kind's budget (``quantize.REL_ERR_BUDGETS``) instead of atol/rtol, and the file records it.
    ``dtype="fp16"``: fp16 weights and I/O (for CUDA), compared with the fp32
    torch reference at ``FP16_ATOL``/``FP16_RTOL`` unless atol/rtol are given.
    Raises ``ParityError`` (and writes nothing) when ORT and torch disagree
    beyond ``atol + rtol * |reference|`` on any real query position.

    ``signature.kv_cache``: past_key/past_value in, present_key/present_value out, one file for prefill
    (past_seq 0) and decode; parity decodes ``CacheCase`` s call by call against one causal forward of
    the whole sequence in torch.
    """
    signature = signature or Signature()
    options = ExportOptions(opset, atol, rtol, parity_cases, fuse, quantize, dtype, pack_tokens)
    options.check()
    output = _check_output(output)
    module = attention_graph(mha.eval(), signature)
    plain = export_onnx(module, signature, mha.d_model, opset, heads=mha.num_heads)
    metadata = ModelMetadata(d_model=mha.d_model, num_heads=mha.num_heads, signature=signature)
    if not signature.kv_cache:
        return _finish(module, plain, metadata, output, options, attention_ops=1)
    _refuse_quantized_builtin_cache(options.quantize)
    # The cache-free model is both the first call's graph and the reference: one causal forward of the whole
    # sequence.
    reference = attention_graph(mha.eval(), signature.cache_free)
    first = FirstCall(
        export_onnx(reference, signature.cache_free, mha.d_model, opset),
        [_cache_projection(signature.query_input, mha, *signature.cache_pairs.values())],
    )
    return _finish(reference, plain, metadata, output, options, 1, first)


def export_stack(
    stack: Encoder | Decoder, output: str | os.PathLike, mask: str = "padding", kv_cache: bool = False, **options
) -> ExportResult:
    """Export an encoder or decoder stack; each of its attentions is fused like a lone MHA's.

    Inputs: encoder ``x`` (+ ``key_padding_mask``); decoder ``x``, ``memory``
    (+ ``key_padding_mask``, ``memory_padding_mask``). ``options`` as for ``export_mha``.
    ``kv_cache`` (decoders): per layer past_key_values.{i}.key/.value and .encoder_key/.encoder_value in,
    present.{i}.* out (``Signature.cache_pairs``), one file for the first call and the later ones; parity
    decodes ``CacheCase`` s call by call against one forward of the whole target sequence in torch.
    """
    export_options = ExportOptions(**options)
    export_options.check()
    output = _check_output(output)
    graph = stack_graph(stack, mask)
    attention_ops = len(stack.layers) * (1 if isinstance(stack, Encoder) else 2)
    signature = replace(graph.signature, kv_cache=True, layers=len(stack.layers)) if kv_cache else graph.signature
    layer = stack.layers[0]
    attention = layer.self_attn
    metadata = ModelMetadata(
        d_model=attention.d_model,
        num_heads=attention.num_heads,
        signature=signature,
        layers=len(stack.layers),
        d_ff=layer.feed_forward.linear1.out_features,
    )
    if not kv_cache:
        return _finish(graph, export_stack_onnx(graph, export_options.opset), metadata, output, export_options,
                       attention_ops)
    _refuse_quantized_builtin_cache(export_options.quantize)
    prefill, decode = decoder_cache_graphs(stack, signature)
    layer_inputs = prefill.layer_inputs()
    presents = iter(signature.cache_pairs.values())  # per layer: key, value, encoder_key, encoder_value
    projections = []
    for source, layer in zip((signature.query_input, *layer_inputs), stack.layers, strict=True):
        projections.append(_cache_projection(source, layer.self_attn, next(presents), next(presents)))
        projections.append(_cache_projection(signature.memory_input, layer.cross_attn, next(presents), next(presents)))
    first = FirstCall(export_stack_onnx(prefill, export_options.opset, ("output", *layer_inputs)), projections)
    plain = export_stack_onnx(decode, export_options.opset)
    return _finish(graph, plain, metadata, output, export_options, attention_ops, first)


def _refuse_quantized_builtin_cache(quantize: Quantization) -> None:
    if quantize.kind != "none":
        raise ExportError(f"--quantize {quantize.kind} is not available with --kv-cache for the built-in block and "
                          "stacks: export the cache model in fp32 or fp16 (a module of your own with --module takes "
                          "--quantize int4 or int8 with --kv-cache)")


def export_builtin(
    model: MultiHeadAttention | Encoder | Decoder, output: str | os.PathLike, signature: Signature, **options
) -> ExportResult:
    """The one entry point for the built-in models, lone block and stacks alike: ``model`` exported for
    ``signature`` (``model`` "mha": a ``MultiHeadAttention``; "encoder"/"decoder": a stack of that kind, its
    mask mode and cache from the signature). ``options`` as for ``export_mha``. A user's own module goes
    through ``export_model``, which reads its Signature off the module instead."""
    if signature.model == "mha":
        if not isinstance(model, MultiHeadAttention):
            raise ExportError(f"a lone-block signature needs a MultiHeadAttention, got {type(model).__name__}")
        return export_mha(model, output, signature, **options)
    if signature.model == "custom":
        raise ExportError("a custom model's Signature is read off the module: use export_model(module, path, inputs)")
    kind = Encoder if signature.model == "encoder" else Decoder
    if not isinstance(model, kind):
        raise ExportError(f"a --model {signature.model} signature needs a {kind.__name__}, got {type(model).__name__}")
    if signature.kv_cache and signature.layers != len(model.layers):
        raise ExportError(f"the signature's cache has {signature.layers} layers, the stack {len(model.layers)}")
    return export_stack(model, output, mask=signature.mask, kv_cache=signature.kv_cache, **options)


@raises_export_errors
def export_model(
    module: torch.nn.Module,
    output: str | os.PathLike,
    inputs: Sequence[InputDecl | str],
    *,
    output_names: Sequence[str] | None = None,
    checkpoint: str | os.PathLike | None = None,
    max_length: int | None = None,
    kv_cache: bool = False,
    position_ids: bool | None = None,
    generation: GenerationIds | None = None,
    cache_layout: str = CACHE_LAYOUT_AUTO,
    context_length: int | None = None,
    mask_dtype: str = "bool",
    **options,
) -> ExportResult:
    """Export a user's own ``module`` (built around the reference attention) whose forward takes ``inputs``.

    ``inputs``: ``InputDecl`` s or ``"NAME:ROLE[:AXIS][:FEATURES]"`` strings, each passed to the forward's
    parameter of its NAME (any order; parameters not declared keep their defaults), the file's inputs in this
    order; roles ``tokens`` (int64 ids [batch, seq]), ``sequence`` (float [batch, seq, features]) and ``padding-mask``
    ([batch, seq], True/1 = real token; it marks the tokens or sequence input on its axis). Inputs on a second
    length axis (an encoder-decoder's target) name it: ``tgt:tokens:tgt_seq``. ``checkpoint`` is loaded into
    ``module`` strictly first. Every attention is fused as a lone block's is, parity against ``module`` is
    checked at unseen shapes on both padding sides (lengths capped at ``max_length``, for modules with a
    position table), and the Signature read off the module (``own_model.declare_model``) is recorded in the
    file. ``options`` as for ``export_mha``.

    Raises ``ExportError`` (``ParityError`` for parity) and writes nothing when anything fails; a problem
    another layer finds is raised as an ``ExportError`` that is also of that layer's type
    (``errors.as_export_error``: ``SignatureError``, ``CheckpointError``, ``ModelFileError``, ``OutputError``).
    ``module`` is left as it was given (its training mode, buffers and plain attributes), the checkpoint
    loaded into it.

    ``kv_cache``: a causal LM over token ids (one tokens input and its padding mask, logits out) exported with
    a cache per attention for generation (``own_kv_cache``): one file for the prompt and every later step,
    checked call by call against one forward of the whole sequence. ``generation``: the ids a generator needs
    (eos, pad, decoder start), recorded in the file's metadata for ``mha-deploy generate`` and onnxruntime-genai;
    with ``kv_cache`` only, each refused unless below the vocabulary. ``position_ids`` (with ``kv_cache``; None, the
    default: asked for on a causal LM, not on an encoder-decoder): the file takes each row's positions as an input
    (``position_ids`` int64 [batch, seq]) where the module's are a ``Range`` over the sequence indexing a table or
    computed from it (rotary cos/sin), so that rows of different lengths each get what they get alone; when asked
    for explicitly (True), a warning says so when the module's positions are not that. The metadata records how the
    file's positions work either way (``ModelMetadata.positions``).

    ``cache_layout`` (a causal LM with ``kv_cache``): "auto" (the default) writes the ragged layout
    (``fusion.ragged_cache``: GroupQueryAttention updating the cache in place, right padding, each mask probed up to
    the max length, parity checked call by call under that convention) where the file allows it, and otherwise
    the holes layout with a warning saying why;
    "ragged" refuses (writing nothing) where it cannot; "holes" keeps ``past ++ new`` for any padding. Recorded as
    ``ModelMetadata.cache_layout`` (None for holes, which earlier mha-deploy reads).

    ``context_length``: the longest sequence the module takes by its own account (a Hugging Face config's
    ``max_position_embeddings``), recorded as the max length where neither ``max_length`` nor a position table
    gives one: the trace then accepts a length guard that reaches it (M2M100's sinusoidal table, rebuilt past it).

    ``mask_dtype``: what the file's padding masks take: "bool" (the default), or "int64" 1/0 as a Hugging Face
    tokenizer gives them (``export --hf``), cast to bool inside the fused graph (``mask_inputs``); with ``kv_cache``
    an encoder-decoder's source mask (its target's, and a causal LM's, are int64 either way).
    """
    export_options = ExportOptions(**options)
    export_options.check()
    output = _check_output(output)
    if max_length is not None and max_length < 1:
        raise ExportError(f"max length must be at least 1, got {max_length}")
    if position_ids and not kv_cache:
        raise ExportError("position_ids are a KV-cache model's input: export with --kv-cache")
    if cache_layout not in CACHE_LAYOUT_CHOICES:
        raise ExportError(f"cache layout must be one of {', '.join(CACHE_LAYOUT_CHOICES)}, got {cache_layout!r}")
    if cache_layout != CACHE_LAYOUT_AUTO and not kv_cache:
        raise ExportError(f"--cache-layout {cache_layout} is a KV-cache model's: export with --kv-cache")
    if generation is not None:
        if not kv_cache:
            raise ExportError("eos, pad and start ids are a generator's: they are recorded with a KV-cache export "
                              "(--kv-cache), which is what generates")
        generation.check(None)  # the types now; the vocabulary once the trace has made it plain
    if checkpoint is not None:
        load_checkpoint(module, checkpoint)
    kept = ModuleState(module, copy=True)
    try:
        return _export_model(module, output, inputs, output_names, max_length, export_options, kv_cache, generation,
                             position_ids, cache_layout, context_length, mask_dtype)
    except SystemExit as exc:  # the module's own code: it must not end the caller's process with its status
        raise ExportError(f"{type(module).__name__} called sys.exit({exc.code!r}) (SystemExit) while it ran for the "
                          "export: a forward must return its outputs") from exc
    finally:
        kept.restore(module)


def _export_model(
    module, output, inputs, output_names, max_length, export_options, kv_cache, generation=None, position_ids=None,
    cache_layout=CACHE_LAYOUT_AUTO, context_length=None, mask_dtype="bool",
) -> ExportResult:
    # The probes run the module as parity does: with torch's fast path off (reference_form.without_fast_path).
    with without_fast_path():
        declared = declare_model(module, inputs, output_names)
        signature = declared.signature
        max_length = _max_length(max_length, position_tables(declared.wrapper, signature))
    if max_length is None and context_length is not None:
        max_length = context_length
        declared.warnings.append(f"max length {context_length} recorded from the model's config (its "
                                 "max_position_embeddings or max_target_positions: no position table states it; "
                                 "--max-length to record another)")
    seq2seq = seq2seq_tensors(signature) if kv_cache else None
    if export_options.logits == "auto" and (not kv_cache or seq2seq is not None):
        export_options = replace(export_options, logits="all")  # a causal LM's cache file decides (_export_own_cache)
    elif export_options.logits == "last" and (not kv_cache or seq2seq is not None):
        raise ExportError("--logits last is a causal LM's --kv-cache file's (a generator's: the LM head at each row's "
                          "last token only); " + ("an encoder-decoder's decoder keeps every position's" if kv_cache
                                                  else "export with --kv-cache") + ", or drop --logits")
    if export_options.quantize.evaluation is not None and not kv_cache:
        raise ExportError(EVAL_NEEDS_CAUSAL_LM)
    if kv_cache:
        if seq2seq is None:
            lm_tensors(signature)
            max_length, generation = _from_module_config(module, max_length, generation, declared.warnings)
        elif position_ids:
            raise ExportError("--position-ids: an encoder-decoder's positions stay the module's own (each target row "
                              "counted from its first token); drop the flag")
        elif cache_layout == CACHE_RAGGED:
            raise ExportError("--cache-layout ragged: an encoder-decoder's decoder keeps the holes layout (its "
                              "self-attention caches grow by past ++ new); drop the option")
        if export_options.dtype != "fp32":
            raise ExportError("--kv-cache exports a user's module in fp32 for now (or weight-only --quantize int4 or "
                              "int8 from it): drop --dtype")
        if export_options.quantize.evaluation is not None and seq2seq is not None:
            raise ExportError(EVAL_NEEDS_CAUSAL_LM)
        if export_options.quantize.kind == INT8_DYNAMIC:
            raise ExportError("--quantize int8-dynamic with --kv-cache: it quantizes each call's activations with "
                              "one scale over the batch, so a row's tokens would move with its batch-mates; use "
                              "--quantize int8 or int4 (weight-only)")
    try:
        with reference_attention():
            plain = export_onnx(declared.traced, signature, declared.d_model, export_options.opset,
                                plain_rotary=True, max_length=max_length)
            if default_opset(plain) != export_options.opset:
                declared.warnings.append(
                    f"opset {ROTARY_OPSET}, not {export_options.opset}: at opset {export_options.opset} torch writes "
                    "the rotary as ONNX RotaryEmbedding, which ONNX Runtime rejects at batch > 1; at "
                    f"{ROTARY_OPSET} it writes plain ops")
                export_options = replace(export_options, opset=ROTARY_OPSET)
    except ExportError as exc:
        if exc.__cause__ is None:  # already says what was wrong
            raise
        raise trace_failure(exc.__cause__, signature) from exc
    # The vocabulary is the table the ids index in the graph, which the trace has made plain (a bare
    # nn.Parameter, F.embedding, a smaller position table beside it).
    inputs, vocabulary_warnings = graph_vocabularies(signature.custom_inputs, plain)
    signature = replace(signature, custom_inputs=inputs)
    attention_ops = count_attentions(plain)
    if seq2seq is not None:
        result = _export_seq2seq_cache(replace(declared, signature=signature), plain, attention_ops, output,
                                       export_options, max_length, generation, mask_dtype)
        result.warnings[:0] = [*declared.warnings, *vocabulary_warnings]
        return result
    if kv_cache:
        result = _export_own_cache(replace(declared, signature=signature), plain, attention_ops, output,
                                   export_options, max_length, generation, position_ids, cache_layout)
        result.warnings[:0] = [*declared.warnings, *vocabulary_warnings]
        return result
    d_model, heads = widest_attention(plain, declared.d_model)
    if mask_dtype != "bool":
        signature = signature.with_mask_dtype(mask_dtype)
    metadata = ModelMetadata(d_model=d_model, num_heads=heads, signature=signature, layers=max(attention_ops, 1),
                             max_length=max_length)
    cases = export_options.parity_cases or capped_cases(default_cases(signature), max_length)
    export_options = replace(export_options, parity_cases=cases)
    result = _finish(declared.wrapper, plain, metadata, output, export_options, attention_ops)
    result.warnings[:0] = [*declared.warnings, *vocabulary_warnings]
    return result


def _export_own_cache(
    declared: Declared, plain: onnx.ModelProto, attention_ops: int, output: Path, options: ExportOptions,
    max_length: int | None,
    generation: GenerationIds | None = None,
    position_ids: bool | None = None,
    cache_layout: str = CACHE_LAYOUT_AUTO,
) -> ExportResult:
    """``export_model`` with ``kv_cache``: ``plain`` rewired to take and return a cache per attention, in the
    ragged layout where ``cache_layout`` and the file allow it."""
    notes = _check_generation_ids(generation, declared.signature)
    layers = find_attention_caches(plain, attention_ops, grouped=True)
    if len({(layer.heads, layer.head_dim) for layer in layers}) > 1:
        raise ExportError("--kv-cache: the attentions differ in heads or head size; one cache shape is supported")
    signature = cache_signature(declared.signature, layers)
    cached, signature, refused = narrowed_own_caches(
        attach_own_caches(plain, declared.signature, signature, layers), signature, max_length,
        position_ids is not False)
    heads, head_dim = layers[0].heads, layers[0].head_dim
    if options.logits == "auto":  # last where the pass finds the LM head, else every position, said in a note
        why_not = lm_head_refusal(cached)
        options = replace(options, logits="last" if why_not is None else "all")
        if why_not is not None:
            notes.append(f"--kv-cache: logits at every position, not each row's last token only ({why_not})")
    if options.logits == "last":  # rewritten after fusion (_finish), so that every fusion sees the module's graph
        signature = last_token_signature(signature)
    metadata = ModelMetadata(d_model=heads * head_dim, num_heads=heads, signature=signature, layers=len(layers),
                             max_length=max_length, generation=generation,
                             positions=positions_kind(cached, signature, max_length))
    if POSITION_IDS in signature.tensors and metadata.positions != POSITIONS_INPUT:
        notes.append(f"--kv-cache: the file takes position_ids, yet a row's logits move with its padding given its own "
                     f"(positions: {metadata.positions}): rows share a batch only with rows of their length")
    elif position_ids and metadata.positions != POSITIONS_INPUT:
        notes.append(f"--position-ids: not offered, the module's positions are not a Range over the sequence or a "
                     f"count of the mask's tokens indexing a table or computed from it (positions: "
                     f"{metadata.positions})")
    ragged = None
    if cache_layout != CACHE_HOLES:
        why_not = _why_not_ragged(metadata.positions, refused)
        if why_not is None:
            ragged = RaggedRequest(options.parity_cases or capped_cache_cases(RAGGED_CACHE_CASES, max_length),
                                   required=cache_layout == CACHE_RAGGED)
        elif cache_layout == CACHE_RAGGED:
            raise ExportError(f"--cache-layout ragged: {why_not}; export with --cache-layout holes (or auto)")
        else:
            notes.append(f"--kv-cache: holes cache layout, not ragged ({why_not})")
    cases = options.parity_cases or capped_cache_cases(OWN_CACHE_CASES, max_length)
    # Token packing gathers the real tokens of one call's mask; a cache's mask spans calls.
    options = replace(options, parity_cases=cases, pack_tokens=False)
    result = _finish(declared.wrapper, cached, metadata, output, options, attention_ops, declared=declared.signature,
                     ragged=ragged)
    result.warnings.extend(notes)
    if refused:
        result.warnings.append(f"--kv-cache: each step runs the whole sequence's forward ({refused})")
    return result


class RaggedLayoutError(ExportError):
    """``--cache-layout ragged`` asked for and not possible: nothing is written."""


@dataclass(frozen=True)
class RaggedRequest:
    """A causal LM's cache to try in the ragged layout: its parity ``cases`` under that convention, and whether
    a refusal stops the export (``--cache-layout ragged``) or keeps the holes layout with a warning."""

    cases: tuple[CacheCase, ...]
    required: bool = False


def _why_not_ragged(positions: str | None, narrowing_refused: str | None) -> str | None:
    """Why a causal LM's cache file cannot take the ragged layout, before any graph is tried; None if it may."""
    if narrowing_refused:
        return f"each step runs the whole sequence's forward: {narrowing_refused}"
    if positions not in (POSITIONS_INPUT, POSITIONS_NONE):
        return (f"positions {positions}: the module counts them over the padded batch's columns, which right "
                "padding shifts; only a module whose positions are an arange into a table, or rotary, takes "
                "position_ids")
    return None


def _export_seq2seq_cache(
    declared: Declared, plain: onnx.ModelProto, attention_ops: int, output: Path, options: ExportOptions,
    max_length: int | None, generation: GenerationIds | None, mask_dtype: str = "bool",
) -> Seq2SeqExportResult:
    """``export_model`` with ``kv_cache`` for an encoder-decoder: two files, the encoder beside ``output``."""
    if generation is not None:
        target = seq2seq_tensors(declared.signature).target
        generation.check(target.vocab)
    if options.fuse not in ("auto", "mha", "none"):
        raise ExportError(f"--kv-cache for an encoder-decoder fuses for the mha target (or none), not {options.fuse}")
    cases = options.parity_cases or None
    built = build_seq2seq_cache(declared.wrapper, declared.signature, plain, attention_ops, max_length, cases,
                                *options.tolerance, fuse=options.fuse, quantize=options.quantize,
                                pad_id=generation.pad_token_id if generation is not None else None,
                                source_mask_dtype=mask_dtype)
    return write_seq2seq_pair(built, output, generation, max_length)


def _check_generation_ids(generation: GenerationIds | None, signature: Signature) -> list[str]:
    """Refuse recorded ids past the vocabulary (the smaller of the ids' embedding table and the logits' width,
    where the graph states them), before the parity run; the warnings to print about the ones kept."""
    if generation is None:
        return []
    tokens, _, logits = lm_tensors(signature)
    width = logits.axes[-1] if isinstance(logits.axes[-1], int) else None
    sizes = [size for size in (tokens.vocab, width) if size is not None]
    generation.check(min(sizes, default=None))
    if generation.decoder_start_token_id is not None:
        # A causal LM starts from its prompt (an encoder-decoder's export records the id: _export_seq2seq_cache).
        return [f"decoder start id {generation.decoder_start_token_id} recorded, but this causal LM starts from its "
                "prompt: generate does not use it (onnxruntime-genai's config gets it as bos_token_id)"]
    return []


def _from_module_config(module, max_length: int | None, generation: GenerationIds | None,
                        notes: list[str]) -> tuple[int | None, GenerationIds | None]:
    """A causal LM's max length and generation ids where neither the caller nor a position table gave them, from its
    Hugging Face config: ``max_position_embeddings`` (a rotary model's context, which no table states), and the eos,
    pad and bos ids of its generation config, else of its config, each one not given (onnxruntime-genai stops at the
    pad id when no eos is recorded; the bos goes to its config only); a line in ``notes`` for each taken."""
    config = getattr(module, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    if max_length is None and type(context) is int and context > 0:
        max_length = context
        notes.append(f"max length {context} recorded from the module's config (max_position_embeddings; --max-length "
                     "to record another)")
    sources = [getattr(module, "generation_config", None), config]
    given = generation if generation is not None else GenerationIds()
    eos = [] if given.eos_token_ids else _first_ids(sources, "eos_token_id")
    pad = [] if given.pad_token_id is not None else _first_ids(sources, "pad_token_id")[:1]
    bos = config_bos_id(sources) if given.bos_token_id is None else None
    if eos or pad or bos is not None:
        generation = replace(given, eos_token_ids=eos or given.eos_token_ids,
                             pad_token_id=pad[0] if pad else given.pad_token_id,
                             bos_token_id=bos if bos is not None else given.bos_token_id)
        taken = GenerationIds(eos, pad[0] if pad else None, bos_token_id=bos).describe()
        if not eos:
            taken = taken.removeprefix("no eos, ")
        notes.append(f"{taken} recorded from the module's config (--eos-id, --pad-id, --start-id to record others)")
    return max_length, generation


def config_bos_id(sources) -> int | None:
    """A decoder-only model's bos id from the first of ``sources`` (a generation config, a config) naming one, where
    it is inside the config's vocabulary: only onnxruntime-genai's config takes it, so an id a config names by
    default past a small vocabulary is left out rather than refusing the export."""
    ids = _first_ids(sources, "bos_token_id")
    vocab = next((size for source in sources if type(size := getattr(source, "vocab_size", None)) is int), None)
    return ids[0] if ids and (vocab is None or ids[0] < vocab) else None


def _first_ids(sources, name: str) -> list[int]:
    """The token ids ``name`` holds in the first of ``sources`` that names any."""
    return next((ids for source in sources if (ids := _token_ids(getattr(source, name, None)))), [])


def _token_ids(value) -> list[int]:
    """A config's token id or ids as a list, without None or anything else that is not a token id."""
    values = value if isinstance(value, list | tuple) else [value]
    return [v for v in values if type(v) is int and v >= 0]


def _max_length(given: int | None, tables) -> int | None:
    """The max length to record: ``given`` (--max-length), else the shortest position table's; a given one
    longer than a table takes is refused (ONNX Runtime would index past the table)."""
    shortest = min(tables, key=lambda table: table.max_length, default=None)
    if given is None or shortest is None:
        return given if shortest is None else shortest.max_length
    if given > shortest.max_length:
        raise ExportError(
            f"--max-length {given} is longer than the module's position table {shortest.name} takes "
            f"({shortest.max_length} positions): give at most {shortest.max_length}, or leave it out"
        )
    return given


def widest_attention(plain: onnx.ModelProto, width: int) -> tuple[int, int]:
    """(d_model, heads) of a user's model: its widest attention's, read off the unfused graph's head splits
    (d_model is the attention's width, which the inputs' need not be); (``width``, 1) when none is found."""
    heads, d_k = max(head_splits(plain), key=lambda split: (split[0] * split[1], split[0]), default=(1, 0))
    return heads * d_k or width, heads


def capped_cases(cases: Sequence[ParityCase], max_length: int | None) -> tuple[ParityCase, ...]:
    """``cases`` with every length at most ``max_length``."""
    if max_length is None:
        return tuple(cases)
    return tuple(replace(c, q_len=min(c.q_len, max_length), kv_len=min(c.kv_len, max_length)) for c in cases)


def _check_loads(model: onnx.ModelProto, output: Path) -> None:
    """Refuse to write a file that ``MHASession``, ``infer``, ``serve`` and ``triton`` would refuse to load."""
    try:
        check_model_before_writing(model, output)
    except ModelFileError as exc:
        problem = getattr(exc, "problem", None) or first_line(exc)
        raise ModelFileExportError(
            f"{output}: {problem}; the load check every session runs would refuse the file, so nothing was "
            "written (a fault of the export: please report it)"
        ) from exc


def _finish(
    module,
    plain: onnx.ModelProto,
    metadata: ModelMetadata,
    output: Path,
    options: ExportOptions,
    attention_ops: int,
    first_call: FirstCall | None = None,
    declared: Signature | None = None,
    ragged: RaggedRequest | None = None,
) -> ExportResult:
    """Fuse, quantize or cast, check parity against ``module``, record metadata, and write ``output``.

    ``first_call`` (KV-cache models): the graph of the first call (``plain`` is then the later calls'), the
    two joined by ``_optimised_kv_cache``. ``declared``: a user's causal LM with a cache (``own_kv_cache``),
    ``module`` its cache-free forward taking ``declared``'s inputs; ``ragged``: its fused graph tried in the
    ragged layout first (``fusion.ragged_cache``), checked under that layout's convention.
    """
    if options.logits == "last" and not metadata.signature.last_token_outputs:
        raise ExportError("--logits last is a causal LM's --kv-cache file's (export --module or --hf with --kv-cache)")
    metadata.dtype = DTYPES[options.dtype]
    metadata.opset = options.opset
    metadata.versions = package_versions()
    set_metadata(plain, metadata)
    atol, rtol = options.tolerance
    warnings: list[str] = []
    target = auto_fusion_target(metadata.signature) if options.fuse == "auto" else options.fuse
    # fp16 is the CUDA deployment, whose graphs keep static shapes for CUDA graph capture (no NonZero).
    pack_by = packing_masks(metadata.signature) if options.pack_tokens and metadata.dtype != "float16" else []

    ragged_notes: list[str] = []  # the last build's: why it kept the holes layout

    def build(fuse_target: str, pack: Sequence[str]):
        ragged_notes.clear()
        metadata.cache_layout = None
        if first_call is not None:
            model, fusion = _optimised_kv_cache(plain, first_call, fuse_target, metadata, attention_ops)
            packing = None
        else:
            model, fusion, packing = _optimised(
                plain, fuse_target, options.quantize, metadata.dtype, attention_ops, pack,
                metadata.signature.per_token_outputs)
            if metadata.signature.last_token_outputs:
                model = logits_at_last_token(model)
            model = masks_as_declared(model, metadata.signature)
        if ragged is not None:
            tried = build_ragged(model, fusion, fuse_target)
            if tried is not None:
                return tried
        return model, fusion, packing, _checked(module, model, atol, rtol, options.parity_cases, options.quantize,
                                                declared)

    def build_ragged(fused: onnx.ModelProto, fusion: FusionReport, fuse_target: str):
        """``fused`` (the holes file) rewritten into the ragged layout, its parity checked; None (the reason noted)
        where it cannot be."""
        try:
            if fuse_target != "mha":
                raise RaggedRefused(f"--fuse {fuse_target}: GroupQueryAttention is a contrib op of the mha target")
            model = to_ragged_cache(fused, max_length=metadata.max_length)
        except RaggedRefused as exc:
            why = str(exc)
        else:
            # Rotary in the op, q/k/v packed, checked: a pass that breaks parity is left out, not the layout.
            model, report, notes = fuse_into_gqa_checked(
                model, metadata.max_length,
                lambda candidate: _checked(module, candidate, atol, rtol, ragged.cases, options.quantize, declared,
                                           CACHE_RAGGED))
            ragged_notes.extend(f"--kv-cache: {note}" for note in notes)
            if report.passed:
                metadata.cache_layout = CACHE_RAGGED
                return model, fusion.in_ragged_layout(model), None, report
            why = f"its parity failed: {'; '.join(report.failures[:2]) or report.summary()}"
        if ragged.required:
            raise RaggedLayoutError(f"--cache-layout ragged: {why}; nothing written")
        ragged_notes.append(f"--kv-cache: holes cache layout, not ragged ({why})")
        return None

    def build_packed(fuse_target: str):
        # Packing is exact on every real row; a model that reads its padded rows where no mask zeroes them
        # would fail parity with it, and then gets the fused graph as it is.
        try:
            model, fusion, packing, report = build(fuse_target, pack_by)
            if report.passed or packing is None or not packing.runs:
                return model, fusion, packing, report
            why = report.summary()
        except (ExportError, ParityError) as exc:
            if not pack_by or fuse_target != "mha":
                raise
            why = first_line(str(exc))
        # raises when packing was not what failed (the fusion itself): the caller says so
        unpacked = build(fuse_target, [])
        warnings.append(f"token packing not used ({why})")
        return unpacked

    try:
        model, fusion, packing, report = build_packed(target)
        if not report.passed and options.fuse == "auto" and target != "none":
            raise ParityError(report.summary())
    except (ExportError, ParityError) as exc:
        if options.fuse != "auto" or isinstance(exc, RaggedLayoutError):  # unfused, there is no ragged layout
            raise
        warnings.append(f"--fuse auto: {target} fusion not used ({exc}); exported the unfused graph")
        model, fusion, packing, report = build("none", [])
    if not report.passed:
        raise ParityError(f"{report.summary()}; failures: {'; '.join(report.failures[:5])}; nothing written")
    warnings.extend(ragged_notes)
    metadata.fusion = fusion.target
    metadata.quantization = options.quantize.kind
    metadata.weight_only = options.quantize.record(model)
    if options.quantize.evaluation is not None:
        # The perplexity reads every position's logits: the file's graph with the LM head on all of them.
        metadata.weight_only = options.quantize.evaluate(metadata.weight_only, module, declared,
                                                         logits_at_every_position(model), metadata)
    metadata.parity = report
    if metadata.signature.model == "custom":
        # A user's model: the most heads one of its attentions splits into, as the written graph states them
        # (its fused ops' num_heads; the unfused graph's head splits), which is what a load checks it against.
        metadata.num_heads = max(graph_heads(model, metadata.d_model), default=metadata.num_heads)
    set_metadata(model, metadata)
    _check_loads(model, output)
    write_model_atomically(model, output)
    return ExportResult(output, metadata, report, fusion, packing, warnings)
