"""The CLI through Click's runner and as a real process: happy paths, help, and one-line errors."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mha_deploy.checkpoint_names import PACKED, PROJECTIONS
from mha_deploy.cli import main
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention, save_checkpoint
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS, names_listed, randomise_parameters

D = TEST_D_MODEL
SMALL = ["--d-model", str(D), "--heads", str(TEST_HEADS)]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_items(path: Path, lengths=(3, 1, 8, 5), seed=0, d_model=D) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {f"id{i}": rng.standard_normal((n, d_model), dtype=np.float32) for i, n in enumerate(lengths)}
    np.savez(path, **arrays)
    return arrays


def assert_one_line_error(result, fragment: str):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and fragment in lines[-1], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [[], ["export"], ["infer"], ["inspect"]])
def test_help_shows_an_example(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "mha-deploy " in result.output and ("Example" in result.output or not command)


def test_export_infer_inspect(tmp_path):
    model = tmp_path / "mha.onnx"
    result = invoke("export", *SMALL, "--mask", "padding", "--seed", "3", "-o", model)
    assert result.exit_code == 0, result.output
    assert "parity PASSED" in result.stdout and "max abs err" in result.stdout
    assert "1 attention subgraph(s) found, 1 fused" in result.stdout

    items = write_items(tmp_path / "items.npz")
    out = tmp_path / "out.safetensors"
    result = invoke("infer", model, "--input", tmp_path / "items.npz", "--output", out, "--batch-size", "3",
                    "--provider", "cpu")
    assert result.exit_code == 0, result.output
    assert "4 items, 17 tokens" in result.stdout and "tokens/s" in result.stdout

    from safetensors.numpy import load_file

    outputs = load_file(out)
    session = MHASession(model, provider="cpu")
    assert set(outputs) == set(items)
    for item_id, x in items.items():
        expected = session.run({"x": x[None], "key_padding_mask": np.ones((1, len(x)), bool)})["output"][0]
        np.testing.assert_allclose(outputs[item_id], expected, atol=1e-5, rtol=1e-4)

    report = json.loads(invoke("inspect", model, "--json").stdout)
    assert [i["name"] for i in report["inputs"]] == ["x", "key_padding_mask"]
    assert report["inputs"][0]["dims"] == ["batch", "seq", D]
    assert report["metadata"]["signature"]["mask"] == "padding"
    text = invoke("inspect", model).stdout
    assert "parity PASSED" in text and "fusion=mha" in text
    assert "com.microsoft::MultiHeadAttention(query, key, value, key_padding_mask)" in text
    # The tensors feeding a fused op are the exporter's internal values: inspect names their roles instead.
    internal = {name for op in report["attention_ops"] for name in op["inputs"].values()} - {"x", "key_padding_mask"}
    assert internal and not [name for name in internal if name in text], text


def test_export_from_checkpoint(tmp_path):
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, TEST_HEADS).eval()
    checkpoint = tmp_path / "attn.safetensors"
    save_checkpoint(mha, checkpoint)
    model = tmp_path / "mha.onnx"
    result = invoke("export", "--checkpoint", checkpoint, "--attention", "cross", "-o", model)
    assert result.exit_code == 0, result.output
    x = np.random.default_rng(0).standard_normal((1, 3, D), dtype=np.float32)
    with torch.no_grad():
        expected = mha(*(torch.from_numpy(x),) * 3)[0].numpy()
    actual = MHASession(model, provider="cpu").run({"query": x, "key": x, "value": x})["output"]
    np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--attention", "cross", "--mask", "causal"], "needs self-attention"),
        (["--checkpoint", "missing.pt"], "missing.pt"),
        (["--model", "encoder", "--kv-cache"], "an encoder's attends both ways (use --model decoder)"),
    ],
)
def test_export_errors_leave_nothing(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    result = invoke("export", *args, "-o", "mha.onnx")
    assert_one_line_error(result, fragment)
    assert not Path("mha.onnx").exists()


def test_export_refuses_a_model_that_fails_parity(tmp_path, monkeypatch, defective_export):
    monkeypatch.chdir(tmp_path)
    result = invoke("export", *SMALL, "--fuse", "mha", "-o", "mha.onnx")
    assert_one_line_error(result, "parity FAILED")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--heads", "0"], "Invalid value for '--heads': 0 is not in the range x>=1"),
        (["--d-model", "0"], "Invalid value for '--d-model': 0 is not in the range x>=1"),
        (["--model", "encoder", "--layers", "0"], "Invalid value for '--layers': 0 is not in the range x>=1"),
        (["--model", "decoder", "--d-ff", "0"], "Invalid value for '--d-ff': 0 is not in the range x>=1"),
        (["--opset", "99"], "Invalid value for '--opset': 99 is not in the range 18<=x<=23"),
        (["--opset", "17"], "Invalid value for '--opset': 17 is not in the range 18<=x<=23"),
        (["--d-model", "10", "--heads", "3"], "d_model (10) must be divisible by num_heads (3)"),
        (["--model", "encoder", "--d-model", "10", "--heads", "3"], "d_model (10) must be divisible by num_heads (3)"),
        (["--layers", "2"], "--layers is for --model encoder or decoder"),
        (["--prefix", "layers.0.self_attn."], "--prefix picks the attention out of a --checkpoint; give one"),
        (["--model", "encoder", "--prefix", "layers.0."], "no --checkpoint, --prefix or --return-weights"),
    ],
)
def test_export_usage_errors_exit_2_and_leave_nothing(tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    result = invoke("export", *args, "-o", "mha.onnx")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert errors == [result.stderr.strip().splitlines()[-1]] and fragment in errors[0], result.stderr
    assert "Traceback" not in result.output and "unexpected" not in result.output
    assert list(tmp_path.iterdir()) == []


def _constant(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    ("command", "param", "constant"),
    [
        ("export", "fuse", "mha_deploy.exporters.export.FUSE_CHOICES"),
        ("export", "quantize", "mha_deploy.exporters.quantize.QUANTIZE_CHOICES"),
        ("export", "quant_method", "mha_deploy.exporters.quantize.QUANT_METHODS"),
        ("optimize", "quantize", "mha_deploy.exporters.quantize.QUANTIZE_CHOICES"),
        ("export", "dtype", "mha_deploy.exporters.precision.DTYPES"),
        ("export", "model_kind", "mha_deploy.metadata.MODEL_KINDS"),
        ("export", "attention", "mha_deploy.metadata.ATTENTION_KINDS"),
        ("export", "mask", "mha_deploy.metadata.MASK_MODES"),
        ("infer", "provider", "mha_deploy.runtime.providers.PROVIDER_CHOICES"),
        ("serve", "provider", "mha_deploy.runtime.providers.PROVIDER_CHOICES"),
        ("bench", "provider", "mha_deploy.runtime.providers.PROVIDER_CHOICES"),
        ("infer", "on_error", "mha_deploy.batching.ON_ERROR_CHOICES"),
        ("triton", "kind", "mha_deploy.serving.triton.KINDS"),
    ],
)
def test_choices_are_the_library_constants(command, param, constant):
    assert tuple(_param(command, param).type.choices) == tuple(_constant(constant))


def _param(command: str, name: str) -> click.Parameter:
    return next(p for p in main.commands[command].params if p.name == name)


def test_opset_range_is_what_the_exporter_supports():
    from mha_deploy.exporters.torch_export import DEFAULT_OPSET

    opset = _param("export", "opset")
    assert (opset.type.min, opset.type.max, opset.default) == (18, DEFAULT_OPSET, DEFAULT_OPSET)


@pytest.mark.parametrize("names", [("checkpoint", "prefix", "d_model", "heads"), ("provider", "threads")])
def test_shared_options_mean_the_same_everywhere(names):
    commands = [c for c in main.commands.values() if {p.name for p in c.params} >= set(names)]
    assert len(commands) >= 2
    for name in names:
        params = [_param(c.name, name) for c in commands]
        assert len({(p.help, repr(p.type)) for p in params}) == 1, name


def test_version_is_the_package_version():
    import mha_deploy

    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"mha-deploy, version {mha_deploy.__version__}"


def test_the_version_has_one_home():
    """pyproject.toml reads the version from mha_deploy/__init__.py (hatch's dynamic version): no second copy."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == "mha_deploy/__init__.py"


@pytest.mark.parametrize(
    ("command", "new", "old", "param"),
    [
        ("infer", "--max-batch-tokens", "--max-tokens", "max_batch_tokens"),
        ("serve", "--max-item-tokens", "--max-tokens", "max_item_tokens"),
    ],
)
def test_renamed_flags_take_both_spellings_and_help_shows_the_new_one(command, new, old, param):
    cmd = main.commands[command]
    required = ["--input", "in.npz", "--output", "out.npz"] if command == "infer" else []
    for spelling in (new, old):
        ctx = cmd.make_context(command, ["m.onnx", *required, spelling, "64"])
        assert ctx.params[param] == 64, spelling
    help_text = invoke(command, "--help").output
    assert new in help_text and old not in help_text


def test_serve_batching_flags_reach_one_batching_config(monkeypatch):
    import mha_deploy.serving.http as http
    from mha_deploy.batching import BatchingConfig

    configs = []
    monkeypatch.setattr(http, "serve", configs.append)
    assert invoke("serve", "m.onnx").exit_code == 0
    assert configs[0].batching == BatchingConfig()
    result = invoke("serve", "m.onnx", "--max-batch", "4", "--max-batch-tokens", "512", "--max-item-tokens", "100")
    assert result.exit_code == 0, result.output
    assert (configs[1].batching.max_batch, configs[1].batching.max_batch_tokens) == (4, 512)
    assert configs[1].limits.max_item_tokens == 100


def test_drain_timeout_reaches_the_serve_config(monkeypatch):
    import mha_deploy.serving.http as http

    configs = []
    monkeypatch.setattr(http, "serve", configs.append)
    result = invoke("serve", "mha.onnx", "--drain-timeout", "7.5", "--provider", "cpu", "--threads", "3")
    assert result.exit_code == 0, result.output
    assert (configs[0].graceful_timeout_s, configs[0].provider, configs[0].threads) == (7.5, "cpu", 3)
    assert invoke("serve", "mha.onnx").exit_code == 0
    assert configs[1].graceful_timeout_s == http.ServeConfig("m.onnx").graceful_timeout_s
    assert invoke("serve", "mha.onnx", "--drain-timeout", "-1").exit_code == 2


def test_embedding_flags_reach_the_serve_config(monkeypatch):
    import mha_deploy.serving.http as http

    configs = []
    monkeypatch.setattr(http, "serve", configs.append)
    assert invoke("serve", "m.onnx").exit_code == 0
    assert configs[0].embeddings == http.EmbeddingOptions()
    result = invoke("serve", "m.onnx", "--raw-embeddings", "--embedding-output", "sentence_embedding")
    assert result.exit_code == 0, result.output
    assert configs[1].embeddings == http.EmbeddingOptions(normalize=False, output="sentence_embedding")


def test_cli_imports_neither_torch_nor_onnxruntime():
    code = "import mha_deploy.cli, sys; print(sorted(m for m in ('torch','onnxruntime') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_export_checkpoint_with_unknown_keys(tmp_path):
    state = MultiHeadAttention(D, TEST_HEADS).state_dict()
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "bad.pt")
    result = invoke("export", "--checkpoint", tmp_path / "bad.pt", "--heads", "4", "-o", tmp_path / "m.onnx")
    assert_one_line_error(result, "extra.weight")
    assert not (tmp_path / "m.onnx").exists()


