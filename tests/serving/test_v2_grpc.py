"""The Open Inference Protocol over gRPC: tritonclient.grpc, and the generated stubs for typed contents."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL, TEST_HEADS
from tests.serving.helpers import V2_DATATYPES, assert_matches, batch_request

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (the dev extra)")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

D = TEST_D_MODEL



def infer(client, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None, **kwargs):
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), V2_DATATYPES[array.dtype])
        tensors.append(tensor.set_data_from_numpy(array))
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
    result = client.infer(model, tensors, outputs=requested, **kwargs)
    response = result.get_response()
    return {o.name: result.as_numpy(o.name) for o in response.outputs}, response


def test_health_and_metadata(v2_server):
    client = grpcclient.InferenceServerClient(v2_server.grpc_url)
    name = v2_server.model.stem
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(name)
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "mha-deploy" and "binary_tensor_data" in server["extensions"]
    meta = client.get_model_metadata(name, as_json=True)
    assert meta["name"] == name and meta["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("x", "FP32", ["-1", "-1", str(D)]), ("key_padding_mask", "BOOL", ["-1", "-1"])]  # int64 -> JSON strings
    assert [(t["name"], t["datatype"]) for t in meta["outputs"]] == [("output", "FP32")]


@pytest.mark.parametrize("padding", ["right", "left"])
def test_inference_equals_the_session(v2_server, session, padding):
    rng = np.random.default_rng(len(padding))
    inputs = batch_request(session.signature, rng, 3, [6, 2, 4], D, padding)
    client = grpcclient.InferenceServerClient(v2_server.grpc_url)
    outputs, response = infer(client, v2_server.model.stem, inputs, request_id="g-1")
    assert response.id == "g-1" and response.model_name == v2_server.model.stem
    assert_matches(session, inputs, outputs)


def test_typed_contents_equal_raw_contents(v2_server, session):
    """fp32_contents and bool_contents (what other clients send) give the same answer as raw bytes."""
    rng = np.random.default_rng(3)
    inputs = batch_request(session.signature, rng, 2, [5, 3], D, "right")
    request = pb.ModelInferRequest(model_name=v2_server.model.stem, id="typed")
    x = request.inputs.add(name="x", datatype="FP32", shape=inputs["x"].shape)
    x.contents.fp32_contents.extend(inputs["x"].ravel().tolist())
    mask = request.inputs.add(name="key_padding_mask", datatype="BOOL", shape=inputs["key_padding_mask"].shape)
    mask.contents.bool_contents.extend(inputs["key_padding_mask"].ravel().tolist())
    with grpc.insecure_channel(v2_server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=20)
    (output,) = response.outputs
    assert (response.id, output.name, output.datatype, list(output.shape)) == ("typed", "output", "FP32", [2, 5, D])
    array = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(output.shape)
    assert_matches(session, inputs, {"output": array})


def test_cross_attention_output_selection(cross_server, export_model):
    cross = MHASession(export_model(Signature("cross", "padding", return_weights=True))[0], provider="cpu")
    rng = np.random.default_rng(8)
    inputs = batch_request(cross.signature, rng, 2, [3, 5], D, "left", kv_lengths=[7, 2])
    client = grpcclient.InferenceServerClient(cross_server.grpc_url)
    outputs, _ = infer(client, "cross", inputs, outputs=["attn_weights"])
    assert list(outputs) == ["attn_weights"] and outputs["attn_weights"].shape == (2, TEST_HEADS, 5, 7)
    assert_matches(cross, inputs, outputs)
    outputs, _ = infer(client, "cross", inputs)
    assert list(outputs) == ["output", "attn_weights"]
    assert_matches(cross, inputs, outputs)


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


X = np.ones((2, 3, D), np.float32)


@pytest.mark.parametrize(
    ("tensors", "model", "status", "message"),
    [
        ([("x", X.astype(np.int32))], None, "INVALID_ARGUMENT", "datatype 'INT32', this model takes FP32"),
        ([("x", np.ones((2, 3, D + 2), np.float32))], None, "INVALID_ARGUMENT", f"d_model {D + 2}"),
        ([("x", np.ones((2, D), np.float32))], None, "INVALID_ARGUMENT", "this model takes [-1, -1, 64]"),
        ([("query", X)], None, "INVALID_ARGUMENT", "unknown input 'query'"),
        ([("x", np.full((2, 3, D), np.inf, np.float32)), ("key_padding_mask", np.ones((2, 3), bool))], None,
         "INVALID_ARGUMENT", "NaN or Inf"),
        ([("x", X)], None, "INVALID_ARGUMENT", "missing key_padding_mask: this model takes x, key_padding_mask"),
        ([("x", X)], "nope", "NOT_FOUND", "unknown model 'nope'"),
    ],
    ids=["wrong-datatype", "wrong-d-model", "wrong-rank", "unknown-input", "inf", "no-mask", "unknown-model"],
)
def test_bad_requests_get_the_protocol_status(v2_server, session, tensors, model, status, message):
    client = grpcclient.InferenceServerClient(v2_server.grpc_url)
    inputs = []
    for name, array in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), V2_DATATYPES[array.dtype])
        inputs.append(tensor.set_data_from_numpy(array))
    error = _error(lambda: client.infer(model or v2_server.model.stem, inputs))
    assert error.status() == f"StatusCode.{status}", error
    assert message in error.message(), error.message()
    assert str(v2_server.model.parent) not in error.message() and "Traceback" not in error.message()
    full = {"x": X, "key_padding_mask": np.ones(X.shape[:2], bool)}
    outputs, _ = infer(client, v2_server.model.stem, full)
    assert_matches(session, full, outputs)


def test_typed_contents_of_the_wrong_kind_and_unsupported_methods(v2_server):
    request = pb.ModelInferRequest(model_name=v2_server.model.stem)
    x = request.inputs.add(name="x", datatype="FP32", shape=[1, 1, D])
    x.contents.int_contents.extend([1] * D)
    with grpc.insecure_channel(v2_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=20)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "contents.fp32_contents" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelConfig(pb.ModelConfigRequest(name=v2_server.model.stem), timeout=20)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_under_grpc_load_answers_every_accepted_call(export_model, session, tmp_path):
    """SIGTERM while 8 gRPC clients keep calling: each call is answered right or refused UNAVAILABLE, none cut."""
    import signal
    import threading

    from tests.serving.helpers import Server, sigterm_under_load

    path, _ = export_model(Signature("self", "padding"))
    # A long batching window: calls sit in the batcher for 300 ms, so SIGTERM lands while some are accepted.
    server = Server(path, tmp_path / "server.log", "--name", "mha", "--max-batch", "64", "--max-wait-ms", "300",
                    grpc=True)
    try:
        server.wait_ready()
        inputs = [batch_request(session.signature, np.random.default_rng(i), 1, [i + 2], D) for i in range(8)]
        results = {"ok": 0, "wrong": 0, "refused": 0, "other": []}
        lock = threading.Lock()
        stop = threading.Event()

        def client(c: int) -> None:
            connection = grpcclient.InferenceServerClient(server.grpc_url)
            for _ in range(200):  # bounded even if the server never stops
                if stop.is_set():
                    return
                try:
                    outputs, _ = infer(connection, "mha", inputs[c], client_timeout=30)
                except InferenceServerException as exc:
                    with lock:
                        if exc.status() == "StatusCode.UNAVAILABLE":
                            results["refused"] += 1
                            return
                        results["other"].append(f"{exc.status()}: {exc.message()}")
                    return
                with lock:
                    try:
                        assert_matches(session, inputs[c], outputs)
                        results["ok"] += 1
                    except AssertionError:
                        results["wrong"] += 1

        code, accepted, answered = sigterm_under_load(server, client, 8, lambda: results["ok"], stop)
        assert code in (0, -signal.SIGTERM), server.log()
        assert results["other"] == [] and results["wrong"] == 0, results
        assert accepted == answered == results["ok"], (results, server.log()[-2000:])
    finally:
        server.stop()
