"""The Open Inference Protocol driven by KServe's own clients (InferenceRESTClient, InferenceGRPCClient).

A second implementation of the protocol's client side, written by other people
than tritonclient's: what KServe users point at a server must work unchanged.

kserve and tritonclient both register the protocol's protobuf messages
(``inference.ServerLiveRequest``, ...) in protobuf's default pool, so they
cannot be imported into one process: the KServe client runs in a subprocess of
its own, reading its inputs from and writing its outputs to .npz files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import assert_matches, batch_request

if subprocess.run([sys.executable, "-c", "import kserve"], capture_output=True).returncode != 0:
    pytest.skip("needs kserve (the dev extra)", allow_module_level=True)

D = TEST_D_MODEL

_CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    import httpx, numpy as np, kserve

    protocol, address, model, inputs_path, outputs_path = sys.argv[1:6]
    DATATYPES = {"float32": "FP32", "bool": "BOOL"}

    def request(request_id):
        tensors = []
        with np.load(inputs_path) as arrays:
            for name in arrays.files:
                array = arrays[name]
                tensor = kserve.InferInput(name, list(array.shape), DATATYPES[str(array.dtype)])
                tensor.set_data_from_numpy(array, binary_data=False)
                tensors.append(tensor)
        return kserve.InferRequest(model, tensors, request_id=request_id)

    async def rest():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30, retries=0))
        base = f"http://{address}"
        try:
            health = [await client.is_server_live(base), await client.is_server_ready(base),
                      await client.is_model_ready(base, model)]
            try:
                response = await client.infer(base, request("kserve-rest"), model_name=model)
            except httpx.HTTPStatusError as exc:
                return {"health": health, "status": exc.response.status_code, "error": str(exc)}, None
            return {"health": health, "status": 200, "id": response.id, "model": response.model_name}, response
        finally:
            await client.close()

    async def grpc():
        client = kserve.InferenceGRPCClient(address, timeout=30, retries=0)
        try:
            health = [await client.is_server_live(), await client.is_server_ready()]
            response = await client.infer(request("kserve-grpc"))
            return {"health": health, "status": 200, "id": response.id, "model": response.model_name}, response
        finally:
            await client.close()

    summary, response = asyncio.run(rest() if protocol == "rest" else grpc())
    if response is not None:
        np.savez(outputs_path, **{output.name: output.as_numpy() for output in response.outputs})
    print(json.dumps(summary))
""")


def run_client(protocol: str, address: str, model: str, inputs: dict[str, np.ndarray], tmp_path):
    """KServe's client in a subprocess: (its summary, the outputs by name or None)."""
    inputs_path, outputs_path = tmp_path / "inputs.npz", tmp_path / "outputs.npz"
    np.savez(inputs_path, **inputs)
    result = subprocess.run(
        [sys.executable, "-c", _CLIENT, protocol, address, model, str(inputs_path), str(outputs_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    if not outputs_path.exists():
        return summary, None
    with np.load(outputs_path) as outputs:
        return summary, {name: outputs[name] for name in outputs.files}


@pytest.mark.parametrize(("protocol", "padding"), [("rest", "mixed"), ("grpc", "right")])
def test_kserve_client_health_and_inference(v2_server, session, tmp_path, protocol, padding):
    model = v2_server.model.stem
    inputs = batch_request(session.signature, np.random.default_rng(11), 3, [6, 2, 9], D, padding)
    address = v2_server.url if protocol == "rest" else v2_server.grpc_url
    summary, outputs = run_client(protocol, address, model, inputs, tmp_path)
    assert all(summary["health"]), summary
    assert (summary["status"], summary["id"], summary["model"]) == (200, f"kserve-{protocol}", model)
    assert_matches(session, inputs, outputs)


def test_kserve_rest_client_sees_the_protocol_error_for_an_unknown_model(v2_server, session, tmp_path):
    inputs = batch_request(session.signature, np.random.default_rng(13), 1, [3], D, "right")
    summary, outputs = run_client("rest", v2_server.url, "no-such-model", inputs, tmp_path)
    # KServe's client reads the protocol's {"error": ...} body into its exception.
    assert summary["status"] == 404 and "unknown model 'no-such-model'" in summary["error"], summary
    assert outputs is None
