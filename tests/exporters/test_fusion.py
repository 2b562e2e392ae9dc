"""Tests for mha_deploy.exporters.fusion: one attention op per MHA, parity with torch.

Sessions run with ORT graph optimizations disabled, so that ORT's own fusions
cannot hide a missed one.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mha_deploy.errors import ExportError
from mha_deploy.exporters.export import set_metadata
from mha_deploy.exporters.fusion import FusionReport, causal_gqa, fuse_attention, short_sequence
from mha_deploy.exporters.fusion.padding_flash import PADDING_FLASH_KERNEL
from mha_deploy.exporters.fusion.short_sequence import short_sequence_kernel
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import ParityCase, check_parity
from mha_deploy.exporters.stack_graphs import DecoderGraph, EncoderGraph, export_stack_onnx
from mha_deploy.exporters.torch_export import export_onnx
from mha_deploy.inputs import InputCase, make_inputs
from mha_deploy.metadata import ModelMetadata, Signature
from mha_deploy.models.attention import MultiHeadAttention
from mha_deploy.models.transformer import Decoder, Encoder
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.runtime.session import MHASession
from tests.exporters.fusion import hand_graphs as hg
from tests.exporters.fusion.hand_graphs import executed_nodes

D_MODEL, HEADS, D_FF, LAYERS = 64, 4, 128, 2

SIGNATURES = [
    Signature("self", "none"),
    Signature("self", "padding"),
    Signature("self", "causal"),
    Signature("self", "padding-causal"),
    Signature("cross", "none"),
    Signature("cross", "padding"),
]
# (target, packed_qkv) under a test id.
TARGETS = {"mha": ("mha", False), "mha-packed": ("mha", True), "onnx": ("onnx", False)}
# Op types and the attributes/inputs that carry causal and key padding, per fused op.
CAUSAL_ATTR = {
    "com.microsoft.MultiHeadAttention": "unidirectional",
    "com.microsoft.Attention": "unidirectional",
    "Attention": "is_causal",
}
PADDING_INPUT = {
    "com.microsoft.MultiHeadAttention": "key_padding_mask",
    "com.microsoft.Attention": "mask_index",
    "Attention": "attn_mask",
}
GQA = "com.microsoft.GroupQueryAttention"
# causal_gqa's If: GQA materialising scores of up to 64 MB (MATERIALISE_MAX_BYTES), tiled beyond.
GQA_CAUSAL = "GroupQueryAttention (causal; scores materialised up to 64 MB, tiled beyond)"
# short_sequence: the standard Attention op's kernel on short sequences, beyond them ORT's flash kernel
# (padding_flash's If with a padding mask).
MHA_FLASH_OR_SHORT = short_sequence_kernel("MultiHeadAttention (flash)", 256, 64)
PADDING_FLASH_OR_SHORT = short_sequence_kernel(PADDING_FLASH_KERNEL, 256, 64)
GQA_COMPACTED = (
    "GroupQueryAttention (causal, padded tokens compacted out: any padding side; "
    "scores materialised up to 64 MB, tiled beyond)"
)
# What fp32 exports run causal attentions on: the standard Attention op (is_causal) up to 256 keys, GQA beyond.
GQA_CAUSAL_OR_SHORT = short_sequence_kernel(GQA_CAUSAL, 256, 64)
GQA_COMPACTED_OR_SHORT = short_sequence_kernel(GQA_COMPACTED, 256, 64)


def _is_causal(op) -> bool:
    """GroupQueryAttention is always causal; the other ops say so in an attribute."""
    return op.op_type == GQA or bool(op.attributes.get(CAUSAL_ATTR[op.op_type], 0))


def _expected_kernel(signature: Signature, target_id: str) -> tuple[str, str | None]:
    """(op type, ORT CPU kernel) that ``target_id`` must give ``signature``'s attention (kernel None: not checked)."""
    if target_id == "onnx":
        return "Attention", None
    if target_id == "mha-packed":
        return "com.microsoft.Attention", None
    if signature.is_causal:
        return GQA, GQA_COMPACTED_OR_SHORT if signature.has_padding_mask else GQA_CAUSAL_OR_SHORT
    mha = "com.microsoft.MultiHeadAttention"
    return mha, PADDING_FLASH_OR_SHORT if signature.has_padding_mask else MHA_FLASH_OR_SHORT


