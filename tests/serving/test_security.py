"""API keys, TLS, limits and overload, for REST and gRPC, against real server processes (loopback only)."""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import (
    Server,
    app_on_loopback,
    assert_matches,
    connect,
    free_port,
    http_request,
    self_signed_certificate,
)

httpclient = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http] (the dev extra)")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (the dev extra)")
from tritonclient.utils import InferenceServerException  # noqa: E402

D = TEST_D_MODEL
X = np.random.default_rng(0).standard_normal((2, 5, D), dtype=np.float32)



@pytest.fixture(scope="module")
def secure(export_model, start_server, tmp_path_factory):
    """A server with API keys and TLS on both protocols: (server, key, certificate)."""
    directory = tmp_path_factory.mktemp("secure")
    cert, key_file = self_signed_certificate(directory)
    key = secrets.token_urlsafe(24)
    (directory / "keys.txt").write_text(f"# rotated monthly\n{secrets.token_urlsafe(24)}\n{key}\n")
    path, _ = export_model(Signature("self", "padding"))
    server = start_server(path, "--api-key-file", str(directory / "keys.txt"), "--ssl-certfile", str(cert),
                          "--ssl-keyfile", str(key_file), "--name", "mha", grpc=True, ca=cert)
    return server, key, cert


def _tensors(module, inputs: dict[str, np.ndarray]) -> list:
    """x and the key_padding_mask the model requires (every token real)."""
    mask = np.ones(inputs["x"].shape[:2], bool)
    return [module.InferInput("x", list(inputs["x"].shape), "FP32").set_data_from_numpy(inputs["x"]),
            module.InferInput("key_padding_mask", list(mask.shape), "BOOL").set_data_from_numpy(mask)]


def _v2_json(x: np.ndarray) -> bytes:
    """A v2 JSON body: x and the key_padding_mask the model requires (every token real)."""
    mask = np.ones(x.shape[:2], bool)
    return json.dumps({"inputs": [
        {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()},
        {"name": "key_padding_mask", "shape": list(mask.shape), "datatype": "BOOL", "data": mask.ravel().tolist()},
    ]}).encode()


def _http_infer(client, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    return client.infer("mha", _tensors(httpclient, inputs), **kwargs).as_numpy("output")


def _grpc_infer(client, inputs: dict[str, np.ndarray], **kwargs) -> np.ndarray:
    return client.infer("mha", _tensors(grpcclient, inputs), **kwargs).as_numpy("output")


def test_rest_needs_the_key_except_for_health_and_speaks_tls(secure, session):
    server, key, cert = secure
    client = httpclient.InferenceServerClient(server.url, ssl=True, ssl_options={"ca_certs": str(cert)})
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mha")
    for headers in (None, {"Authorization": "Bearer wrong-key-of-some-length"}, {"Authorization": key}):
        with pytest.raises(InferenceServerException) as info:
            client.get_server_metadata(headers=headers)
        assert info.value.status() == "401"
        with pytest.raises(InferenceServerException) as info:
            _http_infer(client, {"x": X}, headers=headers)
        assert info.value.status() == "401" and "API key" in info.value.message()
    auth = {"Authorization": f"Bearer {key}"}
    assert client.get_server_metadata(headers=auth)["name"] == "mha-deploy"
    assert_matches(session, {"x": X}, {"output": _http_infer(client, {"x": X}, headers=auth)})

    body = json.dumps({"x": X[0].tolist()}).encode()
    status, headers, payload = server.request("POST", "/v1/infer", body, {"Content-Type": "application/json"})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(payload)["error"]["kind"] == "unauthenticated"
    assert server.request("GET", "/metrics")[0] == 401
    assert server.request("GET", "/metrics", headers=auth)[0] == 200
    status, _, payload = server.request("POST", "/v1/infer", body, {"Content-Type": "application/json", **auth})
    assert status == 200
    np.testing.assert_allclose(json.loads(payload)["output"], session.run({"x": X[:1], "key_padding_mask": np.ones(
        (1, 5), bool)})["output"][0], atol=1e-5)
    assert server.request("GET", "/healthz")[0] == 200 and server.request("GET", "/v2/health/ready")[0] == 200

    # Plain HTTP to the TLS port gets no HTTP answer: the TLS handshake fails and the connection closes.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = plain.recv(100)
        except OSError:
            answer = b""
    assert not answer.startswith(b"HTTP/"), answer


def test_grpc_needs_the_key_except_for_health_and_speaks_tls(secure, session):
    server, key, cert = secure
    client = grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(cert))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mha")
    for headers in (None, {"authorization": "Bearer wrong-key-of-some-length"}):
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("mha", headers=headers)
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as info:
            _grpc_infer(client, {"x": X}, headers=headers)
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    auth = {"authorization": f"Bearer {key}"}
    assert client.get_model_metadata("mha", headers=auth).name == "mha"
    assert_matches(session, {"x": X}, {"output": _grpc_infer(client, {"x": X}, headers=auth)})
    plain = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        plain.is_server_live(client_timeout=5)
    assert info.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def test_server_refuses_unusable_options_with_one_line(export_model, tmp_path):
    path, _ = export_model(Signature("self", "padding"))
    (tmp_path / "short.txt").write_text("abc\n")
    (tmp_path / "cert.pem").write_text("not a certificate")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [
        (["--grpc-port", str(taken.getsockname()[1])], "gRPC cannot listen on 127.0.0.1:"),
        (["--name", "a/b"], "model name 'a/b'"),
        (["--ssl-certfile", str(tmp_path / "cert.pem")], "TLS needs both --ssl-certfile and --ssl-keyfile"),
        (["--ssl-certfile", str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "cert.pem")],
         "cannot use the TLS certificate"),
        (["--api-key-file", str(tmp_path / "short.txt")], "API keys must be at least 16 characters"),
        (["--api-key-file", str(tmp_path / "missing.txt")], "cannot read the API key file"),
    ]
    for args, message in cases:
        command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(path), "--port", str(free_port()),
                   "--provider", "cpu", *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and message in result.stderr.strip().splitlines()[-1], result.stderr
    taken.close()


