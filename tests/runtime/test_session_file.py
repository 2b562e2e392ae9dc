"""session_file: a model file's graph without its weights' bytes, the same model to onnx and to ORT."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.runtime.session_file import STRIP_BYTES, graph_bytes, read_graph
from tests.conftest import TEST_D_MODEL

KV = Signature("self", "padding-causal", kv_cache=True)


def _without_data(model: onnx.ModelProto) -> bytes:
    for tensor in model.graph.initializer:
        for field in ("raw_data", "external_data", "data_location"):
            tensor.ClearField(field)
    return model.SerializeToString()


def test_the_graph_read_apart_is_the_same_model(export_model):
    """Every weight reads back bitwise equal through its reference into the file; everything else is onnx.load's."""
    path = export_model(KV)[0]
    full, light = onnx.load(path), read_graph(path)
    _, left = graph_bytes(path)
    inline = {t.name: t for t in full.graph.initializer}
    moved = [t for t in light.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert moved, "no weight of the test model was left in the file: the test reads nothing apart"
    assert left == sum(len(inline[t.name].raw_data) for t in moved)
    assert all(len(inline[t.name].raw_data) >= STRIP_BYTES for t in moved)
    for tensor in light.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor, str(path.parent)),
                                      numpy_helper.to_array(inline[tensor.name]))
    assert _without_data(light) == _without_data(full)


def test_a_session_on_the_graph_apart_gives_the_files_outputs(export_model):
    """MHASession loads the graph alone and the weights as external data: outputs bitwise equal to ORT on the file
    (tolerance 0: the same kernels on the same weights); a KV-cache file's session plans no memory pattern."""
    path = export_model(KV)[0]
    session = MHASession(path, provider="cpu", threads=1)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    plain = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    heads, d_k = session.metadata.num_heads, TEST_D_MODEL // session.metadata.num_heads
    past = rng.standard_normal((2, heads, 3, d_k)).astype(np.float32)
    feeds = {"x": rng.standard_normal((2, 2, TEST_D_MODEL)).astype(np.float32), "past_key": past,
             "past_value": past, "key_padding_mask": np.ones((2, 5), bool)}
    ours = session.run(feeds)
    theirs = dict(zip([o.name for o in plain.get_outputs()], plain.run(None, feeds), strict=True))
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)
    assert not session._session.get_session_options().enable_mem_pattern
    encoder = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    assert encoder._session.get_session_options().enable_mem_pattern


def test_weights_already_external_are_left_as_they_are(tmp_path, export_model):
    model = onnx.load(export_model(KV)[0])
    path = tmp_path / "external.onnx"
    onnx.save(model, path, save_as_external_data=True, location="external.onnx.data", size_threshold=1024)
    light, left = read_graph(path), graph_bytes(path)[1]
    assert left == 0
    assert light.SerializeToString() == onnx.load(path, load_external_data=False).SerializeToString()
    MHASession(path, provider="cpu")  # its load check runs probe batches through it


@pytest.mark.parametrize("content", [b"", b"\x08\x07garbage" * 10, b"\x0a\xff\xff\xff\x0f"])
def test_not_onnx_is_returned_for_onnx_to_refuse(tmp_path, content):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    data, left = graph_bytes(path)
    assert left == 0 and data == content


def test_a_file_reached_through_a_link_loads_with_its_weights(tmp_path, export_model):
    """A link to the file (a Hugging Face cache keeps its files as links to blobs, under other names) loads: the
    weights are read from the target's folder under the target's name, and its outputs equal the file's (exactly)."""
    path = export_model(Signature("self", "padding"))[0]
    link = tmp_path / "linked.onnx"
    link.symlink_to(path)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, TEST_D_MODEL)).astype(np.float32),
             "key_padding_mask": np.array([[1, 1, 1], [1, 1, 0]], bool)}
    linked, direct = MHASession(link, provider="cpu").run(feeds), MHASession(path, provider="cpu").run(feeds)
    for name, value in direct.items():
        np.testing.assert_array_equal(linked[name], value, err_msg=name)