def _sig_id(signature: Signature) -> str:
    return f"{signature.attention}-{signature.mask}" + ("-weights" if signature.return_weights else "")


# Every signature x target; packing only changes self-attention, so cross-attention
# under "mha-packed" would repeat "mha".
FUSION_CASES = [
    pytest.param(signature, target_id, id=f"{_sig_id(signature)}-{target_id}")
    for signature in SIGNATURES
    for target_id in TARGETS
    if not (target_id == "mha-packed" and signature.attention == "cross")
]


@pytest.fixture(scope="module")
def unfused():
    """``unfused(signature) -> (torch graph module, ONNX model with metadata)``, exported once each."""
    cache: dict[Signature, tuple] = {}

    def get(signature: Signature):
        if signature not in cache:
            torch.manual_seed(7)
            module = attention_graph(MultiHeadAttention(D_MODEL, HEADS).eval(), signature)
            model = export_onnx(module, signature, D_MODEL)
            set_metadata(model, ModelMetadata(d_model=D_MODEL, num_heads=HEADS, signature=signature))
            cache[signature] = (module, model)
        return cache[signature]

    return get


@pytest.fixture(scope="module")
def fused(unfused):
    """``fused(signature, target_id) -> (module, unfused model, fused model, report)``, fused once each."""
    cache: dict[tuple, tuple] = {}

    def get(signature: Signature, target_id: str):
        key = (signature, target_id)
        if key not in cache:
            module, model = unfused(signature)
            target, packed = TARGETS[target_id]
            fused_model, report = fuse_attention(model, target, packed_qkv=packed)
            cache[key] = (module, model, fused_model, report)
        return cache[key]

    return get


def _session(model: onnx.ModelProto) -> MHASession:
    return MHASession(model.SerializeToString(), provider="cpu", optimization="disabled")


def _ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("signature", "target_id"), FUSION_CASES)
def test_one_attention_op_per_mha(fused, signature, target_id):
    _, _, model, report = fused(signature, target_id)
    assert isinstance(report, FusionReport)
    assert (report.found, report.fused, report.remaining) == (1, 1, 0), report.summary()
    assert report.complete
    op = report.ops[0]
    op_type, kernel = _expected_kernel(signature, target_id)
    assert op.op_type == op_type
    if kernel is not None:
        assert op.kernel == kernel
    # Masks go through the op's native inputs: no float bias survives.
    assert "attention_bias" not in op.mask_inputs
    if op.op_type == GQA:  # the padding mask is what compacts q/k/v and sets seqlens_k
        assert "seqlens_k" in op.mask_inputs
    else:
        assert (PADDING_INPUT[op.op_type] in op.mask_inputs) == signature.has_padding_mask
    assert _is_causal(op) == signature.is_causal
    assert op.describe().startswith(f"{op.op_type}(") and op.describe().endswith(f"-> {op.kernel}")
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert not softmaxes
    assert not report.unfused_reasons


@pytest.mark.parametrize(("signature", "target_id"), FUSION_CASES)
def test_fused_matches_torch(fused, signature, target_id):
    # Default cases: batch 1 / seq 1, lengths 17, 41, 300 (not multiples of 8),
    # right, left and mixed padding; padded rows must be finite.
    module, _, model, _ = fused(signature, target_id)
    report = check_parity(module, _session(model))
    assert report.passed, f"{report.summary()}: {report.failures}"


@pytest.mark.parametrize("signature", [Signature("self", "padding-causal"), Signature("cross", "padding")], ids=_sig_id)
@pytest.mark.parametrize("target_id", ["mha", "onnx"])
def test_fused_matches_torch_on_more_shapes(fused, signature, target_id):
    module, _, model, _ = fused(signature, target_id)
    if signature.attention == "self":
        cases = (ParityCase(1, 9, 9, "left"), ParityCase(5, 2, 2, "right"), ParityCase(2, 64, 64, "left"))
    else:
        cases = (ParityCase(1, 9, 9, "left"), ParityCase(5, 2, 33, "right"), ParityCase(2, 64, 5, "left"))
    report = check_parity(module, _session(model), cases, seed=11)
    assert report.passed, f"{report.summary()}: {report.failures}"


