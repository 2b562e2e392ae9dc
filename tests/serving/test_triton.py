"""Triton model repository export: the config parses with Triton's own protobuf and agrees with the ONNX model."""

from __future__ import annotations

import onnx
import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from mha_deploy.cli import main
from mha_deploy.errors import ModelFileError
from mha_deploy.metadata import Signature
from mha_deploy.serving.triton import TritonConfig, TritonExportError, write_triton_model
from tests.conftest import KV_DECODER, TEST_D_MODEL, TEST_HEADS, signature_id

ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.INT64: "TYPE_INT64",
}
SIGNATURES = [
    Signature("self", "none"),
    Signature("self", "padding-causal"),
    Signature("cross", "padding"),
    Signature("self", "causal", return_weights=True),
]


def parse_config(path):
    """Triton's ModelConfig parsed from config.pbtxt (syntax, field names and enum values)."""
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def check_against_model(config, model: onnx.ModelProto) -> None:
    """The rules Triton checks only at load time: names, dtypes and ranks against the ONNX graph."""
    batched = config.max_batch_size > 0
    for section, values in (("input", model.graph.input), ("output", model.graph.output)):
        graph = {v.name: v.type.tensor_type for v in values}
        declared = {t.name: t for t in getattr(config, section)}
        assert set(declared) == set(graph), f"{section} names differ from the ONNX graph"
        for name, tensor in declared.items():
            onnx_type = graph[name]
            assert model_config_pb2.DataType.Name(tensor.data_type) == ONNX_TO_TRITON[onnx_type.elem_type], name
            rank = len(onnx_type.shape.dim)
            assert len(tensor.dims) == (rank - 1 if batched else rank), f"{name}: dims vs max_batch_size"
            onnx_dims = onnx_type.shape.dim[1:] if batched else onnx_type.shape.dim
            for dim, onnx_dim in zip(tensor.dims, onnx_dims, strict=True):
                if onnx_dim.HasField("dim_value") and onnx_dim.dim_value > 0:
                    assert dim == onnx_dim.dim_value, f"{name}: fixed dim {onnx_dim.dim_value} declared as {dim}"
                else:
                    assert dim == -1, f"{name}: dynamic axis {onnx_dim.dim_param!r} declared as {dim}"


@pytest.mark.parametrize("signature", SIGNATURES, ids=signature_id)
@pytest.mark.parametrize("max_batch_size", [16, 0])
def test_config_parses_and_matches_the_model(export_model, tmp_path, signature, max_batch_size):
    path, _ = export_model(signature)
    # CUDA cannot run ONNX Attention's qk_matmul_output (weights) nor fp32 GroupQueryAttention (causal
    # --fuse auto): --kind gpu refuses those (tests/runtime/test_cuda_decisions.py), so they go on CPU instances.
    kind = "cpu" if signature.return_weights or signature.is_causal else "gpu"
    config_in = TritonConfig(name="mha", instances=2, kind=kind, max_batch_size=max_batch_size)
    target = write_triton_model(path, tmp_path / "repo", config_in)

    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == [
        "1", "1/model.onnx", "config.pbtxt"
    ]
    assert (target / "1" / "model.onnx").read_bytes() == path.read_bytes()
    config = parse_config(target / "config.pbtxt")
    assert config.name == "mha" and config.backend == "onnxruntime"
    assert config.max_batch_size == max_batch_size
    assert config.HasField("dynamic_batching") == (max_batch_size > 0)
    assert [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in config.instance_group] == [
        (2, f"KIND_{kind.upper()}")
    ]
    check_against_model(config, onnx.load(target / "1" / "model.onnx"))
    dims = {t.name: list(t.dims) for t in (*config.input, *config.output)}
    batch = [] if max_batch_size else [-1]
    assert dims["output"] == [*batch, -1, TEST_D_MODEL]
    if signature.return_weights:
        assert dims["attn_weights"] == [*batch, TEST_HEADS, -1, -1]


def test_decoder_stack(tmp_path):
    """Inputs come from the model's signature: a decoder's memory and memory_padding_mask too."""
    import torch

    from mha_deploy.exporters import export_stack
    from mha_deploy.models import Decoder

    torch.manual_seed(0)
    path = export_stack(Decoder(1, TEST_D_MODEL, TEST_HEADS, TEST_D_MODEL), tmp_path / "dec.onnx", mask="padding").path
    target = write_triton_model(path, tmp_path / "repo", TritonConfig(name="decoder"))
    config = parse_config(target / "config.pbtxt")
    check_against_model(config, onnx.load(target / "1" / "model.onnx"))
    assert [t.name for t in config.input] == ["x", "memory", "key_padding_mask", "memory_padding_mask"]