@pytest.fixture(scope="module")
def padded_model(export_model):
    return export_model(Signature("self", "padding"))[0]


@pytest.mark.parametrize(
    ("make_input", "fragment"),
    [
        (lambda p: write_items(p, d_model=D + 2), "item 'id0': x has d_model 66"),
        (
            lambda p: np.savez(p, good=np.ones((2, D), np.float32), bad=np.ones((2, D), bool)),
            "item 'bad': x holds bool",
        ),
        (lambda p: np.savez(p, empty=np.ones((0, D), np.float32)), "item 'empty': x is empty"),
        (lambda p: p.write_bytes(b"not a zip"), "cannot read arrays"),
    ],
)
def test_infer_bad_input_writes_nothing(tmp_path, padded_model, make_input, fragment):
    make_input(tmp_path / "items.npz")
    result = invoke("infer", padded_model, "--input", tmp_path / "items.npz", "--output", tmp_path / "out.npz",
                    "--provider", "cpu")
    assert_one_line_error(result, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["items.npz"]


def test_infer_resume_with_nothing_to_do_writes_nothing_and_says_so(tmp_path, padded_model):
    write_items(tmp_path / "items.npz")
    args = ["infer", padded_model, "--input", tmp_path / "items.npz", "--output", tmp_path / "out.npz",
            "--provider", "cpu", "--no-progress"]
    first = invoke(*args)
    assert first.exit_code == 0 and f"wrote {tmp_path / 'out.npz'}" in first.stdout, first.output
    written = (tmp_path / "out.npz").stat().st_mtime_ns
    again = invoke(*args)
    assert again.exit_code == 0, again.output
    assert "wrote" not in again.stdout and "nothing to do" in again.stdout, again.stdout
    assert (tmp_path / "out.npz").stat().st_mtime_ns == written


def test_infer_fp16_model_takes_the_float32_dataset(tmp_path, export_model):
    """The documented dataset formats hold float32: an fp16 model casts them, as the HTTP server does."""
    model = export_model(Signature("self", "padding"), dtype="fp16")[0]
    items = write_items(tmp_path / "items.npz")
    result = invoke("infer", model, "--input", tmp_path / "items.npz", "--output", tmp_path / "out.npz",
                    "--provider", "cpu", "--no-progress")
    assert result.exit_code == 0, result.output
    session = MHASession(model, provider="cpu")
    with np.load(tmp_path / "out.npz") as outputs:
        assert sorted(outputs.files) == sorted(items)
        for item_id, x in items.items():
            feeds = {"x": x[None].astype(np.float16), "key_padding_mask": np.ones((1, len(x)), bool)}
            # Batched with padding vs alone: the same fp16 model, a last-bit rounding apart at most.
            np.testing.assert_allclose(outputs[item_id], session.run(feeds)["output"][0], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("model", "fragment"), [("missing.onnx", "model file not found"), ("corrupt.onnx", "cannot load it")]
)
def test_infer_bad_model(tmp_path, model, fragment):
    (tmp_path / "corrupt.onnx").write_bytes(b"garbage")
    write_items(tmp_path / "items.npz")
    result = invoke("infer", tmp_path / model, "--input", tmp_path / "items.npz", "--output", tmp_path / "o.npz",
                    "--provider", "cpu")
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "o.npz").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = CliRunner().invoke(main, ["--debug", "inspect", str(tmp_path / "missing.onnx")])
    assert result.exit_code == 1 and type(result.exception).__name__ == "ModelFileError"


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("mha-deploy")
    return [str(script)] if script.exists() else [shutil.which("mha-deploy") or "mha-deploy"]