def _gqa_branches(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """causal_gqa's size Ifs (one, or with a padding mask one for compacted tokens and one for tokens as they
    are): "materialised" (then) and "tiled" (else) -> the GroupQueryAttention ops those branches run."""
    found = {"materialised": [], "tiled": []}
    for node in all_nodes(model.graph):
        graphs = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        ops = {name: [n.op_type for n in graph.node] for name, graph in graphs.items()}
        if node.op_type == "If" and all(types == ["GroupQueryAttention"] for types in ops.values()):
            found["materialised"].append(graphs["then_branch"].node[0])
            found["tiled"].append(graphs["else_branch"].node[0])
    expected = 2 if any(i.name == "key_padding_mask" for i in model.graph.input) else 1
    assert [len(ops) for ops in found.values()] == [expected, expected]
    return found


CAUSAL_SIGNATURES = [Signature("self", "causal"), Signature("self", "padding-causal")]


@pytest.mark.parametrize("signature", CAUSAL_SIGNATURES, ids=_sig_id)
def test_group_query_attention_keeps_its_present_outputs_on_the_tiled_branch(fused, signature):
    # Unused, but ORT 1.31's CPU GroupQueryAttention takes its tiled path only when they are
    # requested: the pipeline's clean-up passes must not drop them, nor add them to the other branch.
    _, _, model, _ = fused(signature, "mha")
    branches = _gqa_branches(model)
    assert all(len(op.output) == 3 and all(op.output) for op in branches["tiled"])
    assert all(len(op.output) == 1 for op in branches["materialised"])


@pytest.mark.parametrize("signature", CAUSAL_SIGNATURES, ids=_sig_id)
def test_causal_matches_torch_on_both_sides_of_the_score_threshold(unfused, monkeypatch, signature):
    # A threshold between (2,17) and (2,41) of this model's fp32 scores: 2 x 4 heads x 24 x 24 x 4 bytes.
    monkeypatch.setattr(causal_gqa, "causal_gqa_rules", causal_gqa.causal_gqa_rules_with(2 * HEADS * 24 * 24 * 4))
    _beyond_short_sequences(monkeypatch)
    module, model = unfused(signature)
    fused_model, _ = fuse_attention(model, "mha")
    names = {branch: {op.name for op in ops} for branch, ops in _gqa_branches(fused_model).items()}
    padding = "mixed" if signature.has_padding_mask else "none"
    for seq, branch, other in ((17, "materialised", "tiled"), (41, "tiled", "materialised")):
        case = ParityCase(2, seq, seq, padding)
        ran = executed_nodes(fused_model, make_inputs(signature, D_MODEL, case, seed=3))
        assert names[branch] & ran and not names[other] & ran
        report = check_parity(module, _session(fused_model), (case,), seed=3)
        assert report.passed, f"{branch}: {report.summary()}: {report.failures}"


def _beyond_short_sequences(monkeypatch, keys_max: int = 8) -> None:
    """Fusions from here on put short_sequence's bound at ``keys_max`` keys: the small shapes of these tests
    then reach the kernels the If runs past its bounds (padding_flash's, causal_gqa's)."""
    rules = short_sequence.short_sequence_rules_with(keys_max, short_sequence.SHORT_SCORES_MAX_BYTES)
    monkeypatch.setattr(short_sequence, "short_sequence_rules", rules)


def _torch_outputs(module, signature: Signature, feeds: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return module(*(torch.from_numpy(feeds[name]) for name in signature.input_names)).numpy()


@pytest.mark.parametrize("signature", [Signature("self", "padding"), Signature("cross", "padding")], ids=_sig_id)
@pytest.mark.parametrize(
    ("padding", "branch"),
    [
        ("none", "short"),
        ("mixed", "short"),
        ("none", "flash"),
        ("equal-counts", "cut_flash"),
        ("mixed", "cut_masked"),
    ],
    ids=["short-all-real", "short-padded", "all-real", "padded-to-one-length", "padded"],
)
def test_padding_mask_takes_the_flash_kernel_unless_short_or_rows_hold_unequal_real_keys(
    fused, unfused, monkeypatch, signature, padding, branch
):
    if branch == "short":
        module, _, model, _ = fused(signature, "mha")
    else:
        _beyond_short_sequences(monkeypatch)
        module, model = unfused(signature)
        model, _ = fuse_attention(model, "mha")
    case = InputCase(3, 11, 11 if signature.attention == "self" else 14, "mixed" if padding == "mixed" else "none")
    feeds = make_inputs(signature, D_MODEL, case, seed=4)
    if padding == "equal-counts":
        # Every row holds 8 real keys, on a different side each: a bucket padded to a fixed length.
        kv_len = feeds["key_padding_mask"].shape[1]
        positions = np.arange(kv_len)
        scattered = np.isin(positions, [0, 1, 3, 4, 5, 7, 8, 9])
        feeds["key_padding_mask"] = np.stack([positions < 8, positions >= kv_len - 8, scattered])
    assert hg.padding_flash_ran(model, feeds) == {branch}
    (actual,) = _ort_session(model).run(["output"], feeds)
    # The mask is over keys: a padded query row sees its row's real keys, in the reference and here alike.
    np.testing.assert_allclose(actual, _torch_outputs(module, signature, feeds), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padding", ["right", "left", "mixed", "empty-row"])
def test_causal_padding_of_any_side_matches_torch_on_real_rows(fused, padding):
    # GroupQueryAttention over compacted tokens; "empty-row": a sequence with no real token, whose
    # rows are padding and only need to be finite. MHASession refuses such input: plain ORT here.
    signature = Signature("self", "padding-causal")
    module, _, model, _ = fused(signature, "mha")
    feeds = make_inputs(signature, D_MODEL, InputCase(4, 37, 37, "mixed" if padding == "empty-row" else padding), 8)
    if padding == "empty-row":
        feeds["key_padding_mask"][-1] = False
    (actual,) = _ort_session(model).run(["output"], feeds)
    rows = feeds["key_padding_mask"]
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual[rows], _torch_outputs(module, signature, feeds)[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("target_id", list(TARGETS))
def test_model_interface_and_ir_version_kept(fused, target_id):
    _, before, after, _ = fused(Signature("self", "padding-causal"), target_id)
    assert after.ir_version <= 10
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert list(after.metadata_props) == list(before.metadata_props)
    onnx.checker.check_model(after)
    domains = {o.domain for o in after.opset_import}
    assert "ai.onnxruntime._fusion" not in domains
    assert ("com.microsoft" in domains) == target_id.startswith("mha")


@pytest.mark.parametrize("target_id", list(TARGETS))
def test_query_whose_keys_are_all_padding_matches_torch(fused, target_id):
    # Cross-attention over a memory that is all padding for one sequence: its
    # query rows are real, and the reference gives the uniform average of the
    # values there (every score is the fill). Pinned because ORT 1.31's
    # standard Attention returns zeros for such a row with a *bool* mask.
    # MHASession refuses such input, so the graph is run with plain ORT.
    module, _, model, _ = fused(Signature("cross", "padding"), target_id)
    rng = np.random.default_rng(5)
    feeds = {
        name: rng.standard_normal((2, 6 if name == "query" else 9, D_MODEL), dtype=np.float32)
        for name in ("query", "key", "value")
    }
    feeds["key_padding_mask"] = np.array([[True] * 9, [False] * 9])
    (actual,) = _ort_session(model).run(["output"], feeds)
    with torch.no_grad():
        expected = module(*(torch.from_numpy(feeds[n]) for n in ("query", "key", "value", "key_padding_mask")))
    np.testing.assert_allclose(actual, expected.numpy(), atol=1e-5, rtol=1e-4)


class _DenseMaskGraph(torch.nn.Module):
    """Reference MHA under a mask the rules cannot read as padding/causal: bool [batch, seq, seq] input."""

    def __init__(self, mha: MultiHeadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, x, attn_mask):
        return self.mha(x, x, x, attn_mask[:, None])[0]


@pytest.fixture(scope="module")
def dense_mask_model():
    from torch.export import Dim

    from mha_deploy.exporters.torch_export import _quiet_exporter

    torch.manual_seed(9)
    module = _DenseMaskGraph(MultiHeadAttention(D_MODEL, HEADS).eval()).eval()
    batch, seq = Dim("batch"), Dim("seq")
    with _quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            module,
            (torch.randn(2, 3, D_MODEL), torch.ones(2, 3, 3, dtype=torch.bool)),
            dynamo=True,
            dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq, 2: seq}),
            input_names=["x", "attn_mask"],
            output_names=["output"],
            opset_version=23,
        )
    model = program.model_proto
    model.ir_version = 10
    return module, model


@pytest.mark.parametrize("target_id", list(TARGETS))
def test_unrecognised_mask_is_fused_with_an_explicit_bias(dense_mask_model, target_id):
    module, model = dense_mask_model
    target, packed = TARGETS[target_id]
    fused_model, report = fuse_attention(model, target, packed_qkv=packed)
    assert (report.found, report.fused, report.remaining) == (1, 1, 0), report.summary()
    assert set(report.ops[0].mask_inputs) == {"attn_mask" if target == "onnx" else "attention_bias"}
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((3, 7, D_MODEL), dtype=np.float32), "attn_mask": rng.random((3, 7, 7)) < 0.6}
    feeds["attn_mask"][:, :, 0] = True  # every query sees at least one key
    (actual,) = _ort_session(fused_model).run(["output"], feeds)
    with torch.no_grad():
        expected = module(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["attn_mask"])).numpy()
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)