@pytest.fixture(scope="module")
def limited(export_model, start_server):
    """A small queue and a long batching window (requests sit in the queue), 1 MB bodies, 64 tokens."""
    path, _ = export_model(Signature("self", "padding"))
    return start_server(path, "--name", "mha", "--max-queue", "4", "--max-batch", "64", "--max-wait-ms", "150",
                        "--max-body-mb", "1", "--max-item-tokens", "64", grpc=True)


def test_a_burst_over_max_queue_gets_503_with_retry_after_and_nothing_else(limited, session):
    """48 clients at once (v1, v2 REST, gRPC) against a queue of 4: each answer is right or a 503."""
    rng = np.random.default_rng(1)
    items = [rng.standard_normal((1, int(n), D), dtype=np.float32) for n in rng.integers(2, 20, size=48)]
    barrier = threading.Barrier(48)

    def client(index: int) -> tuple[str, int, np.ndarray | None, dict]:
        x = items[index]
        protocol = ("v1", "v2", "grpc")[index % 3]
        if protocol == "grpc":
            grpc_client = grpcclient.InferenceServerClient(limited.grpc_url)
            barrier.wait(timeout=30)
            try:
                return protocol, 200, _grpc_infer(grpc_client, {"x": x}), {}
            except InferenceServerException as exc:
                return protocol, exc.status(), None, {}
        if protocol == "v1":
            path, body = "/v1/infer", json.dumps({"x": x[0].tolist()}).encode()
        else:
            path, body = "/v2/models/mha/infer", _v2_json(x)
        conn = limited.connection()
        conn.connect()
        barrier.wait(timeout=30)
        status, headers, payload = limited.request("POST", path, body, {"Content-Type": "application/json"}, conn)
        conn.close()
        output = None
        if status == 200:
            document = json.loads(payload)
            output = np.asarray(document["output"] if protocol == "v1" else document["outputs"][0]["data"],
                                np.float32).reshape(x.shape)
        return protocol, status, output, headers

    with ThreadPoolExecutor(48) as pool:
        results = list(pool.map(client, range(48)))
    statuses = [status for _, status, _, _ in results]
    assert set(statuses) <= {200, 503, "StatusCode.UNAVAILABLE"}, statuses
    assert statuses.count(200) >= 4, statuses
    refused = [(protocol, headers) for protocol, status, _, headers in results if status != 200]
    assert refused, "the burst overflowed the queue"
    assert all(headers.get("retry-after") == "1" for protocol, headers in refused if protocol != "grpc")
    for (_, status, output, _), x in zip(results, items, strict=True):
        if status == 200:
            assert_matches(session, {"x": x}, {"output": output})
    # And the server goes on serving.
    assert_matches(session, {"x": X}, {"output": _grpc_infer(grpcclient.InferenceServerClient(limited.grpc_url),
                                                             {"x": X})})