def test_real_process(tmp_path):
    model, items, out = tmp_path / "m.onnx", tmp_path / "items.npz", tmp_path / "out.npz"
    run = lambda *args: subprocess.run([*_cli(), *map(str, args)], capture_output=True, text=True, timeout=300)  # noqa: E731
    result = run("export", *SMALL, "--mask", "causal", "-o", model)
    assert result.returncode == 0, result.stderr
    write_items(items)
    result = run("infer", model, "--input", items, "--output", out, "--no-progress", "--provider", "cpu")
    assert result.returncode == 0, result.stderr
    assert "items/s" in result.stdout
    with np.load(out) as outputs:
        assert sorted(outputs.files) == ["id0", "id1", "id2", "id3"] and outputs["id2"].shape == (8, D)
    result = run("infer", model, "--input", items, "--output", items, "--provider", "cpu")
    assert result.returncode == 2 and "must differ from --input" in result.stderr
    result = run("inspect", tmp_path / "nope.onnx")
    assert result.returncode == 1 and result.stderr.strip() == f"error: model file not found: {tmp_path / 'nope.onnx'}"


def test_export_kv_cache_and_inspect_shows_the_cache(tmp_path):
    model = tmp_path / "decode.onnx"
    result = invoke("export", *SMALL, "--mask", "padding-causal", "--kv-cache", "-o", model)
    assert result.exit_code == 0, result.output
    assert "parity PASSED" in result.stdout and "+" in result.stdout
    text = invoke("inspect", model).stdout
    assert "past_key -> present_key" in text and "[batch, total_seq]" in text
    assert json.loads(invoke("inspect", model, "--json").stdout)["metadata"]["signature"]["kv_cache"] is True


