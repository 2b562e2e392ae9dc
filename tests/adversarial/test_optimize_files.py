"""``mha-deploy optimize`` on graph files as they come (issue 31): an output path that is the input, and external
data whose claimed size the files do not hold, or that no model file can hold."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from mha_deploy.cli import main
from tests.adversarial.conftest import assert_loud


def _graph_with_external_data(directory, rows: int = 4):
    """x [batch, seq, 4] @ w [4, rows], w kept in model.onnx.data beside model.onnx."""
    w = numpy_helper.from_array(np.ones((4, rows), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", rows])], [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    path = directory / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path


def _optimize(source, output):
    return CliRunner().invoke(main, ["optimize", str(source), "--input", "x:sequence", "-o", str(output)])


@pytest.mark.parametrize("alias", ["same path", "symlink", "hard link"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, alias):
    """It used to replace the source graph (its weights inlined) and leave its .data file orphaned."""
    source = _graph_with_external_data(tmp_path)
    before = source.read_bytes(), (tmp_path / "model.onnx.data").read_bytes()
    output = {"same path": tmp_path / "." / "model.onnx", "symlink": tmp_path / "link.onnx",
              "hard link": tmp_path / "hard.onnx"}[alias]
    if alias == "symlink":
        output.symlink_to(source)
    elif alias == "hard link":
        os.link(source, output)
    assert_loud(_optimize(source, output), f"-o {output} is the input graph itself", "a path of its own")
    assert (source.read_bytes(), (tmp_path / "model.onnx.data").read_bytes()) == before
    assert _optimize(source, tmp_path / "fused.onnx").exit_code == 0, "a path of its own is fine"


def _claim(source, dims: list[int], length: int | None) -> None:
    """Rewrite w's recorded shape and external-data length, the data file left as it is."""
    model = onnx.load(source, load_external_data=False)
    tensor = model.graph.initializer[0]
    tensor.dims[:] = dims
    kept = [(e.key, e.value) for e in tensor.external_data if e.key != "length"]
    del tensor.external_data[:]
    for key, value in kept + ([("length", str(length))] if length is not None else []):
        tensor.external_data.add(key=key, value=value)
    onnx.save_model(model, source)


@pytest.mark.parametrize("length", [None, 3_000_000_000], ids=["no-length", "length"])
def test_external_data_claiming_more_than_its_file_holds_is_refused_unread(tmp_path, length):
    """3 GB claimed over a 64-byte file: named, before anything is read."""
    source = _graph_with_external_data(tmp_path)
    _claim(source, [750_000_000], length)
    assert_loud(_optimize(source, tmp_path / "fused.onnx"), "tensor 'w'", "claims 3000000000 bytes",
                "the file holds 64")
    assert not (tmp_path / "fused.onnx").exists()


def test_external_data_beyond_what_one_model_file_holds_is_refused_unread(tmp_path):
    """A sparse 3 GB data file (no disk used) whose sizes all agree: reading it used to take ~10 GB of memory
    before protobuf refused the 2 GB message."""
    source = _graph_with_external_data(tmp_path)
    os.truncate(tmp_path / "model.onnx.data", 3_000_000_000)
    _claim(source, [4, 750_000_000 // 4], 3_000_000_000)
    assert_loud(_optimize(source, tmp_path / "fused.onnx"), f"{source}: its external data holds 3.0 GB",
                "limits to 2 GB")


def test_external_data_outside_the_models_directory_is_refused(tmp_path):
    (tmp_path / "inner").mkdir()
    source = _graph_with_external_data(tmp_path / "inner")
    model = onnx.load(source, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../model.onnx.data"
    onnx.save_model(model, source)
    assert_loud(_optimize(source, tmp_path / "fused.onnx"), "'../model.onnx.data'", "beside the model")


def test_optimize_model_raises_export_errors_that_keep_their_kind(tmp_path):
    """A Signature no model can have (an output named like an input) was a bare SignatureError, where the
    docstring says ExportError: now both."""
    from mha_deploy.errors import ExportError, SignatureError
    from mha_deploy.exporters.optimize import optimize_model

    source = _graph_with_external_data(tmp_path)
    with pytest.raises(ExportError) as refused:
        optimize_model(source, tmp_path / "fused.onnx", ["x:sequence"], output_names=["x"])
    assert isinstance(refused.value, SignatureError) and "declared twice" in str(refused.value)
    assert not (tmp_path / "fused.onnx").exists()