def test_cli_writes_the_repository(export_model, tmp_path):
    path, _ = export_model(Signature("self", "padding"))
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["triton", str(path), "--repo", str(repo), "--instances", "3"])
    assert result.exit_code == 0, result.output
    config = parse_config(repo / path.stem / "config.pbtxt")
    assert config.name == path.stem and config.instance_group[0].count == 3
    assert config.dynamic_batching.max_queue_delay_microseconds == 500

    again = CliRunner().invoke(main, ["triton", str(path), "--repo", str(repo)])
    assert again.exit_code == 1 and "already exists; pass --overwrite" in again.stderr
    replaced = CliRunner().invoke(main, ["triton", str(path), "--repo", str(repo), "--overwrite", "--instances", "1"])
    assert replaced.exit_code == 0, replaced.output
    assert parse_config(repo / path.stem / "config.pbtxt").instance_group[0].count == 1
    assert sorted(p.name for p in repo.iterdir()) == [path.stem], "no staging or backup directory is left"


def test_help_shows_an_example():
    result = CliRunner().invoke(main, ["triton", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "mha-deploy triton" in result.output


def test_failed_export_leaves_nothing(export_model, tmp_path, monkeypatch):
    path, _ = export_model(Signature())
    repo = tmp_path / "repo"
    import mha_deploy.serving.triton as triton

    def broken_copy(src, dst):
        with open(dst, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(triton.shutil, "copyfile", broken_copy)
    with pytest.raises(TritonExportError, match=r"repo/mha: cannot write the model repository entry \(disk full\)"):
        write_triton_model(path, repo, TritonConfig(name="mha"))
    assert not repo.exists(), "the repository directory the export created, left empty, is removed"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (TritonConfig(name="bad/name"), "model name"),
        (TritonConfig(name=".hidden"), "model name"),
        (TritonConfig(kind="tpu"), "kind must be one of"),
        (TritonConfig(instances=0), "instances must be >= 1"),
        (TritonConfig(version=0), "version must be >= 1"),
    ],
)
def test_bad_config(export_model, tmp_path, config, message):
    with pytest.raises(TritonExportError, match=message):
        write_triton_model(export_model(Signature())[0], tmp_path / "repo", config)
    assert not (tmp_path / "repo").exists()


def test_not_an_mha_deploy_model(tmp_path):
    with pytest.raises(ModelFileError, match="model file not found"):
        write_triton_model(tmp_path / "missing.onnx", tmp_path / "repo")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(ModelFileError):
        write_triton_model(garbage, tmp_path / "repo")


@pytest.mark.parametrize(
    "signature", [Signature("self", mask, kv_cache=True) for mask in ("causal", "padding-causal")] + [KV_DECODER],
    ids=signature_id,
)
def test_kv_cache_model_gets_sequence_batching_with_implicit_state(export_model, tmp_path, signature):
    path, _ = export_model(signature)
    target = write_triton_model(path, tmp_path / "repo", TritonConfig(name="kv", max_batch_size=16))
    config = parse_config(target / "config.pbtxt")
    assert config.max_batch_size == 1, "one sequence per run: caches of different lengths cannot share a batch"
    assert not config.HasField("dynamic_batching") and config.HasField("sequence_batching")
    # Clients send the new tokens (a decoder: and its memory, with every request); Triton holds the caches.
    sent = [name for name in signature.input_names if name not in signature.cache_pairs]
    assert [t.name for t in config.input] == sent
    assert [t.name for t in config.output] == ["output"]
    d_k = TEST_D_MODEL // TEST_HEADS
    states = {(s.input_name, s.output_name): s for s in config.sequence_batching.state}
    assert set(states) == set(signature.cache_pairs.items())
    if signature.model == "decoder":
        assert ("past_key_values.1.encoder_value", "present.1.encoder_value") in states and len(states) == 8
    for state in states.values():
        assert model_config_pb2.DataType.Name(state.data_type) == "TYPE_FP32"
        assert list(state.dims) == [TEST_HEADS, -1, d_k]
        assert list(state.initial_state[0].dims) == [TEST_HEADS, 0, d_k] and state.initial_state[0].zero_data
    graph = onnx.load(target / "1" / "model.onnx").graph
    declared = {v.name for v in (*graph.input, *graph.output)}
    assert {name for pair in states for name in pair} <= declared