def test_export_kv_cache_without_causal_mask_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke("export", *SMALL, "--mask", "padding", "--kv-cache", "-o", "m.onnx"),
                          "needs causal self-attention")
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_help_names_every_accepted_name():
    help_text = invoke("export", "--help").output
    for role, aliases in PROJECTIONS.values():
        assert names_listed(help_text, role) == list(aliases)
    flat = " ".join(help_text.split())
    for name in PACKED:
        assert name in flat
    assert "--prefix TEXT" in help_text and "encoder.layers.0.self_attn." in flat


def test_missing_projection_error_names_its_every_alias(tmp_path):
    state = {k.replace("W_o.", "final."): v for k, v in MultiHeadAttention(D, TEST_HEADS).state_dict().items()}
    torch.save(state, tmp_path / "attn.pt")
    result = invoke("export", "--checkpoint", tmp_path / "attn.pt", "--heads", "4", "-o", tmp_path / "m.onnx")
    assert_one_line_error(result, "missing W_o.weight, W_o.bias; unexpected keys: final.weight, final.bias")
    assert names_listed(result.stderr, "output") == list(PROJECTIONS["W_o"][1])
    assert not (tmp_path / "m.onnx").exists()


@pytest.fixture(scope="module")
def encoder_checkpoint(tmp_path_factory):
    """A 2-layer nn.TransformerEncoder's state dict in a .pt file, and the encoder."""
    layer = torch.nn.TransformerEncoderLayer(D, TEST_HEADS, dim_feedforward=2 * D, batch_first=True)
    encoder = randomise_parameters(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), 5)
    path = tmp_path_factory.mktemp("checkpoints") / "encoder.pt"
    torch.save(encoder.state_dict(), path)
    return path, encoder


