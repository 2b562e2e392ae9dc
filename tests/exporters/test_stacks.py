"""Stacks end to end: export_stack / `export --model`, fused op counts, decoder inputs in MHASession."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mha_deploy.batch import BatchRunner
from mha_deploy.cli import main
from mha_deploy.errors import ExportError, InputError
from mha_deploy.exporters import export_stack
from mha_deploy.model_report import PADDING_FLASH_KERNEL
from mha_deploy.models import Decoder, Encoder
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS

D = TEST_D_MODEL


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
    with pytest.raises(ExportError, match=message):
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
    assert inspect.count(f"kernel: {PADDING_FLASH_KERNEL}") == 3


def test_default_decoder_runs_causal_self_attention_on_group_query_attention(tmp_path):
    # Its self-attention is causal and padded: GQA over compacted tokens; its cross-attention is
    # padded: the flash path whenever no memory token is padded.
    torch.manual_seed(0)
    result = export_stack(Decoder(2, D, TEST_HEADS, 2 * D), tmp_path / "decoder.onnx", mask="padding")
    assert result.parity.passed and result.metadata.fusion == "mha"
    inspect = CliRunner().invoke(main, ["inspect", str(result.path)]).stdout
    assert inspect.count("fused  com.microsoft::GroupQueryAttention") == 2
    compacted = "padded tokens compacted out: any padding side; scores materialised up to 64 MB, tiled beyond"
    assert inspect.count(f"kernel: GroupQueryAttention (causal, {compacted})") == 2
    assert inspect.count(f"kernel: {PADDING_FLASH_KERNEL}") == 2
    session = MHASession(result.path, provider="cpu")
    items = {"a": {"x": np.ones((4, D), np.float32), "memory": np.ones((6, D), np.float32)},
             "b": {"x": np.ones((9, D), np.float32), "memory": np.ones((3, D), np.float32)}}
    results, _ = BatchRunner(session).run(items)
    assert results["b"]["output"].shape == (9, D) and np.isfinite(results["a"]["output"]).all()


def test_cli_layers_need_a_stack(tmp_path):
    result = CliRunner().invoke(main, ["export", "--layers", "2", "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and "--layers is for --model encoder or decoder" in result.output
