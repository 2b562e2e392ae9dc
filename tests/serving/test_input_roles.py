"""`mha-deploy serve` over models whose inputs go beyond token ids, through the Open Inference Protocol: ViT's
image and Whisper's encoder's audio features as FP32 tensors (JSON data, and tritonclient's binary tensors over
HTTP and gRPC), BERT's segment ids as INT64 beside its tokens. Answers equal the module's; an image of another size
and a segment id past its 2-row table are 400s naming the input and its bound."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

from tests.conftest import user_module  # noqa: E402

ATOL, RTOL = 2e-5, 1e-4
# Each family's inputs at a batch of 3, as its clients send them.
SHAPES = {"hf_vision": ("pixel_values", (3, 3, 32, 32)), "hf_audio": ("input_features", (3, 8, 32))}


@pytest.fixture(scope="module")
def servers(own_model, start_server):
    """``servers(file) -> (model name, server)``: the file exported and served once per module, gRPC too."""
    started = {}

    def serve(file: str):
        if file not in started:
            path = own_model(file)[0]
            started[file] = path.stem, start_server(path, grpc=True)
        return started[file]

    return serve


def _module(file: str, **feeds: np.ndarray) -> dict[str, np.ndarray]:
    module = user_module(file).build().eval()
    with torch.no_grad():
        result = module(**{name: torch.from_numpy(value) for name, value in feeds.items()})
    return {name: value.numpy() for name, value in result.items() if value is not None}


def _post(server, name: str, body: dict) -> tuple[int, dict]:
    status, _, payload = server.request("POST", f"/v2/models/{name}/infer", json.dumps(body).encode())
    return status, json.loads(payload)


def test_an_oip_json_image_gets_the_modules_answer(servers):
    name, server = servers("hf_vision")
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    status, payload = _post(server, name, {"inputs": [{"name": "pixel_values", "shape": list(pixels.shape),
                                                       "datatype": "FP32", "data": pixels.tolist()}]})
    assert status == 200, payload
    expected = _module("hf_vision", pixel_values=pixels)
    outputs = {tensor["name"]: np.array(tensor["data"], np.float32).reshape(tensor["shape"])
               for tensor in payload["outputs"]}
    assert outputs.keys() == expected.keys()
    for output, want in expected.items():
        np.testing.assert_allclose(outputs[output], want, atol=ATOL, rtol=RTOL, err_msg=output)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("file", list(SHAPES))
def test_binary_tensors_get_the_modules_answer(servers, file, protocol):
    name, server = servers(file)
    client_module = tritonclient_http if protocol == "http" else tritonclient_grpc
    client = client_module.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)
    input_name, shape = SHAPES[file]
    values = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    tensor = client_module.InferInput(input_name, list(shape), "FP32")
    tensor.set_data_from_numpy(values)  # binary over HTTP (tritonclient's default), raw contents over gRPC
    answer = client.infer(name, [tensor])
    for output, want in _module(file, **{input_name: values}).items():
        np.testing.assert_allclose(answer.as_numpy(output), want, atol=ATOL, rtol=RTOL, err_msg=output)


def test_the_model_metadata_describes_the_image(servers):
    name, server = servers("hf_vision")
    metadata = tritonclient_http.InferenceServerClient(server.url).get_model_metadata(name)
    assert metadata["inputs"] == [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]


@pytest.mark.parametrize(("shape", "words"), [
    ([1, 3, 16, 32], "pixel_values has height 16 (expected 32): this model takes images of [channels, height, "
                     "width] = [3, 32, 32]"),
    ([1, 1, 32, 32], "pixel_values has channels 1 (expected 3)"),
])
def test_an_image_of_another_size_is_a_bad_request_naming_expected_and_got(servers, shape, words):
    name, server = servers("hf_vision")
    status, payload = _post(server, name, {"inputs": [{"name": "pixel_values", "shape": shape, "datatype": "FP32",
                                                       "data": np.zeros(shape).ravel().tolist()}]})
    assert status == 400 and words in payload["error"], payload


def test_segment_ids_are_served_beside_their_tokens_and_bounded_by_their_table(servers):
    name, server = servers("hf_segments")
    ids = np.random.default_rng(2).integers(0, 96, (2, 6))
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    mask = np.ones((2, 6), bool)

    def body(types: np.ndarray) -> dict:
        return {"inputs": [
            {"name": "input_ids", "shape": [2, 6], "datatype": "INT64", "data": ids.ravel().tolist()},
            {"name": "attention_mask", "shape": [2, 6], "datatype": "BOOL", "data": mask.ravel().tolist()},
            {"name": "token_type_ids", "shape": [2, 6], "datatype": "INT64", "data": types.ravel().tolist()}]}

    status, payload = _post(server, name, body(segments))
    assert status == 200, payload
    pooled = next(np.array(t["data"], np.float32).reshape(t["shape"]) for t in payload["outputs"]
                  if t["name"] == "pooler_output")
    want = _module("hf_segments", input_ids=ids, attention_mask=mask.astype(np.int64), token_type_ids=segments)
    np.testing.assert_allclose(pooled, want["pooler_output"], atol=ATOL, rtol=RTOL)
    segments[1, 4] = 2
    status, payload = _post(server, name, body(segments))
    assert status == 400, payload
    assert "token_type_ids holds id 2: its segment table has 2 rows in this model, so segment ids are 0 to 1" in \
        payload["error"]
