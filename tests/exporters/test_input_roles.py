"""Inputs beyond token ids, each through `mha-deploy export --module FILE.py:build --input ...` with the defaults:
BERT's segment ids (``token_type_ids:segments``, a 2-row table of their own), ViT's image
(``pixel_values:image``, sizes read off its config) and Whisper's encoder's audio features (``input_features:audio``,
frames exactly 2 x max_source_positions). Each fuses its attentions, records its inputs' roles, sizes and tables, and
equals its module in plain ONNX Runtime at a batch size the export never traced, probed or checked parity at."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from mha_deploy.errors import ExportError  # noqa: E402
from mha_deploy.exporters.own_model import InputDecl, declare_inputs, fixed_shape  # noqa: E402
from mha_deploy.inputs import InputCase, make_inputs  # noqa: E402
from mha_deploy.model_report import describe_model  # noqa: E402
from mha_deploy.onnx_nodes import all_nodes  # noqa: E402
from mha_deploy.runtime import MHASession  # noqa: E402
from tests.conftest import OWN_MODEL_ATOL, OWN_MODEL_RTOL, user_module  # noqa: E402

# file -> (each input's (role, axes, table rows)) as the file's metadata must record them
FAMILIES = {
    "hf_segments": {"input_ids": ("tokens", ("batch", "seq"), 96),
                    "attention_mask": ("padding_mask", ("batch", "seq"), None),
                    "token_type_ids": ("segments", ("batch", "seq"), 2)},
    "hf_vision": {"pixel_values": ("image", ("batch", 3, 32, 32), None)},
    "hf_audio": {"input_features": ("audio", ("batch", 8, 32), None)},
}
# Batches the export never saw: traced at 2, probed at 4, parity at 1, 2, 3 and 4.
UNSEEN_BATCH, UNSEEN_LENGTH = 5, 23
LAYERS = 2  # tests/user_models/hf_models.py


def _feeds(signature, seed: int = 3) -> dict[str, np.ndarray]:
    """Inputs at the unseen batch: ids within each input's own table, the mask right-padded (row 0 whole)."""
    return make_inputs(signature, 0, InputCase(UNSEEN_BATCH, UNSEEN_LENGTH, UNSEEN_LENGTH, "right"), seed)


def _module_outputs(file: str, feeds: dict[str, np.ndarray], masks) -> dict[str, np.ndarray]:
    """The module's own outputs by field name, its masks as a tokenizer's 0/1 integers."""
    module = user_module(file).build().eval()
    with torch.no_grad():
        result = module(**{name: torch.from_numpy(value.astype(np.int64) if name in masks else value)
                           for name, value in feeds.items()})
    return {name: value.numpy() for name, value in result.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("file", list(FAMILIES))
def test_exports_fused_with_its_inputs_roles_sizes_and_tables(own_model, file):
    path, output = own_model(file)
    assert "parity PASSED" in output, output
    fused = describe_model(path).attention_ops
    assert [op.op for op in fused] == ["com.microsoft::MultiHeadAttention"] * LAYERS, output
    assert "Softmax" not in [node.op_type for node in all_nodes(onnx.load(str(path)).graph)]
    signature = MHASession(path, provider="cpu").signature
    recorded = {spec.name: (spec.role, spec.axes, spec.vocab) for spec in signature.inputs}
    assert recorded == FAMILIES[file]
    # Images and audio have no length axis: nothing is padded, so nothing is masked or packed.
    assert bool(signature.sequence_axes) == (file == "hf_segments")


@pytest.mark.parametrize("file", list(FAMILIES))
def test_equals_the_module_at_a_batch_the_export_never_saw(own_model, file):
    path, _ = own_model(file)
    signature = MHASession(path, provider="cpu").signature
    feeds = _feeds(signature)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip(signature.output_names, plain.run(list(signature.output_names), feeds), strict=True))
    expected = _module_outputs(file, feeds, signature.padding_masks)
    real = feeds.get("attention_mask")
    for name, have in got.items():
        want = expected[name]
        assert have.shape == want.shape and have.shape[0] == UNSEEN_BATCH, name
        if real is not None and have.ndim == 3:  # per token: real rows only
            want, have = want[real], have[real]
        np.testing.assert_allclose(have, want, atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL, err_msg=f"{file} {name}")


def test_segment_ids_use_their_own_table_in_the_export(own_model):
    """The probes and parity draw token_type_ids within their 2 rows and input_ids across the vocabulary: an id of
    each table's last row reaches the module and the file alike."""
    path, _ = own_model("hf_segments")
    signature = MHASession(path, provider="cpu").signature
    feeds = _feeds(signature, seed=4)
    feeds["input_ids"][:, 0], feeds["token_type_ids"][:, 1] = 95, 1
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (hidden,) = plain.run(["last_hidden_state"], feeds)
    want = _module_outputs("hf_segments", feeds, signature.padding_masks)["last_hidden_state"]
    real = feeds["attention_mask"]
    np.testing.assert_allclose(hidden[real], want[real], atol=OWN_MODEL_ATOL, rtol=OWN_MODEL_RTOL)


