"""``fuse_attention``: every reference-MHA subgraph of a model -> one attention op.

The chain, per target (own rules marked *, the rest is upstream
``onnxscript.rewriter.ort_fusions``):

    * sdpa_from_attention     standard Attention over 4-D Q/K/V (torch's F.scaled_dot_product_attention)
                              -> SDPA (private op) with an additive mask, so upstream's mha takes it
    * batched_heads           heads folded into the batch for torch.bmm (DeBERTa-v2) -> 4-D again
    * masked_fill_bias        Where-masked scores -> additive bias, so upstream matches
    * score_bias_sum          two biases added to the scores (T5: position bias, mask) -> their sum added
    * shared_heads            a head-split Transpose several attentions read -> one copy each
      sdpa                    MatMul/scale/(Add mask)/Softmax/MatMul -> SDPA (private op)
    * head_merge_view         heads merged straight into [batch * seq, d] (GPT-2's Conv1D) -> merged
                              to [batch, seq, d] first, so that mha takes the right Reshape
      mha                     SDPA + head split/merge -> com.microsoft.MultiHeadAttention
    * bias_axes               a bias upstream left without its key axis -> Expanded to [*, *, q, kv]
    mha:
    * projection_shape        keeps upstream's mask Expand from blocking the bias fusion
      mha_bias                fold q/k/v projection biases into the op
      attention (packed_qkv)  self-attention MHA -> com.microsoft.Attention (packed weights)
    * native_mask             float bias -> key_padding_mask / mask_index + unidirectional, when
                              mask_analysis reads it as key padding and/or causal (else it stays)
    * finite_bias             a float bias native_mask left -> Max(bias, finite fill): a -inf bias
                              gives NaN on a row with no visible key in the contrib kernels
    * short_sequence          MHA, mask-free, with key_padding_mask or causal (self-attention)
                              -> If(kv_len <= 256 and scores <= 64 MB, standard Attention
                              (additive attn_mask, is_causal), MHA): its materialising kernel
                              is the faster one on short sequences; key bias dropped, value
                              bias moved to the output (not for fp16 exports, made for CUDA,
                              where the If would stop CUDA graph capture)
    * causal_gqa              causal MHA (in short_sequence's long branch) -> If(scores <= 64 MB,
                              GroupQueryAttention materialising them, GroupQueryAttention
                              tiled); when a token is padded, real tokens compacted to the
                              front in the graph (any side) and cut to the longest row
    * padding_flash           MHA with key_padding_mask (in short_sequence's long branch) ->
                              If(any key padded, keys gathered real-first and cut to the
                              longest row: mask-free MHA if every row fills the cut, else
                              masked MHA; mask-free MHA: ORT's CPU flash path)
    * output_bias             a bias added before the output projection -> folded into its bias
    * head_round_trip         the op's output split into heads and merged back (ViT's permute, view,
                              permute) -> the op's output read as it is
    onnx:
    * onnx_attention          MHA -> standard Attention (float attn_mask, is_causal)
    then, on either target, after the attentions (their patterns see the graph as torch wrote it):
    * (softcap)               a soft-capped attention (Gemma-2: tanh(scores / cap) * cap) stays as
                              the module wrote it, named in the report: no op of either target
                              caps scores, save GroupQueryAttention in the ragged cache layout
                              (fusion.softcap, fusion.ragged_cache)
    * norms                   RMSNorm -> SimplifiedLayerNormalization, with its residual Add ->
                              com.microsoft.SkipSimplifiedLayerNormalization (mha); -> ONNX
                              RMSNormalization (onnx)

The onnx target keeps the causal flag on standard ``Attention`` instead of taking
causal_gqa: GroupQueryAttention is an ORT contrib op, and that target exists for
runtimes and providers without them (ORT's CUDA provider has no fp32
GroupQueryAttention kernel, it takes standard Attention in fp32). On ORT's CPU
provider it is the slower choice for every mask mode (the table in
``mha_deploy.exporters.export``), so ``--fuse auto`` does not pick it.

When attentions stay unfused, the rules that start from a Softmax are run again
with the rewriter's match tracing, and the checks that failed on those
attentions go into the report (``FusionReport.unfused_reasons``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.attention import fuse_attention as fuse_packed_attention
from onnxscript.rewriter.ort_fusions.mha import fuse_mha2
from onnxscript.rewriter.ort_fusions.mha_bias import fuse_mha_bias
from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa, sdpa_rules
from onnxscript.rewriter.ort_fusions.sdpa_via_mha import replace_sdpa_by_mha

from mha_deploy.errors import ExportError
from mha_deploy.exporters.fusion.batched_heads import fuse_batched_heads
from mha_deploy.exporters.fusion.bias_axes import fuse_bias_axes
from mha_deploy.exporters.fusion.cache_heads import fuse_cache_heads
from mha_deploy.exporters.fusion.causal_gqa import fuse_causal_gqa
from mha_deploy.exporters.fusion.finite_bias import fuse_finite_bias
from mha_deploy.exporters.fusion.head_merge_view import fuse_head_merge_view
from mha_deploy.exporters.fusion.head_round_trip import drop_mha_round_trips
from mha_deploy.exporters.fusion.masked_fill_bias import fuse_masked_fill_bias, masked_fill_bias_rules
from mha_deploy.exporters.fusion.native_mask import fuse_native_mask
from mha_deploy.exporters.fusion.norms import fuse_norms, norm_ops
from mha_deploy.exporters.fusion.onnx_attention import fuse_onnx_attention
from mha_deploy.exporters.fusion.onnx_attention_weights import (
    fuse_onnx_attention_weights,
    onnx_attention_weights_rules,
)
from mha_deploy.exporters.fusion.output_bias import fuse_output_bias
from mha_deploy.exporters.fusion.padding_flash import fuse_padding_flash
from mha_deploy.exporters.fusion.projection_shape import fuse_projection_shape
from mha_deploy.exporters.fusion.score_bias_sum import fuse_score_bias_sum, score_bias_sum_rules
from mha_deploy.exporters.fusion.sdpa_from_attention import (
    fuse_sdpa_from_attention,
    is_torch_attention,
    sdpa_from_attention_rules,
)
from mha_deploy.exporters.fusion.shared_heads import unshare_head_transposes
from mha_deploy.exporters.fusion.short_sequence import fuse_short_sequence
from mha_deploy.exporters.fusion.softcap import softcapped_attention
from mha_deploy.model_report import MASK_NOT_RECOGNISED, attention_ops
from mha_deploy.onnx_nodes import WINDOW_MASK

FUSION_TARGETS = ("mha", "onnx", "none")
# ORT 1.31 rejects IR version 14; 10 is what it accepts for opset 23.
MAX_IR_VERSION = 10
MIN_ONNX_ATTENTION_OPSET = 23
_FUSION_DOMAIN = "ai.onnxruntime._fusion"
# Why a window mask stays a materialised bias: MultiHeadAttention takes no window, GroupQueryAttention's
# local_window_size is a causal one (keys behind the query only; not used here yet).
_WINDOW_WHY = "materialised: MultiHeadAttention takes no window, GroupQueryAttention's is causal only"
# The mask inputs worth reporting; the ops a fusion produces and their input
# roles are the ones `mha-deploy inspect` knows (model_report).
_MASK_ROLES = {"key_padding_mask", "attention_bias", "mask_index", "attn_mask", "seqlens_k"}
# Ops that sit between the scores MatMul and the Softmax in an attention subgraph (Reshape: DeBERTa's
# [batch * heads, q, kv] scores viewed as [batch, heads, q, kv]; Tanh: Gemma-2's soft-capped scores, which no rule
# fuses but a cache is attached to like any other, fusion.softcap).
_SCORE_OPS = {"Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Tanh"}


@dataclass
class FusedOp:
    """One attention op in the fused model."""

    op_type: str  # "com.microsoft.MultiHeadAttention", "Attention", ...
    name: str
    # Which mask inputs the op reads (input role -> tensor name); empty when unmasked.
    mask_inputs: dict[str, str] = field(default_factory=dict)
    attributes: dict[str, object] = field(default_factory=dict)
    # Which ORT CPU kernel runs it, e.g. "MultiHeadAttention (flash)" (model_report).
    kernel: str = ""

    def describe(self) -> str:
        """One line, e.g. ``com.microsoft.GroupQueryAttention(num_heads=8, kv_num_heads=8)``, then the kernel
        (``-> GroupQueryAttention (causal; ...)``)."""
        attributes = ", ".join(
            f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in sorted(self.attributes.items())
        )
        masks = ", ".join(self.mask_inputs) or "no mask"
        return f"{self.op_type}({masks}; {attributes})" + (f" -> {self.kernel}" if self.kernel else "")


@dataclass
class FusionReport:
    """What ``fuse_attention`` found and did."""

    target: str
    # Attentions in the input model: subgraphs (Softmax over MatMul scores) and standard Attention ops
    # over 4-D Q/K/V (torch's F.scaled_dot_product_attention).
    found: int
    remaining: int  # of those, how many are still in the output model (unfused)
    ops: list[FusedOp] = field(default_factory=list)
    rule_counts: dict[str, int] = field(default_factory=dict)
    # Rule -> why it did not match the attentions left unfused: the checks that failed or,
    # when no check was reached, where the pattern stopped. Empty when nothing is left.
    unfused_reasons: dict[str, list[str]] = field(default_factory=dict)
    # Each attention left unfused: its Softmax's or standard Attention's node name, e.g.
    # "node_scaled_dot_product_attention (Attention)" (torch names nodes after the torch op).
    unfused_names: list[str] = field(default_factory=list)
    # The fused norm ops in the output model by ``domain.Op`` (fusion.norms), e.g.
    # {"SimplifiedLayerNormalization": 1, "com.microsoft.SkipSimplifiedLayerNormalization": 4}.
    norms: dict[str, int] = field(default_factory=dict)
    # Softmaxes over the product of two activations whose probabilities meet a third, that no rule reads as an
    # attention (``unrecognised_attentions``): "node_softmax (between scores and Softmax: Div, Tanh, Mul, Add)".
    unrecognised: list[str] = field(default_factory=list)
    # The attentions left unfused because their scores are soft-capped (fusion.softcap), which no op of the target
    # does: "node_softmax (cap 50)". Counted in ``remaining``; the file is exact, and the report's warning says so.
    softcapped: list[str] = field(default_factory=list)

    @property
    def fused(self) -> int:
        return len(self.ops)

    @property
    def complete(self) -> bool:
        """True when every attention subgraph became one attention op, save soft-capped ones, which no op of the
        target can take (or the target is "none")."""
        capped = len(self.softcapped)
        return self.target == "none" or (self.remaining == capped and self.fused + capped == self.found)

    def in_ragged_layout(self, model: onnx.ModelProto) -> FusionReport:
        """This report for ``model``, the ragged cache layout written from the file it describes, where that layout
        fused what this one could not (soft-capped attentions onto GroupQueryAttention's softcap); itself otherwise
        (the ragged rewrite changes only which op each fused attention is)."""
        if not self.softcapped:
            return self
        return replace(self, remaining=0, ops=_fused_ops(model, []), unfused_names=[], unfused_reasons={},
                       softcapped=[])

    def summary(self) -> str:
        """One line, e.g. ``fusion mha: 1 attention subgraph(s) found, 0 fused, 1 left unfused
        (masked_fill_bias: fill -1.0 is not a masking value (needs <= -10000))``, with the unfused
        attentions' nodes named before the count (``not fused: node_softmax (Softmax); 1 left unfused``), and the
        norms fused after (``; RMSNorm fused into 1 SimplifiedLayerNormalization, 4
        com.microsoft.SkipSimplifiedLayerNormalization``)."""
        kinds = sorted({op.op_type for op in self.ops})
        reasons = "; ".join(f"{rule}: {' / '.join(why)}" for rule, why in self.unfused_reasons.items())
        unread = len(self.unrecognised_masks)
        windows = sum(WINDOW_MASK in op.kernel for op in self.ops)
        return (
            f"fusion {self.target}: {self.found} attention subgraph(s) found, {self.fused} fused"
            f"{' into ' + ', '.join(kinds) if kinds else ''}, "
            f"{'not fused: ' + ', '.join(self.unfused_names) + '; ' if self.unfused_names else ''}"
            f"{self.remaining} left unfused"
            f"{f' ({len(self.softcapped)} soft-capped: {_SOFTCAP_WHY})' if self.softcapped else ''}"
            f"{f' ({reasons})' if reasons else ''}"
            f"{f'; {unread} with a {MASK_NOT_RECOGNISED} (materialised)' if unread else ''}"
            f"{f'; {windows} with a {WINDOW_MASK} as attention_bias ({_WINDOW_WHY})' if windows else ''}"
            f"{'; RMSNorm fused into ' + ', '.join(f'{n} {op}' for op, n in self.norms.items()) if self.norms else ''}"
        )

    @property
    def warning(self) -> str | None:
        """What the export says when the graph holds attentions it runs as plain ops though they are attentions:
        soft-capped ones (``softcapped``), and ones no rule recognised (``unrecognised``); None when neither. The
        file is exact either way."""
        lines = []
        if self.softcapped:
            more = " ..." if len(self.softcapped) > 3 else ""
            lines.append(f"{len(self.softcapped)} soft-capped attention(s) left unfused, as exported "
                         f"({_SOFTCAP_WHY}): {'; '.join(self.softcapped[:3])}{more}")
        if self.unrecognised:
            lines.append(f"{len(self.unrecognised)} softmax(es) over a product of activations look like attention but "
                         f"match no fusion rule, so they run unfused as exported: {'; '.join(self.unrecognised[:3])}"
                         f"{' ...' if len(self.unrecognised) > 3 else ''}")
        return "; ".join(lines) or None

    @property
    def unrecognised_masks(self) -> list[str]:
        """The fused ops whose mask was not read as key padding or causal: they add a float attention_bias
        (one read as a bias that masks nothing, a position bias, is not counted)."""
        return [op.name for op in self.ops if MASK_NOT_RECOGNISED in op.kernel]


def _score_nodes(softmax: ir.Node, ops: frozenset[str] | set[str] = _SCORE_OPS, steps: int = 6) -> list[ir.Node] | None:
    """The nodes from ``softmax``'s input back to the scores MatMul (included), through at most ``steps`` nodes of
    ``ops``; None without such a MatMul."""
    nodes: list[ir.Node] = []
    value = softmax.inputs[0]
    for _ in range(steps):
        producer = value.producer() if value is not None else None
        if producer is None:
            return None
        nodes.append(producer)
        if producer.op_type == "MatMul":
            return nodes
        if producer.op_type not in ops:
            return None
        # Walk towards the scores: the operand that is not a constant/mask.
        value = producer.inputs[2] if producer.op_type == "Where" else producer.inputs[0]
    return None


def _is_attention_softmax(node: ir.Node) -> bool:
    """A Softmax over MatMul scores whose probabilities feed a MatMul: the heart of an attention."""
    if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or _score_nodes(node) is None:
        return False
    consumers = [use.node for use in node.outputs[0].uses()]
    return any(c.op_type == "MatMul" for c in consumers) or any(
        c.op_type in ("Where", "Reshape") and any(u.node.op_type == "MatMul" for u in c.outputs[0].uses())
        for c in consumers
    )


# Between the scores and the Softmax of attentions no rule knows (a Transpose of the scores).
_LOOSE_SCORE_OPS = _SCORE_OPS | {"Transpose"}
# Why a soft-capped attention stays unfused outside the ragged cache layout.
_SOFTCAP_WHY = ("MultiHeadAttention has no softcap; the ragged cache layout of --kv-cache puts them on "
                "GroupQueryAttention's")


def _activation(value: ir.Value | None) -> bool:
    """Computed from the graph's inputs, not a weight: neither a constant nor an initializer."""
    if value is None or value.const_value is not None:
        return False
    producer = value.producer()
    return producer is None or producer.op_type != "Constant"


def unrecognised_attentions(model: ir.Model) -> list[str]:
    """Softmaxes that look like an attention's, the ops between their scores and them, where no rule reads an
    attention: the Softmax reads (through elementwise ops) a MatMul of two activations, and its probabilities feed
    a MatMul. A classifier's softmax over logits (a MatMul with a weight) is not one."""
    found = []
    for node in model.graph.all_nodes():
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or _is_attention_softmax(node):
            continue
        scores = _score_nodes(node, _LOOSE_SCORE_OPS, steps=8)
        if scores is None or not all(_activation(x) for x in scores[-1].inputs):
            continue
        if {use.node.op_type for use in node.outputs[0].uses()} & {"MatMul", "Cast", "Where"}:
            between = ", ".join(n.op_type for n in reversed(scores[:-1])) or "nothing"
            found.append(f"{node.name or '(unnamed)'} (between scores and Softmax: {between})")
    return found


def attention_softmaxes(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph.all_nodes() if _is_attention_softmax(node)]


def unfused_attentions(model: ir.Model) -> list[ir.Node]:
    """The attentions no target op carries yet: reference-pattern Softmaxes, and torch's standard
    ``Attention`` over 4-D Q/K/V (``F.scaled_dot_product_attention``)."""
    return [node for node in model.graph.all_nodes() if _is_attention_softmax(node) or is_torch_attention(node)]


def _fused_ops(model: onnx.ModelProto, unfused: list[ir.Node]) -> list[FusedOp]:
    """One entry per fused attention, as ``mha-deploy inspect`` reads them (an If over two ops is one); the
    ``unfused`` standard Attention ops left as torch exported them are not."""
    unfused_queries = {node.inputs[0].name for node in unfused if is_torch_attention(node)}
    ops = []
    for info in attention_ops(list(model.graph.node), {t.name: t for t in model.graph.initializer}):
        if info.op == "Attention" and info.inputs.get("Q") in unfused_queries:
            continue
        masks = {role: name for role, name in info.inputs.items() if role in _MASK_ROLES}
        attributes = {k: list(v) if isinstance(v, tuple) else v for k, v in info.attributes.items()}
        ops.append(FusedOp(info.op.replace("::", "."), info.name, masks, attributes, info.kernel))
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


def _run_chain(model: ir.Model, target: str, packed_qkv: bool, short_sequences: bool) -> dict[str, int]:
    counts = {}
    counts["sdpa_from_attention"] = fuse_sdpa_from_attention(model)
    counts["batched_heads"] = fuse_batched_heads(model)
    counts["masked_fill_bias"] = fuse_masked_fill_bias(model)
    counts["score_bias_sum"] = fuse_score_bias_sum(model)
    counts["shared_heads"] = unshare_head_transposes(model)
    # sdpa and onnx_attention_weights check the shapes of values this rule created.
    common_passes.ShapeInferencePass()(model)
    if target == "onnx":
        counts["onnx_attention_weights"] = fuse_onnx_attention_weights(model)
    counts["sdpa"] = fuse_sdpa(model, apply_shape_inference=True)
    counts["head_merge_view"] = fuse_head_merge_view(model)
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
    # bias_axes, native_mask and onnx_attention follow a mask's axes from the bias upstream's fusions Expanded.
    common_passes.ShapeInferencePass()(model)
    counts["bias_axes"] = fuse_bias_axes(model)
    _type_attention_outputs(model)
    if target == "mha":
        counts["native_mask"] = fuse_native_mask(model)
        counts["finite_bias"] = fuse_finite_bias(model)
        # causal_gqa and padding_flash check the shapes of the mask/bias values the rules before created.
        common_passes.ShapeInferencePass()(model)
        if short_sequences:
            # First: causal_gqa and padding_flash then rewrite the causal or masked op of its long branch.
            counts["short_sequence"] = fuse_short_sequence(model)
        # Files without short_sequence's If are made for CUDA, whose GQA needs the tiled form.
        counts["causal_gqa"] = fuse_causal_gqa(model, materialise=short_sequences)
        counts["padding_flash"] = fuse_padding_flash(model)
        counts["output_bias"] = fuse_output_bias(model)
        counts["cache_heads"] = fuse_cache_heads(model)
        counts["head_round_trip"] = drop_mha_round_trips(model)
    else:
        counts["onnx_attention"] = fuse_onnx_attention(model)
    # Last: the attention rules above match the norm-free subgraphs they were written for (a q/k norm inside one).
    counts.update(fuse_norms(model, target))
    _omit_unused_present_outputs(model)
    # Layers of a stack build identical masks (Cast/Expand of one padding input): share them.
    common_passes.CommonSubexpressionEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    return counts


class _FailedMatches(pattern.MatchingTracer):
    """Every failed match that touches ``nodes``.

    The stock tracer keeps only each rule's best match in the whole model, which
    may be anywhere (one layer of a stack, a MatMul of a projection).
    """

    def __init__(self, nodes: set[ir.Node]) -> None:
        super().__init__()
        self._nodes = nodes
        self.failures: list[tuple[pattern.MatchResult, pattern.MatchStatus]] = []

    def log(self, rule, container, node, match_result, status) -> None:
        if status == pattern.MatchStatus.SUCCESS or match_result is None:
            return
        if node in self._nodes or not self._nodes.isdisjoint(match_result.nodes):
            self.failures.append((match_result, status))


# Rules that only prepare an attention for the fusing ones: where their pattern does not
# match there was nothing to prepare (no masked_fill, or already rewritten), which is no reason.
_PREPARING_RULES = {"masked_fill_bias", "score_bias_sum"}


def _softmax_rules(target: str) -> dict[str, pattern.RewriteRuleSet]:
    """The chain's rules that start from an attention's Softmax: while it is there, none of them matched."""
    rules = {
        "sdpa_from_attention": sdpa_from_attention_rules,
        "masked_fill_bias": masked_fill_bias_rules,
        "score_bias_sum": score_bias_sum_rules,
    }
    if target == "onnx":
        rules["onnx_attention_weights"] = onnx_attention_weights_rules
    rules["sdpa"] = sdpa_rules
    return rules


def _unfused_nodes(model: ir.Model) -> set[ir.Node]:
    """Each unfused attention's Softmax, score nodes and the MatMul(s) reading its probabilities; each
    unfused standard Attention op."""
    nodes: set[ir.Node] = {node for node in model.graph.all_nodes() if is_torch_attention(node)}
    for softmax in attention_softmaxes(model):
        nodes |= {softmax, *(_score_nodes(softmax) or []), *(use.node for use in softmax.outputs[0].uses())}
    return nodes


def _unfused_reasons(model: ir.Model, target: str) -> dict[str, list[str]]:
    """Rule -> why it did not match the attentions of ``model`` that are still unfused.

    Replays the rules with the rewriter's match tracing, which changes nothing in
    ``model``. Failed checks are returned when there are any: they name the
    condition that was not met, and the patterns that merely stopped (sdpa's "None
    of the alternatives matched." on a Where-masked score) follow from them.
    Otherwise each rule's furthest partial matches say where its pattern stopped.
    """
    unfused = _unfused_nodes(model)
    checks: dict[str, list[str]] = {}
    stops: dict[str, list[str]] = {}
    for name, rules in _softmax_rules(target).items():
        tracer = _FailedMatches(unfused)
        rules.apply_to_model(model, tracer=tracer)
        failed = [(match, status) for match, status in tracer.failures if status != pattern.MatchStatus.NO_MATCH]
        if failed:
            checks[name] = list(dict.fromkeys(_reason(*failure) for failure in failed))
            continue
        # A pattern that matched no node only says the attention does not start where it was tried.
        depth = max((len(match.nodes) for match, _ in tracer.failures), default=0)
        if depth and name not in _PREPARING_RULES:
            furthest = [failure for failure in tracer.failures if len(failure[0].nodes) == depth]
            stops[name] = list(dict.fromkeys(_reason(*failure) for failure in furthest))
    return checks or stops


def _reason(match: pattern.MatchResult, status: pattern.MatchStatus) -> str:
    return match.reason or status.name.lower().replace("_", " ")


def _type_attention_outputs(model: ir.Model) -> None:
    """Give a contrib MultiHeadAttention without an output type its query's: shape inference does not know
    contrib ops, and an op that upstream's fallback (sdpa_via_mha) built replaced no typed value. The rules
    after it size their branches by that type."""
    for node in model.graph.all_nodes():
        if node.op_type == "MultiHeadAttention" and node.domain == "com.microsoft" and node.outputs[0].dtype is None:
            node.outputs[0].dtype = node.inputs[0].dtype


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
    model: onnx.ModelProto, target: str, *, packed_qkv: bool = False, short_sequences: bool = True
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

    ``short_sequences`` (mha target) puts every attention under short_sequence's
    ``If``: faster on ORT's CPU provider, but an ``If`` cannot be captured in a CUDA
    graph, so the export leaves it out of fp16 models, which are made for CUDA.
    """
    if target not in FUSION_TARGETS:
        raise ExportError(f"fusion target must be one of {', '.join(FUSION_TARGETS)}, got {target!r}")
    ir_model = ir.serde.deserialize_model(model)
    found = len(unfused_attentions(ir_model))
    if target == "none" or found == 0:
        return model, FusionReport(target, found, remaining=found, unrecognised=unrecognised_attentions(ir_model))
    if target == "onnx" and ir_model.opset_imports.get("", 0) < MIN_ONNX_ATTENTION_OPSET:
        raise ExportError(
            f"--fuse onnx needs opset >= {MIN_ONNX_ATTENTION_OPSET} (standard Attention), the model has "
            f"{ir_model.opset_imports.get('', 0)}; export with a newer opset or use --fuse mha"
        )
    _check_weights_supported(ir_model, target)
    original_domains = set(ir_model.opset_imports)
    counts = _run_chain(ir_model, target, packed_qkv, short_sequences)
    _finish_opsets(ir_model, original_domains)
    fused = ir.serde.serialize_model(ir_model)
    unfused = unfused_attentions(ir_model)
    report = FusionReport(target, found, len(unfused), _fused_ops(fused, unfused), counts,
                          norms=norm_ops(fused.graph.node))
    report.unfused_names = [f"{node.name or '(unnamed)'} ({node.op_type})" for node in unfused]
    report.unrecognised = unrecognised_attentions(ir_model)
    report.softcapped = [f"{node.name or '(unnamed)'} (cap {found.cap:g})" for node in unfused
                         if (found := softcapped_attention(node)) is not None]
    if report.remaining > len(report.softcapped):
        # After serializing: the tracing pass is told to change nothing, but it still runs
        # the rewriter's constant propagation over the graph.
        report.unfused_reasons = _unfused_reasons(ir_model, target)
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