def _attention_softmax(model: onnx.ModelProto) -> onnx.NodeProto:
    (softmax,) = [n for n in model.graph.node if n.op_type == "Softmax"]
    return softmax


def _with_fill(model: onnx.ModelProto, fill: float) -> onnx.ModelProto:
    """A copy of ``model`` whose masked_fill writes ``fill`` instead of -1e9."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    (where,) = [n for n in changed.graph.node if n.output[0] == _attention_softmax(changed).input[0]]
    (initializer,) = [i for i in changed.graph.initializer if i.name == where.input[1]]
    initializer.CopyFrom(onnx.numpy_helper.from_array(np.array(fill, np.float32), initializer.name))
    return changed


@pytest.mark.parametrize("target_id", list(TARGETS))
def test_unfused_attention_is_reported_with_the_check_that_failed(unfused, target_id):
    # A fill of -1.0 is a soft penalty, not a mask: masked_fill_bias must refuse it, and then
    # nothing downstream matches. The report says which check failed, not just "1 left unfused".
    _, model = unfused(Signature("self", "padding"))
    target, packed = TARGETS[target_id]
    _, report = fuse_attention(_with_fill(model, -1.0), target, packed_qkv=packed)
    assert (report.found, report.fused, report.remaining) == (1, 0, 1) and not report.complete
    assert report.unfused_reasons == {"masked_fill_bias": ["fill -1.0 is not a masking value (needs <= -10000)"]}
    assert report.summary().endswith(
        "1 left unfused (masked_fill_bias: fill -1.0 is not a masking value (needs <= -10000))"
    )


def test_unfused_attention_without_a_failed_check_says_where_the_patterns_stopped(unfused):
    # A Softmax over another axis than the keys': no rule gets as far as its checks.
    _, model = unfused(Signature("self", "none"))
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    (axis,) = _attention_softmax(changed).attribute
    axis.i = 1
    _, report = fuse_attention(changed, "onnx")
    assert report.remaining == 1
    assert set(report.unfused_reasons) == {"onnx_attention_weights", "sdpa"}
    assert all(any("axis" in why for why in reasons) for reasons in report.unfused_reasons.values())
    assert "axis" in report.summary()


def test_target_none_returns_model_unchanged(unfused):
    _, model = unfused(Signature("self", "padding"))
    result, report = fuse_attention(model, "none")
    assert result is model
    assert (report.found, report.fused) == (1, 0) and report.complete


def test_input_model_is_not_modified(unfused):
    _, model = unfused(Signature("cross", "padding"))
    before = model.SerializeToString()
    fuse_attention(model, "mha")
    assert model.SerializeToString() == before


def test_unknown_target_is_refused(unfused):
    _, model = unfused(Signature("self", "none"))
    with pytest.raises(ExportError, match="fusion target must be one of"):
        fuse_attention(model, "flash")


WEIGHT_SIGNATURES = [
    Signature("self", "padding-causal", True),
    Signature("self", "none", True),
    Signature("cross", "padding", True),
]


def test_return_weights_with_mha_target_is_refused(unfused):
    _, model = unfused(Signature("self", "padding", return_weights=True))
    with pytest.raises(ExportError, match=r"attention weights.*--fuse onnx"):
        fuse_attention(model, "mha")


@pytest.mark.parametrize("signature", WEIGHT_SIGNATURES, ids=_sig_id)
def test_return_weights_with_onnx_target_outputs_probabilities(fused, signature):
    module, before, model, report = fused(signature, "onnx")
    assert (report.found, report.fused, report.remaining) == (1, 1, 0), report.summary()
    op = report.ops[0]
    assert op.attributes["qk_matmul_output_mode"] == 3  # after softmax
    assert bool(op.attributes.get("is_causal", 0)) == signature.is_causal
    assert [o.name for o in model.graph.output] == ["output", "attn_weights"]
    assert model.graph.output == before.graph.output
    report = check_parity(module, _session(model))
    assert report.passed, f"{report.summary()}: {report.failures}"


def test_onnx_target_needs_opset_23(unfused):
    _, model = unfused(Signature("self", "none"))
    old = onnx.ModelProto()
    old.CopyFrom(model)
    for opset in old.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 21
    with pytest.raises(ExportError, match="opset >= 23"):
        fuse_attention(old, "onnx")


# --- encoder / decoder stacks ---------------------------------------------------------


@pytest.fixture(scope="module")
def stacks():
    """{"encoder"|"decoder": (torch graph module, unfused ONNX model)}, exported once."""
    torch.manual_seed(3)
    graphs = {
        "encoder": EncoderGraph(Encoder(LAYERS, D_MODEL, HEADS, D_FF).eval()),
        "decoder": DecoderGraph(Decoder(LAYERS, D_MODEL, HEADS, D_FF).eval()),
    }
    return {name: (graph, export_stack_onnx(graph)) for name, graph in graphs.items()}


def _stack_feeds(graph, batch, tgt_len, mem_len, padding, seed) -> dict[str, np.ndarray]:
    return make_inputs(graph.signature, D_MODEL, InputCase(batch, tgt_len, mem_len, padding), seed)


STACK_CASES = [(1, 1, 1, "none"), (3, 17, 9, "right"), (4, 23, 41, "left"), (2, 70, 33, "mixed")]


@pytest.mark.parametrize("target_id", list(TARGETS))
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_stack_fuses_every_layer_and_matches_torch(stacks, stack, target_id):
    graph, model = stacks[stack]
    target, packed = TARGETS[target_id]
    fused_model, report = fuse_attention(model, target, packed_qkv=packed)
    expected = LAYERS if stack == "encoder" else 2 * LAYERS
    assert (report.found, report.fused, report.remaining) == (expected, expected, 0), report.summary()
    assert all("attention_bias" not in op.mask_inputs for op in report.ops)
    causal = [_is_causal(op) for op in report.ops]
    assert sum(causal) == (0 if stack == "encoder" else LAYERS)
    if target_id == "mha":  # the decoder's causal self-attention, padded: GQA over compacted tokens
        kernels = sorted(op.kernel for op in report.ops)
        decoder = [GQA_COMPACTED_OR_SHORT] * LAYERS + [PADDING_FLASH_OR_SHORT] * LAYERS
        assert kernels == sorted(decoder if stack == "decoder" else [PADDING_FLASH_OR_SHORT] * LAYERS)

    session = _ort_session(fused_model)
    for seed, (batch, tgt_len, mem_len, padding) in enumerate(STACK_CASES):
        feeds = _stack_feeds(graph, batch, tgt_len, mem_len, padding, seed)
        (actual,) = session.run(["output"], feeds)
        with torch.no_grad():
            expected_out = graph(*(torch.from_numpy(feeds[name]) for name in graph.signature.input_names)).numpy()
        assert np.isfinite(actual).all()
        rows = feeds["key_padding_mask"]
        np.testing.assert_allclose(actual[rows], expected_out[rows], atol=1e-5, rtol=1e-4)


# --- ORT 1.31 CPU semantics the rules rely on (single-op models) ------------------------


def _run_single_op(node: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    elem = {
        np.dtype(np.float32): onnx.TensorProto.FLOAT,
        np.dtype(np.int32): onnx.TensorProto.INT32,
        np.dtype(bool): onnx.TensorProto.BOOL,
    }
    inputs = [onnx.helper.make_tensor_value_info(name, elem[array.dtype], None) for name, array in feeds.items()]
    output = onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
    graph = onnx.helper.make_graph([node], "probe", inputs, [output])
    opsets = [onnx.helper.make_opsetid("", 23), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return _ort_session(model).run(None, feeds)[0][0]


def _onnx_attention(inputs: list[str], **attributes) -> onnx.NodeProto:
    # 3-D inputs need the head counts: without them ORT 1.31 dies of SIGFPE
    # (division by zero) instead of reporting an error.
    return onnx.helper.make_node("Attention", inputs, ["o"], q_num_heads=1, kv_num_heads=1, **attributes)


def _probe_qkv(q_len: int, kv_len: int) -> dict[str, np.ndarray]:
    # One head, zero scores, identity values: each output row is that query's
    # attention probabilities (uniform over the keys it may see).
    return {
        "q": np.zeros((1, q_len, kv_len), np.float32),
        "k": np.zeros((1, kv_len, kv_len), np.float32),
        "v": np.eye(kv_len, dtype=np.float32)[None],
    }


def test_ort_causal_flags_are_lower_triangular_when_q_len_equals_kv_len():
    expected = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]
    mha = onnx.helper.make_node(
        "MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=1, unidirectional=1
    )
    onnx_attention = _onnx_attention(["q", "k", "v"], is_causal=1)
    np.testing.assert_allclose(_run_single_op(mha, _probe_qkv(4, 4)), expected, atol=1e-6)
    np.testing.assert_allclose(_run_single_op(onnx_attention, _probe_qkv(4, 4)), expected, atol=1e-6)


def test_ort_causal_alignment_differs_when_q_len_is_not_kv_len():
    # Why the rules only use the causal flags when q_len and kv_len are one
    # sequence: with q_len 2, kv_len 4 ONNX Attention aligns top-left, while
    # contrib MHA lets row 0 see key 0 only and row 1 see every key.
    onnx_attention = _onnx_attention(["q", "k", "v"], is_causal=1)
    top_left = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0]])
    np.testing.assert_allclose(_run_single_op(onnx_attention, _probe_qkv(2, 4)), top_left, atol=1e-6)
    mha = onnx.helper.make_node(
        "MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=1, unidirectional=1
    )
    assert not np.allclose(_run_single_op(mha, _probe_qkv(2, 4)), top_left, atol=1e-6)


def test_ort_rows_without_a_visible_key():
    # The reference replaces every score by -1e9 there: uniform probabilities.
    uniform = np.full((3, 3), 1 / 3)
    feeds = _probe_qkv(3, 3)
    mha = onnx.helper.make_node(
        "MultiHeadAttention",
        ["q", "k", "v", "", "pad"],
        ["o"],
        domain="com.microsoft",
        num_heads=1,
        mask_filter_value=-1e9,
    )
    np.testing.assert_allclose(_run_single_op(mha, {**feeds, "pad": np.zeros((1, 3), np.int32)}), uniform, atol=1e-6)
    attention = _onnx_attention(["q", "k", "v", "mask"])
    additive = np.full((1, 1, 3, 3), -1e9, np.float32)
    np.testing.assert_allclose(_run_single_op(attention, {**feeds, "mask": additive}), uniform, atol=1e-6)
    # A bool mask gives zeros instead: why onnx_attention builds an additive one.
    boolean = np.zeros((1, 1, 3, 3), bool)
    np.testing.assert_array_equal(_run_single_op(attention, {**feeds, "mask": boolean}), np.zeros((3, 3)))


def test_ort_onnx_attention_needs_the_mask_q_axis_explicit():
    attention = _onnx_attention(["q", "k", "v", "mask"])
    feeds = {**_probe_qkv(3, 3), "mask": np.zeros((1, 1, 1, 3), np.float32)}
    with pytest.raises(Exception, match="inconsistent q_sequence_length"):
        _run_single_op(attention, feeds)


def _soft_capped_softmax(classifier: bool) -> onnx.ModelProto:
    """Softmax(tanh(MatMul(q, k^T) / 50) * 50) @ v over [batch, seq, 16] inputs: an attention with Gemma-2's
    soft-capped scores; ``classifier``: soft-capped logits of a weight, the Softmax the graph's output."""
    from onnx import TensorProto, helper

    def tensor(name, dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    cap = helper.make_tensor("cap", TensorProto.FLOAT, [], [50.0])
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["scores"]), helper.make_node("Div", ["scores", "cap"], ["s"]),
             helper.make_node("Tanh", ["s"], ["t"]), helper.make_node("Mul", ["t", "cap"], ["capped"]),
             helper.make_node("Softmax", ["capped"], ["probs"], axis=-1, name="the_softmax")]
    if classifier:
        weight = helper.make_tensor("kt", TensorProto.FLOAT, [16, 16], np.ones(256, np.float32))
        graph = helper.make_graph(nodes, "g", [tensor("q", ["batch", "seq", 16])],
                                  [tensor("probs", ["batch", "seq", 16])], [cap, weight])
    else:
        nodes.append(helper.make_node("MatMul", ["probs", "v"], ["o"]))
        inputs = [tensor("q", ["batch", "seq", 16]), tensor("kt", ["batch", 16, "seq"]),
                  tensor("v", ["batch", "seq", 16])]
        graph = helper.make_graph(nodes, "g", inputs, [tensor("o", ["batch", "seq", 16])], [cap])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("classifier", [False, True], ids=["soft-capped-attention", "soft-capped-classifier"])
