"""The Open Inference Protocol over REST, driven by tritonclient.http (JSON and binary tensors), on a real server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS
from tests.serving.helpers import V2_DATATYPES, assert_matches, batch_request

httpclient = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http] (the dev extra)")
from tritonclient.utils import InferenceServerException  # noqa: E402

D = TEST_D_MODEL



@pytest.fixture(scope="module")
def cross_session(export_model):
    return MHASession(export_model(Signature("cross", "padding", return_weights=True))[0], provider="cpu")


def infer(client, model: str, inputs: dict[str, np.ndarray], binary: bool = True, outputs=None, **kwargs):
    """One request through tritonclient.http; returns (every output by name, the response JSON)."""
    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), V2_DATATYPES[array.dtype])
        tensor.set_data_from_numpy(array, binary_data=binary)
        tensors.append(tensor)
    requested = None
    if outputs is not None:
        requested = [httpclient.InferRequestedOutput(name, binary_data=as_binary) for name, as_binary in outputs]
    result = client.infer(model, tensors, outputs=requested, **kwargs)
    response = result.get_response()
    return {o["name"]: result.as_numpy(o["name"]) for o in response["outputs"]}, response


def test_health_and_metadata(v2_server):
    client = httpclient.InferenceServerClient(v2_server.url)
    assert client.is_server_live() and client.is_server_ready()
    # The default model name is the file's stem (the fixture's file is "self-padding-auto.onnx").
    assert client.is_model_ready(v2_server.model.stem)
    server = client.get_server_metadata()
    assert server["name"] == "mha-deploy" and server["version"] and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata(v2_server.model.stem)
    assert meta["name"] == v2_server.model.stem and meta["versions"] == ["1"]
    assert meta["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, -1, D]},
        {"name": "key_padding_mask", "datatype": "BOOL", "shape": [-1, -1]},
    ]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, -1, D]}]
    assert client.get_model_metadata(v2_server.model.stem, model_version="1")["name"] == v2_server.model.stem


def test_cross_attention_metadata_lists_both_outputs(cross_server):
    meta = httpclient.InferenceServerClient(cross_server.url).get_model_metadata("cross")
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [
        ("query", [-1, -1, D]), ("key", [-1, -1, D]), ("value", [-1, -1, D]), ("key_padding_mask", [-1, -1])]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [
        ("output", [-1, -1, D]), ("attn_weights", [-1, TEST_HEADS, -1, -1])]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("padding", ["right", "left", "mixed"])
def test_inference_equals_the_session(v2_server, session, binary, padding):
    """Right padding goes through the micro-batcher, left/mixed padding runs as its own batch: both exact."""
    rng = np.random.default_rng(len(padding) + binary)
    inputs = batch_request(session.signature, rng, 4, [5, 1, 9, 3], D, padding)
    outputs, response = infer(httpclient.InferenceServerClient(v2_server.url), v2_server.model.stem, inputs,
                              binary=binary, request_id=f"req-{padding}")
    assert response["id"] == f"req-{padding}" and response["model_name"] == v2_server.model.stem
    assert set(outputs) == {"output"}
    assert_matches(session, inputs, outputs)


@pytest.mark.parametrize("as_binary", [True, False], ids=["binary-output", "json-output"])
def test_outputs_selects_and_formats_outputs(cross_server, cross_session, as_binary):
    rng = np.random.default_rng(5)
    inputs = batch_request(cross_session.signature, rng, 3, [4, 7, 2], D, "right", kv_lengths=[6, 3, 8])
    client = httpclient.InferenceServerClient(cross_server.url)
    outputs, response = infer(client, "cross", inputs, outputs=[("attn_weights", as_binary)])
    assert list(outputs) == ["attn_weights"]
    assert ("parameters" in response["outputs"][0]) == as_binary
    assert_matches(cross_session, inputs, outputs)
    # No outputs named: all of them, binary (what tritonclient asks for by default).
    outputs, response = infer(client, "cross", inputs, binary=False)
    assert list(outputs) == ["output", "attn_weights"]
    assert all(o["parameters"]["binary_data_size"] > 0 for o in response["outputs"])
    assert_matches(cross_session, inputs, outputs)


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def _tensor(name: str, array: np.ndarray, datatype: str | None = None, binary: bool = True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype or V2_DATATYPES[array.dtype])
    return tensor.set_data_from_numpy(array, binary_data=binary)


X = np.ones((2, 3, D), np.float32)
ALL_REAL = np.ones((2, 3), bool)
BAD_REQUESTS = [
    ("wrong_datatype", [_tensor("x", X.astype(np.int32))], "datatype 'INT32', this model takes FP32"),
    ("wrong_d_model", [_tensor("x", np.ones((2, 3, D + 1), np.float32))], f"d_model {D + 1}"),
    ("wrong_rank", [_tensor("x", np.ones((3, D), np.float32))], "this model takes [-1, -1, 64]"),
    ("unknown_input", [_tensor("y", X)], "unknown input 'y'"),
    ("mask_length", [_tensor("x", X), _tensor("key_padding_mask", np.ones((2, 4), bool))], "key_padding_mask"),
    ("empty_mask_row", [_tensor("x", X), _tensor("key_padding_mask", np.array([[1, 1, 0], [0, 0, 0]], bool))],
     "no real token"),
    ("nan", [_tensor("x", np.full((2, 3, D), np.nan, np.float32), binary=False), _tensor("key_padding_mask", ALL_REAL)],
     "NaN"),
    # The mask is required, as MHASession and the Triton config require it.
    ("no_mask", [_tensor("x", X)], "missing key_padding_mask: this model takes x, key_padding_mask"),
    ("too_many_tokens", [_tensor("x", np.ones((1, 257, D), np.float32))], "at most 256"),
]


@pytest.mark.parametrize(("case", "tensors", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_400_with_the_protocol_error(v2_server, session, case, tensors, message):
    client = httpclient.InferenceServerClient(v2_server.url)
    error = _error(lambda: client.infer(v2_server.model.stem, tensors))
    assert error.status() == "400", error
    assert message in error.message(), error.message()
    assert str(v2_server.model.parent) not in error.message(), "no file path in responses"
    outputs, _ = infer(client, v2_server.model.stem, {"x": X, "key_padding_mask": ALL_REAL})
    assert_matches(session, {"x": X, "key_padding_mask": ALL_REAL}, outputs)


def test_unknown_model_version_and_output(v2_server):
    client = httpclient.InferenceServerClient(v2_server.url)
    error = _error(lambda: client.infer("nope", [_tensor("x", X)]))
    assert error.status() == "404" and "unknown model 'nope'" in error.message()
    error = _error(lambda: client.infer(v2_server.model.stem, [_tensor("x", X)], model_version="2"))
    assert error.status() == "404"
    error = _error(lambda: client.get_model_metadata("nope"))
    assert error.status() == "404"
    assert not client.is_model_ready("nope")
    requested = [httpclient.InferRequestedOutput("attn_weights")]
    error = _error(lambda: client.infer(v2_server.model.stem, [_tensor("x", X)], outputs=requested))
    assert error.status() == "400" and "unknown output 'attn_weights'" in error.message()


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    status, _, payload = server.request("POST", path, body, headers)
    return status, json.loads(payload)


def test_malformed_bodies_get_400(v2_server):
    """What tritonclient never sends: broken JSON, deep nesting, binary sizes that do not add up."""
    path = f"/v2/models/{v2_server.model.stem}/infer"
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 2, D], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 2 * D * 4}}]}).encode()
    raw = np.ones((1, 2, D), np.float32).tobytes()
    cases = [
        (b"{", {}, "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, {}, "nested too deeply"),
        (b'{"inputs": [{"name": "x", "shape": [1, 1, 64], "datatype": "FP32", "data": ' + b"[" * 5000 + b"1"
         + b"]" * 5000 + b"}]}", {}, "nested too deeply"),
        (header + raw[:-4], {"Inference-Header-Content-Length": str(len(header))}, "runs past the end"),
        (header + raw + b"xx", {"Inference-Header-Content-Length": str(len(header))}, "no input claims"),
        (header + raw, {"Inference-Header-Content-Length": "-3"}, "Inference-Header-Content-Length"),
        (b'{"inputs": []}', {}, "non-empty list of inputs"),
        (b'{"inputs": [{"name": "x", "shape": [1, 1, 64], "datatype": "FP32"}]}', {}, "neither data nor"),
        (b'{"inputs": [{"name": "x", "shape": [1, 2, 64], "datatype": "FP32", "data": [1.0]}]}', {}, "needs 128"),
        (b'{"inputs": [{"name": "x", "shape": [1, 1, 64], "datatype": "FP32", "data": ' + json.dumps(
            [True] * D).encode() + b"}]}", {}, "expected numbers"),
        (b'{"id": 5, "inputs": []}', {}, "id must be a string"),
    ]
    for body, headers, message in cases:
        status, payload = _post(v2_server, path, body, headers)
        assert status == 400 and message in payload["error"], (message, status, payload)
    status, payload = _post(v2_server, "/v2/models/nope/infer", b"{}")
    assert status == 404 and set(payload) == {"error"}