@pytest.mark.parametrize(("text", "role", "axis", "sizes"), [
    ("token_type_ids:segments", "segments", "seq", None),
    ("type_ids:segments:tgt_seq", "segments", "tgt_seq", None),
    ("pixel_values:image", "image", None, None),
    ("pixel_values:image:3x224x224", "image", None, (3, 224, 224)),
    ("input_features:audio:80x3000", "audio", None, (80, 3000)),
])
def test_input_declarations_parse(text, role, axis, sizes):
    decl = InputDecl.parse(text)
    assert (decl.role, decl.axis, decl.sizes) == (role, axis, sizes)


@pytest.mark.parametrize(("inputs", "message"), [
    (("pixel_values:image:seq",), "an image input has no length axis"),
    (("pixel_values:image:224",), r"sizes are CHANNELSxHEIGHTxWIDTH, e.g. pixel_values:image:3x224x224"),
    (("input_features:audio:80x3000x2",), r"sizes are mel, frames \(MELxFRAMES\)"),
    (("ids:tokens:8x8",), "sizes AxB are for an image or audio input"),
    (("ids:tokens", "type_ids:segments:other"), "segment ids mark the positions of a tokens input on their axis"),
    (("type_ids:segments",), "segment ids mark the positions of a tokens input"),
])
def test_impossible_declarations_are_refused(inputs, message):
    with pytest.raises(ExportError, match=message):
        declare_inputs(inputs)


@pytest.mark.parametrize(("text", "example"), [("pixel_values:image", "3x224x224"), ("feats:audio", "80x3000")])
def test_sizes_no_config_gives_must_be_declared(text, example):
    decl = InputDecl.parse(text)
    with pytest.raises(ExportError, match=f"declare them, e.g. --input {text}:{example}"):
        fixed_shape(torch.nn.Linear(2, 2), decl)


# --- optimize: the same families exported by plain torch.onnx.export ------------------------------------------


def _export_elsewhere(file: str, path) -> None:
    """torch.onnx.export of the module as its author would run it: batch dynamic, and the length where it has one;
    the first output only (last_hidden_state)."""
    import warnings

    module = user_module(file).build().eval()
    names = [spec.split(":")[0] for spec in user_module(file).INPUTS]

    class FirstOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = module

        def forward(self, *inputs):
            return self.module(**dict(zip(names, inputs, strict=True))).last_hidden_state

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    if file == "hf_segments":
        args = (torch.randint(0, 96, (2, 7)), torch.ones(2, 7, dtype=torch.int64), torch.zeros(2, 7, dtype=torch.int64))
        shapes = ({0: batch, 1: seq},) * 3
    else:
        args, shapes = (torch.randn(2, *FAMILIES[file][names[0]][1][1:]),), ({0: batch},)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(FirstOutput(), args, str(path), dynamo=True, input_names=names,
                          output_names=["last_hidden_state"], dynamic_shapes=(shapes,), verbose=False)


@pytest.mark.parametrize("file", ["hf_segments", "hf_vision"])
def test_optimize_takes_segment_ids_and_images(tmp_path, file):
    from mha_deploy.exporters import optimize_model

    source, written = tmp_path / "elsewhere.onnx", tmp_path / "optimized.onnx"
    _export_elsewhere(file, source)
    result = optimize_model(source, written, user_module(file).INPUTS)
    assert result.parity.passed
    assert [op.op for op in describe_model(written).attention_ops] == ["com.microsoft::MultiHeadAttention"] * LAYERS
    recorded = {spec.name: (spec.role, spec.axes, spec.vocab)
                for spec in MHASession(written, provider="cpu").signature.inputs}
    assert recorded == FAMILIES[file]


def test_export_hf_feeds_a_vit_folders_pixel_values_as_an_image(tmp_path):
    """``export --hf DIR`` takes pixel_values by its table's role, sizes from the folder's config, and leaves the
    attention_mask ViT's forward takes (and never reads) at its default."""
    from click.testing import CliRunner

    from mha_deploy.cli import main

    user_module("hf_vision").build().save_pretrained(tmp_path / "vit")
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path / "vit"), "-o", str(tmp_path / "out.onnx")])
    assert result.exit_code == 0, result.output
    assert "ViTModel: inputs pixel_values:image" in result.output
    recorded = {spec.name: (spec.role, spec.axes, spec.vocab)
                for spec in MHASession(tmp_path / "out.onnx", provider="cpu").signature.inputs}
    assert recorded == FAMILIES["hf_vision"]