def test_a_soft_capped_attention_is_found_left_unfused_and_named_in_a_warning(classifier):
    """Gemma-2's soft-capped scores exported with 0 attentions found and no word: now the attention is found, left
    as exported (no MultiHeadAttention caps scores; the ragged cache layout puts it on GroupQueryAttention's
    softcap) and named with its cap in the warning, the fusion complete otherwise. A softmax over a classifier's
    logits is not one."""
    _, report = fuse_attention(_soft_capped_softmax(classifier), "mha")
    if not classifier:
        assert (report.found, report.remaining, report.fused) == (1, 1, 0)
        assert report.softcapped == ["the_softmax (cap 50)"] and report.complete
        assert "1 soft-capped attention(s) left unfused, as exported" in report.warning
        assert "the_softmax (cap 50)" in report.warning and "soft-capped: MultiHeadAttention has no softcap" in \
            report.summary()
    else:
        assert report.found == 0 and report.softcapped == [] and report.warning is None


def test_an_attention_no_rule_knows_is_named_in_a_warning():
    """A Softmax over Q·Kᵀ scores that pass a Transpose no rule reads is named with the ops between its scores and
    it, not exported as '0 attention subgraph(s) found' and no word."""
    model = _soft_capped_softmax(False)
    nodes = [node for node in model.graph.node if node.op_type not in ("Div", "Tanh", "Mul")]
    nodes.insert(1, onnx.helper.make_node("Transpose", ["scores"], ["capped"], perm=[0, 2, 1]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _, report = fuse_attention(model, "mha")
    assert report.found == 0
    assert report.unrecognised == ["the_softmax (between scores and Softmax: Transpose)"]
    assert "match no fusion rule, so they run unfused as exported: the_softmax" in report.warning