def test_body_and_token_limits_on_both_protocols(limited):
    big = np.ones((1, 64, D), np.float32)
    many = np.tile(big, (80, 1, 1))  # 1.25 MiB
    with pytest.raises(InferenceServerException) as info:
        _grpc_infer(grpcclient.InferenceServerClient(limited.grpc_url), {"x": many})
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    with pytest.raises(InferenceServerException) as info:
        _http_infer(httpclient.InferenceServerClient(limited.url), {"x": many})
    assert info.value.status() == "413"
    long = np.ones((1, 65, D), np.float32)
    with pytest.raises(InferenceServerException) as info:
        _grpc_infer(grpcclient.InferenceServerClient(limited.grpc_url), {"x": long})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "at most 64" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        _http_infer(httpclient.InferenceServerClient(limited.url), {"x": long})
    assert info.value.status() == "400" and "at most 64" in info.value.message()


def test_deeply_nested_json_gets_400_not_500(limited):
    for path in ("/v1/infer", "/v2/models/mha/infer"):
        for body in (b"[" * 200_000, b'{"x": ' + b"[" * 3000 + b"]" * 3000 + b"}"):
            status, _, payload = limited.request("POST", path, body, {"Content-Type": "application/json"})
            assert status == 400, (path, status, payload[:200])


def _stalled_upload(server: Server) -> socket.socket:
    """A connection that sends headers announcing 100 kB and then only 10 bytes of body."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"{" * 10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_slow_bodies_cannot_hold_connections_or_the_drain(export_model, tmp_path):
    """408 after --body-timeout, a connection cap answering 503, and SIGTERM not held by a stalled upload."""
    path, _ = export_model(Signature("self", "padding"))
    server = Server(path, tmp_path / "server.log", "--name", "mha", "--body-timeout", "1", "--max-connections", "4",
                    "--drain-timeout", "30")
    try:
        server.wait_ready()
        started = time.monotonic()
        stalled = [_stalled_upload(server) for _ in range(4)]
        time.sleep(0.3)
        # The cap counts requests in progress: a fifth gets 503 while four uploads stall (health checks need no slot).
        status, headers, _ = server.request("GET", "/v2")
        assert status == 503 and headers.get("retry-after") == "1"
        assert server.request("GET", "/v2/health/live")[0] == 200
        for sock in stalled:
            answer = _read_until_closed(sock)  # the server closes a connection whose body it did not read
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"error"' in answer and b"within 1 s" in answer
            sock.close()
        assert time.monotonic() - started < 5
        assert server.request("GET", "/v2/health/live")[0] == 200

        # SIGTERM while an upload stalls: the drain ends with the body timeout, not the 30 s drain timeout.
        stalled = _stalled_upload(server)
        time.sleep(0.3)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=20)
        assert time.monotonic() - started < 5 and code in (0, -signal.SIGTERM), server.log()
        stalled.close()
    finally:
        server.stop()


def test_internal_errors_say_nothing_about_the_machine(export_model):
    """A failure inside the model run: 500 / INTERNAL with a fixed message; the path and traceback go to the log."""

    from mha_deploy.serving.http.app import create_app
    from mha_deploy.serving.http.grpc_server import GrpcConfig

    path, _ = export_model(Signature("self", "padding"))

    def broken_session() -> MHASession:
        session = MHASession(path, provider="cpu")

        def run(feeds):
            raise RuntimeError(f"{path}: node /attn/MatMul failed")

        session.run = run
        return session

    grpc_port = free_port()
    app = create_app(broken_session, model_name="mha", grpc_config=GrpcConfig(port=grpc_port))
    with app_on_loopback(app) as port:

        def request(method: str, route: str, body: bytes | None = None, headers: dict | None = None):
            return http_request(connect(port), method, route, body, headers)

        answers = [
            request("POST", "/v1/infer", json.dumps({"x": X[0].tolist()}).encode(),
                    {"Content-Type": "application/json"}),
            request("POST", "/v2/models/mha/infer", _v2_json(X)),
        ]
        for status, _, payload in answers:
            assert status == 500, payload
            assert str(path.parent) not in payload.decode() and "Traceback" not in payload.decode()
            assert "internal error" in payload.decode()
        with pytest.raises(InferenceServerException) as info:
            _grpc_infer(grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}"), {"x": X})
        assert info.value.status() == "StatusCode.INTERNAL"
        assert str(path.parent) not in info.value.message() and "node" not in info.value.message()
