"""The Open Inference Protocol driven by KServe's own clients (InferenceRESTClient, InferenceGRPCClient).

A second implementation of the protocol's client side, written by other people
than tritonclient's: what KServe users point at a server must work unchanged.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import V2_DATATYPES, assert_matches, batch_request

kserve = pytest.importorskip("kserve", reason="needs kserve (the dev extra)")

D = TEST_D_MODEL



def _request(model: str, inputs: dict[str, np.ndarray], request_id: str):
    tensors = []
    for name, array in inputs.items():
        tensor = kserve.InferInput(name, list(array.shape), V2_DATATYPES[array.dtype])
        tensor.set_data_from_numpy(array, binary_data=False)
        tensors.append(tensor)
    return kserve.InferRequest(model, tensors, request_id=request_id)


def _outputs(response) -> dict[str, np.ndarray]:
    return {output.name: output.as_numpy() for output in response.outputs}


def test_rest_client_health_and_inference(v2_server, session):
    model = v2_server.model.stem
    inputs = batch_request(session.signature, np.random.default_rng(11), 3, [6, 2, 9], D, "mixed")

    async def drive():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30))
        try:
            base = f"http://{v2_server.url}"
            live, ready = await client.is_server_live(base), await client.is_server_ready(base)
            model_ready = await client.is_model_ready(base, model)
            response = await client.infer(base, _request(model, inputs, "kserve-rest"), model_name=model)
            return live, ready, model_ready, response
        finally:
            await client.close()

    live, ready, model_ready, response = asyncio.run(drive())
    assert live and ready and model_ready
    assert response.id == "kserve-rest" and response.model_name == model
    assert_matches(session, inputs, _outputs(response))


def test_grpc_client_health_and_inference(v2_server, session):
    model = v2_server.model.stem
    inputs = batch_request(session.signature, np.random.default_rng(12), 2, [4, 7], D, "right")

    async def drive():
        client = kserve.InferenceGRPCClient(v2_server.grpc_url, timeout=30, retries=0)
        try:
            live, ready = await client.is_server_live(), await client.is_server_ready()
            response = await client.infer(_request(model, inputs, "kserve-grpc"))
            return live, ready, response
        finally:
            await client.close()

    live, ready, response = asyncio.run(drive())
    assert live and ready
    assert response.id == "kserve-grpc"
    assert_matches(session, inputs, _outputs(response))


def test_rest_client_sees_the_protocol_error_for_an_unknown_model(v2_server, session):
    inputs = batch_request(session.signature, np.random.default_rng(13), 1, [3], D, "right")

    async def drive():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30, retries=0))
        try:
            await client.infer(f"http://{v2_server.url}", _request("no-such-model", inputs, "x"),
                               model_name="no-such-model")
        finally:
            await client.close()

    # KServe's client reads the protocol's {"error": ...} body into its exception.
    with pytest.raises(httpx.HTTPStatusError, match=r"unknown model 'no-such-model'.*404") as raised:
        asyncio.run(drive())
    assert raised.value.response.status_code == 404
