"""Export: I/O contract, metadata, and parity of torch vs ORT under every mask."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from mha_deploy.errors import ExportError, ParityError, SignatureError
from mha_deploy.exporters import export_mha
from mha_deploy.exporters.export import AUTO_TARGETS
from mha_deploy.exporters.fusion.padding_flash import PADDING_FLASH_KERNEL
from mha_deploy.exporters.fusion.short_sequence import short_sequence_kernel
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import CacheCase, ParityCase, check_cache_parity, check_parity
from mha_deploy.metadata import FUSE_CHOICES, MASK_MODES, METADATA_KEY, ModelMetadata, Signature
from mha_deploy.model_report import describe_model
from mha_deploy.models import MultiHeadAttention
from mha_deploy.runtime import MHASession
from tests.conftest import SIGNATURES, TEST_D_MODEL, TEST_HEADS, signature_id

ATOL, RTOL = 1e-5, 1e-4

# Shapes never seen at export (traced at batch 2, q 3, kv 5): batch 1 / length 1,
# lengths that are not multiples of 8, one sequence >= 512, both padding sides.
UNSEEN_CASES = (
    ParityCase(1, 1, 1, "none"),
    ParityCase(1, 7, 13, "right"),
    ParityCase(5, 23, 31, "left"),
    ParityCase(3, 64, 64, "mixed"),
    ParityCase(2, 517, 520, "mixed"),
    ParityCase(6, 1, 9, "right"),
)


def _cases_for(signature: Signature) -> tuple[ParityCase, ...]:
    if signature.attention == "self":  # one sequence: q_len is kv_len
        return tuple(ParityCase(c.batch, c.kv_len, c.kv_len, c.padding) for c in UNSEEN_CASES)
    return UNSEEN_CASES


WITH_WEIGHTS = [Signature(s.attention, s.mask, True) for s in SIGNATURES]


@pytest.mark.parametrize("signature", SIGNATURES + WITH_WEIGHTS, ids=signature_id)
def test_parity_on_unseen_shapes(export_model, signature):
    path, reference = export_model(signature)
    session = MHASession(path, provider="cpu", optimization="disabled")
    report = check_parity(reference, session, _cases_for(signature), atol=ATOL, rtol=RTOL, seed=7)
    assert report.passed, report.failures
    assert report.max_abs_err <= ATOL + RTOL  # a loose sanity bound on the figure itself


@pytest.mark.parametrize("signature", SIGNATURES, ids=signature_id)
def test_io_contract(export_model, signature):
    path, _ = export_model(signature)
    model = onnx.load(path)
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    outputs = {o.name: o.type.tensor_type for o in model.graph.output}
    assert tuple(inputs) == signature.input_names
    assert tuple(outputs) == signature.output_names
    for name in signature.sequence_inputs:
        dims = inputs[name].shape.dim
        assert inputs[name].elem_type == onnx.TensorProto.FLOAT
        assert dims[0].dim_param and dims[1].dim_param, f"{name} batch/seq must be dynamic"
        assert dims[2].dim_value == TEST_D_MODEL
    if signature.has_padding_mask:
        assert inputs["key_padding_mask"].elem_type == onnx.TensorProto.BOOL
    kv_seq = inputs["x" if signature.attention == "self" else "key"].shape.dim[1].dim_param
    if signature.has_padding_mask:
        assert inputs["key_padding_mask"].shape.dim[1].dim_param == kv_seq
    if signature.attention == "cross":
        assert inputs["query"].shape.dim[1].dim_param != kv_seq, "q_seq and kv_seq must be independent"
    assert model.ir_version <= 10, "ORT 1.31 rejects IR 14"


def test_metadata_recorded(export_model):
    signature = Signature("cross", "padding")
    path, _ = export_model(signature)
    props = {p.key: p.value for p in onnx.load(path).metadata_props}
    metadata = ModelMetadata.from_props(props)
    assert (metadata.d_model, metadata.num_heads, metadata.signature) == (TEST_D_MODEL, TEST_HEADS, signature)
    assert metadata.opset == 23 and metadata.dtype == "float32"
    assert {"torch", "onnx", "mha-deploy"} <= set(metadata.versions)
    assert metadata.parity.passed and metadata.parity.max_abs_err < ATOL
    assert any(int(shape.split("/")[0].split("x")[1]) >= 256 for shape in metadata.parity.shapes)
    assert METADATA_KEY in props


def test_fully_masked_rows_are_finite(export_model):
    """Left padding + causal: padded query rows see no real key; they must stay finite."""
    path, _ = export_model(Signature("self", "padding-causal"))
    session = MHASession(path, provider="cpu")
    x = np.random.default_rng(0).standard_normal((2, 9, TEST_D_MODEL), dtype=np.float32)
    mask = np.ones((2, 9), dtype=bool)
    mask[1, :4] = False  # left padding
    assert np.isfinite(session.run({"x": x, "key_padding_mask": mask})["output"]).all()


@pytest.mark.parametrize("fuse", ["auto", "onnx", "none"])
def test_parity_failure_writes_nothing(tmp_path, defective_export, fuse):
    target = tmp_path / "mha.onnx"
    torch.manual_seed(0)
    with pytest.raises(ParityError, match=r"parity FAILED.*max abs err 0\.001.*nothing written"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), target, Signature("self", "padding"), fuse=fuse)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("opset", [17, 24, 99])
def test_unsupported_opset_is_refused(tmp_path, opset):
    with pytest.raises(ExportError, match=f"opset {opset}"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "m.onnx", Signature(), opset=opset)
    assert list(tmp_path.iterdir()) == []


def test_export_overwrites_atomically(tmp_path):
    target = tmp_path / "mha.onnx"
    target.write_bytes(b"old")
    torch.manual_seed(0)
    export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), target, Signature(), parity_cases=(ParityCase(1, 2, 2),))
    assert MHASession(target, provider="cpu").metadata.d_model == TEST_D_MODEL
    assert [p.name for p in tmp_path.iterdir()] == ["mha.onnx"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"signature_args": ("cross", "causal")}, "needs self-attention"),
        ({"signature_args": ("cross", "padding-causal")}, "needs self-attention"),
        ({"signature_args": ("self", "sliding")}, "mask must be one of"),
        ({"signature_args": ("both", "none")}, "attention must be one of"),
        ({"output": "mha.onx"}, "must end in .onnx"),
        ({"opset": 11}, "opset 11 is not supported"),
    ],
)
def test_bad_export_requests(tmp_path, kwargs, message):
    with pytest.raises((ExportError, SignatureError), match=message):
        signature = Signature(*kwargs.get("signature_args", ("self", "none")))
        export_mha(
            MultiHeadAttention(TEST_D_MODEL, TEST_HEADS),
            tmp_path / kwargs.get("output", "mha.onnx"),
            signature,
            opset=kwargs.get("opset", 23),
        )
    assert list(tmp_path.iterdir()) == []


def _incomplete_fusion(model, target, **_options):
    from mha_deploy.exporters.fusion import FusionReport

    return model, FusionReport(target, found=1, remaining=1)


@pytest.mark.parametrize("fuse", ["mha", "onnx"])
def test_explicit_fusion_refuses_unfused_attention(tmp_path, monkeypatch, fuse):
    monkeypatch.setattr("mha_deploy.exporters.export.fuse_attention", _incomplete_fusion)
    with pytest.raises(ExportError, match=rf"1 left unfused: --fuse {fuse} needs every attention subgraph fused"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "m.onnx", Signature(), fuse=fuse)
    assert list(tmp_path.iterdir()) == []


def test_auto_fusion_falls_back_to_the_plain_graph(tmp_path, monkeypatch):
    monkeypatch.setattr("mha_deploy.exporters.export.fuse_attention", _incomplete_fusion)
    result = export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "m.onnx", Signature(), fuse="auto")
    assert result.metadata.fusion == "none" and result.parity.passed
    assert len(result.warnings) == 1 and "exported the unfused graph" in result.warnings[0]


def test_fused_ops_cannot_return_weights(tmp_path):
    with pytest.raises(ExportError, match="cannot output"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "m.onnx", Signature(return_weights=True),
                   fuse="mha")
    assert list(tmp_path.iterdir()) == []


AUTO_CASES = [Signature("self", "padding"), Signature("cross", "none", True)]


@pytest.mark.parametrize("signature", AUTO_CASES, ids=signature_id)
def test_auto_fuses_and_records_the_target(tmp_path, signature):
    torch.manual_seed(0)
    result = export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "m.onnx", signature, fuse="auto")
    assert result.fusion.complete and result.fusion.fused == 1 and not result.warnings
    assert MHASession(result.path, provider="cpu").metadata.fusion == result.fusion.target != "none"


# What --fuse auto must run each self-attention mask mode on (ORT CPU kernels, see export.AUTO_TARGETS).
_GQA = "GroupQueryAttention (causal{}; scores materialised up to 64 MB, tiled beyond)"
AUTO_KERNELS = {
    mask: short_sequence_kernel(kernel, 256, 64)
    for mask, kernel in {
        "none": "MultiHeadAttention (flash)",
        "padding": PADDING_FLASH_KERNEL,
        "causal": _GQA.format(""),
        "padding-causal": _GQA.format(", padded tokens compacted out: any padding side"),
    }.items()
}


def test_auto_has_a_measured_choice_for_every_mask_mode():
    assert set(AUTO_TARGETS) == set(MASK_MODES)
    assert all(target in FUSE_CHOICES and target != "auto" for target in AUTO_TARGETS.values())


@pytest.mark.parametrize("mask", MASK_MODES)
def test_auto_runs_each_mask_mode_on_its_fastest_kernel(export_model, mask):
    path, _ = export_model(Signature("self", mask))
    (attention,) = describe_model(path).attention_ops
    assert attention.kernel == AUTO_KERNELS[mask]
    assert MHASession(path, provider="cpu").metadata.fusion == AUTO_TARGETS[mask]


# --- KV cache ------------------------------------------------------------------------------------

KV_SIGNATURES = [Signature("self", mask, kv_cache=True) for mask in ("causal", "padding-causal")]
# Decodings never seen at export: a one-token prefill with one step, long prefills, every padding side.
UNSEEN_CACHE_CASES = (
    CacheCase(1, 1, 1, 1, "none"),
    CacheCase(2, 7, 4, 9, "right"),
    CacheCase(3, 30, 2, 2, "left"),
    CacheCase(5, 517, 3, 8, "mixed"),
)


@pytest.mark.parametrize("fuse", ["auto", "onnx", "none"])
@pytest.mark.parametrize("signature", KV_SIGNATURES, ids=signature_id)
def test_kv_cache_parity_on_unseen_decodings(export_model, signature, fuse):
    path, module = export_model(signature, fuse)
    reference = attention_graph(module.mha, signature.cache_free)
    session = MHASession(path, provider="cpu", optimization="all")
    report = check_cache_parity(reference, session, UNSEEN_CACHE_CASES, atol=ATOL, rtol=RTOL, seed=5)
    assert report.passed, report.failures
    assert len(report.shapes) == len(UNSEEN_CACHE_CASES)


@pytest.mark.parametrize("signature", KV_SIGNATURES, ids=signature_id)
def test_kv_cache_io_contract_and_metadata(export_model, signature):
    path, _ = export_model(signature)
    model = onnx.load(path)
    d_k = TEST_D_MODEL // TEST_HEADS
    dims = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*model.graph.input, *model.graph.output)
    }
    expected = {
        "x": ["batch", "seq", TEST_D_MODEL],
        "past_key": ["batch", TEST_HEADS, "past_seq", d_k],
        "past_value": ["batch", TEST_HEADS, "past_seq", d_k],
        "output": ["batch", "seq", TEST_D_MODEL],
        "present_key": ["batch", TEST_HEADS, "total_seq", d_k],
        "present_value": ["batch", TEST_HEADS, "total_seq", d_k],
    }
    if signature.has_padding_mask:
        expected["key_padding_mask"] = ["batch", "total_seq"]
    assert dims == expected
    metadata = ModelMetadata.from_props({p.key: p.value for p in model.metadata_props})
    assert metadata.signature == signature and metadata.signature.cache_pairs == {
        "past_key": "present_key", "past_value": "present_value"
    }
    assert metadata.parity.passed and "+" in metadata.parity.shapes[0]


@pytest.mark.parametrize("signature", KV_SIGNATURES, ids=signature_id)
def test_kv_cache_prefill_runs_the_causal_kernel(export_model, signature):
    """auto: the prefill (past_seq 0) is fused as the cache-free causal model is; decode calls run contrib
    MultiHeadAttention on the cache itself."""
    path, _ = export_model(signature)
    ops = {op.op: op for op in describe_model(path).attention_ops}
    assert set(ops) == {"com.microsoft::GroupQueryAttention", "com.microsoft::MultiHeadAttention"}
    # The prefill branch holds causal_gqa's If (GQA's path by size), read as in a cache-free model.
    assert ops["com.microsoft::GroupQueryAttention"].kernel == AUTO_KERNELS[signature.mask]
    decode = ops["com.microsoft::MultiHeadAttention"]
    assert {"past_key", "past_value"} <= set(decode.inputs) and decode.attributes["unidirectional"] == 1
    assert ("key_padding_mask" in decode.inputs) == signature.has_padding_mask
    assert ModelMetadata.from_props({p.key: p.value for p in onnx.load(path).metadata_props}).fusion == "mha"
    plain, _ = export_model(signature, "none")
    assert describe_model(plain).attention_ops == []


def test_kv_cache_of_the_block_refuses_quantization(tmp_path):
    with pytest.raises(ExportError, match="int4 is not available with --kv-cache for the built-in block"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "kv.onnx", KV_SIGNATURES[0],
                   quantize="int4")


def test_metadata_without_cache_stays_readable_by_earlier_versions(export_model):
    path, _ = export_model(Signature("self", "causal"))
    props = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert "kv_cache" not in props[METADATA_KEY]


def test_kv_cache_parity_failure_writes_nothing(tmp_path, defective_export):
    torch.manual_seed(0)
    with pytest.raises(ParityError, match=r"parity FAILED.*\+.*nothing written"):
        export_mha(MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), tmp_path / "kv.onnx", KV_SIGNATURES[1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("signature_args", "message"),
    [
        ({"attention": "cross", "mask": "padding"}, "needs causal self-attention"),
        ({"mask": "none"}, "needs causal self-attention"),
        ({"mask": "padding"}, "needs causal self-attention"),
        ({"mask": "causal", "return_weights": True}, "drop --return-weights"),
        ({"model": "encoder", "mask": "padding"}, "use --model decoder"),
        ({"model": "decoder", "attention": "cross", "mask": "padding", "layers": 0}, "layer count"),
        ({"mask": "causal", "layers": 2}, "layer count"),
    ],
)
def test_kv_cache_needs_causal_self_attention(signature_args, message):
    with pytest.raises(SignatureError, match=message):
        Signature(**signature_args, kv_cache=True)
