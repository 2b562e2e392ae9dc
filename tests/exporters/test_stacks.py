"""Stacks end to end: export_stack / `export --model`, fused op counts, decoder inputs in MHASession."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from mha_deploy.batch import BatchRunner
from mha_deploy.cli import main
from mha_deploy.errors import ExportError, InputError, SignatureError
from mha_deploy.exporters import export_stack
from mha_deploy.exporters.fusion.padding_flash import PADDING_FLASH_KERNEL
from mha_deploy.exporters.fusion.short_sequence import short_sequence_kernel
from mha_deploy.exporters.parity import CacheCase, check_cache_parity
from mha_deploy.exporters.precision import FP16_ATOL, FP16_RTOL
from mha_deploy.model_report import describe_model
from mha_deploy.models import Decoder, Encoder
from mha_deploy.runtime import MHASession
from tests.conftest import KV_DECODER, TEST_D_MODEL, TEST_HEADS, USER_TARGETS

D = TEST_D_MODEL
# A padded non-causal attention's kernels: the standard Attention op when short, padding_flash's If beyond.
PADDING_FLASH_OR_SHORT = short_sequence_kernel(PADDING_FLASH_KERNEL, 256, 64)


@pytest.fixture(scope="module")
def decoder_model(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("stacks") / "decoder.onnx"
    return export_stack(Decoder(2, D, TEST_HEADS, 2 * D), path, mask="padding", fuse="onnx")


def test_decoder_fuses_two_attentions_per_layer(decoder_model):
    assert decoder_model.fusion.fused == 4 and decoder_model.fusion.complete
    assert decoder_model.parity.passed
    metadata = MHASession(decoder_model.path, provider="cpu").metadata
    assert (metadata.signature.model, metadata.layers, metadata.d_ff) == ("decoder", 2, 2 * D)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.pop("memory_padding_mask"), "missing memory_padding_mask"),
        (lambda f: f.update(memory_padding_mask=np.ones((2, 4), bool)), r"memory_padding_mask must .*\(2, 5\)"),
        (lambda f: f.update(key_padding_mask=np.ones((2, 5), bool)), r"key_padding_mask must have shape .*\(2, 3\)"),
        (lambda f: f.update(memory=np.zeros((1, 5, D), np.float32)), "batch sizes differ"),
    ],
)
def test_decoder_inputs_are_validated(decoder_model, change, message):
    feeds = {
        "x": np.zeros((2, 3, D), np.float32),
        "memory": np.zeros((2, 5, D), np.float32),
        "key_padding_mask": np.ones((2, 3), bool),
        "memory_padding_mask": np.ones((2, 5), bool),
    }
    session = MHASession(decoder_model.path, provider="cpu")
    assert session.run(feeds)["output"].shape == (2, 3, D)
    change(feeds)
    with pytest.raises(InputError, match=message):
        session.run(feeds)


def test_decoder_session_warms_up(decoder_model):
    session = MHASession(decoder_model.path, provider="cpu", warmup=True)
    assert session.metadata.signature.model == "decoder"


def test_batch_runner_pads_both_sequences_of_a_decoder(decoder_model):
    """Items of a decoder are (x, memory) pairs of different lengths; batched equals one by one."""
    from tests.batch.test_runner import make_items, run_one

    session = MHASession(decoder_model.path, provider="cpu")
    items = make_items(session.signature)
    results, stats = BatchRunner(session, batch_size=4).run(items)
    assert len(stats.batch_ms) < len(items), "items of different lengths share batches"
    for item_id, item in items.items():
        np.testing.assert_allclose(results[item_id]["output"], run_one(session, item)["output"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("stack", "mask", "message"),
    [
        (Encoder, "causal", "takes --mask none or padding"),
        (Decoder, "padding-causal", "always causal"),
    ],
)
def test_stack_masks(tmp_path, stack, mask, message):
    with pytest.raises(SignatureError, match=message):
        export_stack(stack(1, D, TEST_HEADS, D), tmp_path / "s.onnx", mask=mask)
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_an_encoder_that_the_runner_can_use(tmp_path):
    model = tmp_path / "encoder.onnx"
    args = ["export", "--model", "encoder", "--layers", "3", "--d-model", str(D), "--heads", str(TEST_HEADS),
            "--mask", "padding", "-o", str(model)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "3 attention subgraph(s) found, 3 fused" in result.stdout
    items = {"a": {"x": np.ones((4, D), np.float32)}, "b": {"x": np.ones((9, D), np.float32)}}
    results, _ = BatchRunner(MHASession(model, provider="cpu")).run(items)
    assert results["b"]["output"].shape == (9, D)
    inspect = CliRunner().invoke(main, ["inspect", str(model)]).stdout
    assert "encoder x3" in inspect and inspect.count("fused  com.microsoft::MultiHeadAttention") == 3
    assert inspect.count(f"kernel: {PADDING_FLASH_OR_SHORT}") == 3


def test_default_decoder_runs_causal_self_attention_on_group_query_attention(tmp_path):
    # Its self-attention is causal and padded: GQA over compacted tokens; its cross-attention is
    # padded: the flash path whenever no memory token is padded.
    torch.manual_seed(0)
    result = export_stack(Decoder(2, D, TEST_HEADS, 2 * D), tmp_path / "decoder.onnx", mask="padding")
    assert result.parity.passed and result.metadata.fusion == "mha"
    inspect = CliRunner().invoke(main, ["inspect", str(result.path)]).stdout
    assert inspect.count("fused  com.microsoft::GroupQueryAttention") == 2
    compacted = "padded tokens compacted out: any padding side; scores materialised up to 64 MB, tiled beyond"
    gqa = short_sequence_kernel(f"GroupQueryAttention (causal, {compacted})", 256, 64)
    assert inspect.count(f"kernel: {gqa}") == 2
    assert inspect.count(f"kernel: {PADDING_FLASH_OR_SHORT}") == 2
    session = MHASession(result.path, provider="cpu")
    items = {"a": {"x": np.ones((4, D), np.float32), "memory": np.ones((6, D), np.float32)},
             "b": {"x": np.ones((9, D), np.float32), "memory": np.ones((3, D), np.float32)}}
    results, _ = BatchRunner(session).run(items)
    assert results["b"]["output"].shape == (9, D) and np.isfinite(results["a"]["output"]).all()


def test_cli_layers_need_a_stack(tmp_path):
    result = CliRunner().invoke(main, ["export", "--layers", "2", "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and "--layers is for --model encoder or decoder" in result.output


# --- KV-cache decoder stacks ---------------------------------------------------------------------

# Unseen by the export's own check: batch 1 with a one-token prefill and memory, right-, left- and
# mixed-padded prefills and memories, a prefill and a memory past 256.
UNSEEN_DECODER_CASES = (
    CacheCase(1, 1, 4, 3, "none", memory=1),
    CacheCase(3, 12, 3, 2, "right", memory=7),
    CacheCase(4, 10, 2, 5, "left", memory=13),
    CacheCase(2, 270, 2, 3, "mixed", memory=300),
)


@pytest.mark.parametrize("fuse", USER_TARGETS)
def test_kv_decoder_decodes_like_one_forward_of_the_whole_sequence(export_model, fuse):
    """Prefill + one-token steps + a multi-token step of a 2-layer decoder equal the torch decoder run once
    over the whole target sequence, on every real position (fp32 atol 1e-5, rtol 1e-4)."""
    path, reference = export_model(KV_DECODER, fuse)
    session = MHASession(path, provider="cpu", optimization="all")
    report = check_cache_parity(reference, session, UNSEEN_DECODER_CASES, atol=1e-5, rtol=1e-4, seed=7)
    assert report.passed, report.failures
    assert len(report.shapes) == len(UNSEEN_DECODER_CASES)


def test_kv_decoder_fp16_within_its_budget(export_model):
    path, reference = export_model(KV_DECODER, "auto", "fp16")
    session = MHASession(path, provider="cpu")
    report = check_cache_parity(reference, session, UNSEEN_DECODER_CASES[:3], atol=FP16_ATOL, rtol=FP16_RTOL)
    assert report.passed, report.failures


def test_kv_decoder_io_contract(export_model):
    path, _ = export_model(KV_DECODER)
    graph = onnx.load(path).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    dims.update({v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.output})
    d_k = D // TEST_HEADS
    expected = {
        "x": ["batch", "tgt_seq", D], "memory": ["batch", "mem_seq", D],
        "key_padding_mask": ["batch", "total_seq"], "memory_padding_mask": ["batch", "mem_seq"],
        "output": ["batch", "tgt_seq", D],
    }
    for layer in range(2):
        for kind in ("key", "value"):
            expected[f"past_key_values.{layer}.{kind}"] = ["batch", TEST_HEADS, "past_seq", d_k]
            expected[f"present.{layer}.{kind}"] = ["batch", TEST_HEADS, "total_seq", d_k]
            expected[f"past_key_values.{layer}.encoder_{kind}"] = ["batch", TEST_HEADS, "past_mem_seq", d_k]
            expected[f"present.{layer}.encoder_{kind}"] = ["batch", TEST_HEADS, "mem_seq", d_k]
    assert dims == expected
    assert [v.name for v in graph.input] == list(KV_DECODER.input_names)
    assert [v.name for v in graph.output] == list(KV_DECODER.output_names)
    metadata = MHASession(path, provider="cpu").metadata
    assert metadata.signature == KV_DECODER and metadata.layers == 2 and metadata.parity.passed


def test_kv_decoder_runs_fused_kernels_in_both_branches(export_model):
    """The first call runs the cache-free decoder as auto fuses it; later calls run each layer's
    self-attention on contrib MultiHeadAttention with the cache as past_key/past_value, and its
    cross-attention on the op reading the encoder cache as keys and values."""
    path, _ = export_model(KV_DECODER)
    ops = describe_model(path).attention_ops
    decode = [op for op in ops if "past_key" in op.inputs]
    assert len(decode) == 2 and all(op.attributes["unidirectional"] == 1 for op in decode)
    assert {op.inputs["past_key"] for op in decode} == {"past_key_values.0.key", "past_key_values.1.key"}
    cross = [op for op in ops if op.inputs.get("key", "").startswith("past_key_values.")]
    assert {(op.inputs["key"], op.inputs["value"]) for op in cross} == {
        (f"past_key_values.{i}.encoder_key", f"past_key_values.{i}.encoder_value") for i in range(2)
    }
    assert all("key_padding_mask" in op.inputs and "unidirectional" not in op.attributes for op in cross)
    prefill = [op.op for op in ops if op not in decode and op not in cross]
    assert sorted(prefill) == ["com.microsoft::GroupQueryAttention"] * 2 + ["com.microsoft::MultiHeadAttention"] * 2


def test_cli_exports_a_kv_decoder_and_inspect_shows_its_cache(tmp_path):
    model = tmp_path / "decoder-kv.onnx"
    args = ["export", "--model", "decoder", "--layers", "2", "--d-model", str(D), "--heads", str(TEST_HEADS),
            "--mask", "padding", "--kv-cache", "-o", str(model)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "parity PASSED" in result.stdout and "x(1+3x1+2)x1" in result.stdout
    inspect = CliRunner().invoke(main, ["inspect", str(model)]).stdout
    assert "past_key_values.{i}.key/.value -> present.{i}.key/.value (i < 2)" in inspect
    assert "encoder_key/.encoder_value" in inspect and "key_padding_mask [batch, past_seq + tgt_seq]" in inspect



def test_one_entry_point_takes_a_signature_for_lone_blocks_and_stacks(tmp_path):
    from mha_deploy.exporters import export_builtin
    from mha_deploy.metadata import Signature
    from mha_deploy.models import MultiHeadAttention

    stack = Encoder(1, D, TEST_HEADS, D)
    result = export_builtin(stack, tmp_path / "e.onnx", Signature("self", "padding", model="encoder"))
    assert result.metadata.signature == Signature("self", "padding", model="encoder") and result.parity.passed
    with pytest.raises(ExportError, match="needs a MultiHeadAttention, got Encoder"):
        export_builtin(stack, tmp_path / "m.onnx", Signature("self", "padding"))
    with pytest.raises(ExportError, match="needs a Decoder"):
        export_builtin(MultiHeadAttention(D, TEST_HEADS), tmp_path / "d.onnx",
                       Signature("cross", "padding", model="decoder"))
    assert [p.name for p in tmp_path.iterdir()] == ["e.onnx"]
