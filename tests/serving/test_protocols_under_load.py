"""32 concurrent clients of every protocol at once, against one server: all answers exact, all batched together."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import assert_matches, batch_request

httpclient = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http] (the dev extra)")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (the dev extra)")

D = TEST_D_MODEL
CLIENTS, PER_CLIENT = 32, 12
KINDS = ("http-binary", "http-json", "grpc", "v1")


def _metric(server, name: str) -> float:
    text = server.request("GET", "/metrics")[2].decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _send(kind: str, client, server, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    name = server.model.stem
    if kind == "v1":  # one item per request: the first row, cut to its real tokens
        status, _, payload = server.request("POST", "/v1/infer", json.dumps({"x": inputs["x"][0].tolist()}).encode(),
                                            {"Content-Type": "application/json"}, client)
        assert status == 200, payload[:300]
        return {"output": np.asarray(json.loads(payload)["output"], np.float32)}
    module = grpcclient if kind == "grpc" else httpclient
    tensors = []
    for tensor_name, array in inputs.items():
        tensor = module.InferInput(tensor_name, list(array.shape), "BOOL" if array.dtype == bool else "FP32")
        if kind == "grpc":
            tensors.append(tensor.set_data_from_numpy(array))
        else:
            tensors.append(tensor.set_data_from_numpy(array, binary_data=kind == "http-binary"))
    return {"output": client.infer(name, tensors).as_numpy("output")}


def test_32_clients_of_every_protocol_share_the_batcher(v2_server, export_model):
    session = MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")
    rng = np.random.default_rng(42)
    requests = []
    for index in range(CLIENTS * PER_CLIENT):
        kind = KINDS[index % CLIENTS % len(KINDS)]
        rows = 1 if kind == "v1" else int(rng.integers(1, 4))
        lengths = [int(n) for n in rng.integers(1, 40, size=rows)]
        if kind == "v1":
            lengths = [lengths[0]]
        padding = "left" if index % 7 == 0 and kind != "v1" else "right"
        requests.append((kind, batch_request(session.signature, rng, rows, lengths, D, padding)))
    batches_before = _metric(v2_server, "mha_batch_size_count")
    items_before = _metric(v2_server, "mha_batch_size_sum")
    failures: list[str] = []
    barrier = threading.Barrier(CLIENTS)

    def client(c: int) -> int:
        kind = KINDS[c % len(KINDS)]
        if kind == "grpc":
            connection = grpcclient.InferenceServerClient(v2_server.grpc_url)
        elif kind == "v1":
            connection = v2_server.connection()
        else:
            connection = httpclient.InferenceServerClient(v2_server.url, network_timeout=30)
        barrier.wait(timeout=30)
        ok = 0
        for index in range(c, len(requests), CLIENTS):
            kind, inputs = requests[index]
            try:
                outputs = _send(kind, connection, v2_server, inputs)
                if kind == "v1":
                    real = inputs["key_padding_mask"][0]
                    expected = session.run({"x": inputs["x"][:1, real], "key_padding_mask": real[None, real]})
                    np.testing.assert_allclose(outputs["output"], expected["output"][0], atol=1e-5)
                else:
                    assert_matches(session, inputs, outputs)
                ok += 1
            except Exception as exc:  # collected, so that one failure does not hide the others
                failures.append(f"request {index} ({kind}): {type(exc).__name__}: {str(exc)[:300]}")
        connection.close()
        return ok

    with ThreadPoolExecutor(CLIENTS) as pool:
        ok = sum(pool.map(client, range(CLIENTS)))
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"
    assert ok == CLIENTS * PER_CLIENT
    runs = _metric(v2_server, "mha_batch_size_count") - batches_before
    items = _metric(v2_server, "mha_batch_size_sum") - items_before
    assert items / runs > 1.5, f"{items:.0f} rows in {runs:.0f} runs: requests were not batched together"