def _padded_batch(seed=0):
    x = np.random.default_rng(seed).standard_normal((2, 6, D), dtype=np.float32)
    real = np.ones((2, 6), bool)
    real[0, 4:] = False  # right padding
    real[1, :2] = False  # left padding
    return x, real


def _assert_runs_like_torch_attention(model: Path, torch_mha: torch.nn.MultiheadAttention):
    """The exported file, in ORT, computes what ``torch_mha`` does on the real rows of a padded batch."""
    x, real = _padded_batch()
    with torch.no_grad():
        expected, _ = torch_mha(*(torch.from_numpy(x),) * 3, key_padding_mask=torch.from_numpy(~real),
                                need_weights=False)
    actual = MHASession(model, provider="cpu").run({"x": x, "key_padding_mask": real})["output"]
    np.testing.assert_allclose(actual[real], expected.numpy()[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layer", [1, 0])
def test_export_attention_out_of_a_transformer_encoder(tmp_path, encoder_checkpoint, layer):
    path, encoder = encoder_checkpoint
    model = tmp_path / "attn.onnx"
    result = invoke("export", "--checkpoint", path, "--prefix", f"layers.{layer}.self_attn.", "--heads", TEST_HEADS,
                    "--mask", "padding", "-o", model)
    assert result.exit_code == 0, result.output
    assert "parity PASSED" in result.stdout and "1 attention subgraph(s) found, 1 fused" in result.stdout
    _assert_runs_like_torch_attention(model, encoder.layers[layer].self_attn)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "several prefixes; to take one attention block out of a bigger checkpoint, pass its prefix "
             "(--prefix; prefix= in Python), one of 'layers.0.self_attn.', 'layers.1.self_attn.'"),
        (["--prefix", "layers.2.self_attn."], "no key starts with the prefix 'layers.2.self_attn.'"),
    ],
)
def test_export_from_a_bigger_checkpoint_without_its_prefix(tmp_path, encoder_checkpoint, args, fragment):
    result = invoke("export", "--checkpoint", encoder_checkpoint[0], *args, "--heads", TEST_HEADS,
                    "-o", tmp_path / "attn.onnx")
    assert_one_line_error(result, fragment)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def bias_free_checkpoint(tmp_path_factory):
    """nn.MultiheadAttention(bias=False)'s state dict (in_proj_weight, out_proj.weight), and the module."""
    torch_mha = randomise_parameters(torch.nn.MultiheadAttention(D, TEST_HEADS, bias=False, batch_first=True), 6)
    path = tmp_path_factory.mktemp("checkpoints") / "bias-free.safetensors"
    save_checkpoint(torch_mha, path)
    return path, torch_mha


@pytest.mark.parametrize(
    "args",
    [
        ["--mask", "padding"],
        ["--mask", "padding-causal"],
        ["--attention", "cross", "--fuse", "onnx", "--return-weights"],
        ["--mask", "padding-causal", "--kv-cache"],
        ["--mask", "padding", "--quantize", "int8-dynamic"],
    ],
    ids=lambda args: "-".join(a.strip("-") for a in args),
)
def test_export_bias_free_checkpoint(tmp_path, bias_free_checkpoint, args):
    model = tmp_path / "attn.onnx"
    result = invoke("export", "--checkpoint", bias_free_checkpoint[0], *args, "-o", model)
    assert result.exit_code == 0, result.output
    assert "parity PASSED" in result.stdout and "0 left unfused" in result.stdout
    if args == ["--mask", "padding"]:
        _assert_runs_like_torch_attention(model, bias_free_checkpoint[1])
