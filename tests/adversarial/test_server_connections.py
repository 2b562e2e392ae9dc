"""Round 2, defect 1 and the server's weak answers: clients that connect and wait, or send what parses oddly.

Idle connections took uvicorn's connection slots, keys or not (every request got
503 until they closed; a TLS connection idle after its handshake never closed),
and gRPC calls whose message never came took gRPC's (RESOURCE_EXHAUSTED).
Now connections without a request in progress take no slot and close after
--keep-alive-timeout, headers have --header-timeout, gRPC messages
--body-timeout, and keys are checked before anything takes a slot.

One TLS server with API keys (REST and gRPC), header and body timeouts of 1 s, an idle
timeout of 2 s, 4 slots and 4 idle connections at most;
every probe is on loopback, a few dozen sockets at most, each bounded in time.
``benchmarks/starvation.py`` measures the same with 1000 idle sockets.
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import numpy as np
import pytest

from mha_deploy.metadata import Signature
from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import Server, free_port, self_signed_certificate

grpc = pytest.importorskip("grpc", reason="needs grpcio (the serve extra)")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

D = TEST_D_MODEL
SLOTS = 4
MAX_IDLE = 4
IDLE_TIMEOUT_S = 2.0  # --keep-alive-timeout: long enough to tell the idle cap's closing from the timeout's
TIMEOUT_S = 1.0  # keep-alive (idle), header and body timeouts of the server
SERVICE = "/inference.GRPCInferenceService"


@pytest.fixture(scope="module")
def guarded(export_model, tmp_path_factory):
    """(server, key, certificate): TLS, API keys, REST and gRPC, 4 slots, 1 s timeouts."""
    directory = tmp_path_factory.mktemp("guarded")
    cert, key_file = self_signed_certificate(directory)
    key = secrets.token_urlsafe(24)
    (directory / "keys.txt").write_text(f"{key}\n")
    path, _ = export_model(Signature("self", "padding"))
    server = Server(path, directory / "server.log", "--name", "mha", "--api-key-file", str(directory / "keys.txt"),
                    "--ssl-certfile", str(cert), "--ssl-keyfile", str(key_file), "--max-connections", str(SLOTS),
                    "--keep-alive-timeout", str(IDLE_TIMEOUT_S), "--header-timeout", str(TIMEOUT_S),
                    "--body-timeout", str(TIMEOUT_S), "--max-idle-connections", str(MAX_IDLE), grpc=True, ca=cert)
    try:
        yield server.wait_ready(), key, cert
    finally:
        server.stop()


def _tls_socket(server: Server, cert) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(cert))
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (reading and discarding what it sends), or None."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < seconds:
        try:
            if not sock.recv(4096):
                return time.monotonic() - start
        except (TimeoutError, ssl.SSLWantReadError):
            continue
        except (ConnectionError, ssl.SSLError):
            return time.monotonic() - start
    return None


def _infer_body() -> bytes:
    x = np.ones((1, 3, D), np.float32)
    return json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()},
                                  {"name": "key_padding_mask", "shape": [1, 3], "datatype": "BOOL",
                                   "data": [True] * 3}]}).encode()


def test_idle_and_keyless_connections_take_no_slot(guarded):
    """4 slots; 3x as many idle sockets, idle TLS sockets, and keyless requests: the keyed request is answered."""
    server, key, cert = guarded
    with ExitStack() as stack:
        for _ in range(3 * SLOTS):
            stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            stack.enter_context(_tls_socket(server, cert))
        for _ in range(3 * SLOTS):
            assert server.request("POST", "/v2/models/mha/infer", _infer_body())[0] == 401
        start = time.monotonic()
        status, _, payload = server.request("POST", "/v2/models/mha/infer", _infer_body(),
                                            {"Authorization": f"Bearer {key}"})
        assert status == 200, payload
        assert time.monotonic() - start < 10


def test_beyond_the_idle_cap_the_longest_idle_connections_are_closed_first(guarded):
    """A flood of idle sockets cannot use up the server's descriptors within one idle timeout."""
    server, key, cert = guarded
    with ExitStack() as stack:
        start = time.monotonic()
        sockets = [stack.enter_context(_tls_socket(server, cert)) for _ in range(3 * MAX_IDLE)]
        newest = [_closed_within(sock, 0.02) is not None for sock in sockets[-MAX_IDLE // 2 :]]
        oldest = [_closed_within(sock, 0.3) is not None for sock in sockets[:MAX_IDLE]]
        assert time.monotonic() - start < IDLE_TIMEOUT_S, "too slow to tell the cap from the idle timeout"
        status, _, _ = server.request("GET", "/v2", headers={"Authorization": f"Bearer {key}"})
    assert all(oldest) and not any(newest), (oldest, newest)
    assert status == 200


def test_a_tls_connection_idle_after_its_handshake_is_closed(guarded):
    server, _, cert = guarded
    with _tls_socket(server, cert) as sock:
        closed = _closed_within(sock, 5 * IDLE_TIMEOUT_S)
    assert closed is not None and closed >= 0.5 * IDLE_TIMEOUT_S


def test_headers_trickled_in_are_cut_off_at_the_header_timeout(guarded):
    """A byte every 0.2 s keeps the connection from being idle; the header deadline still closes it."""
    server, _, cert = guarded
    with _tls_socket(server, cert) as sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < 10 * TIMEOUT_S:
            try:
                sock.sendall(b"X")
            except (ConnectionError, ssl.SSLError, OSError):
                closed = True
                break
            if _closed_within(sock, 0.2) is not None:
                closed = True
                break
    assert closed and time.monotonic() - start < 5 * TIMEOUT_S


def _grpc_channel(server: Server, cert):
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    return grpc.secure_channel(server.grpc_url, credentials)


def _stalled_call(channel, key: str | None, result: list, released: threading.Event) -> None:
    """A ModelInfer call whose request message never comes (a client stream that sends nothing)."""
    call = channel.stream_unary(f"{SERVICE}/ModelInfer", request_serializer=lambda m: m,
                                response_deserializer=pb.ModelInferResponse.FromString)

    def nothing():
        released.wait(30)
        return
        yield

    metadata = [("authorization", f"Bearer {key}")] if key else None
    start = time.monotonic()
    try:
        call(nothing(), metadata=metadata, timeout=30)
        result.append(("OK", time.monotonic() - start))
    except grpc.RpcError as error:
        result.append((error.code().name, time.monotonic() - start))


def test_grpc_calls_whose_message_never_comes_take_no_slot_and_end_at_the_deadline(guarded):
    server, key, cert = guarded
    released = threading.Event()
    keyed, keyless = [], []
    with _grpc_channel(server, cert) as channel:
        threads = [threading.Thread(target=_stalled_call, args=(channel, with_key, results, released))
                   for with_key, results in ((key, keyed), (None, keyless)) for _ in range(2 * SLOTS)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.3)
            stub = channel.unary_unary(f"{SERVICE}/ServerMetadata", request_serializer=pb.ServerMetadataRequest
                                       .SerializeToString, response_deserializer=pb.ServerMetadataResponse.FromString)
            answer = stub(pb.ServerMetadataRequest(), metadata=[("authorization", f"Bearer {key}")], timeout=10)
            assert answer.name == "mha-deploy"
        finally:
            for thread in threads:
                thread.join(30)
            released.set()
    assert [code for code, _ in keyless] == ["UNAUTHENTICATED"] * 2 * SLOTS
    assert max(seconds for _, seconds in keyless) < TIMEOUT_S, "refused on arrival, not after the deadline"
    assert [code for code, _ in keyed] == ["DEADLINE_EXCEEDED"] * 2 * SLOTS
    assert all(0.5 * TIMEOUT_S <= seconds < 10 * TIMEOUT_S for _, seconds in keyed), keyed


def _raw_grpc(server: Server, cert, key: str | None, method: str, body: bytes) -> grpc.RpcError | bytes:
    with _grpc_channel(server, cert) as channel:
        call = channel.unary_unary(f"{SERVICE}/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        metadata = [("authorization", f"Bearer {key}")] if key else None
        try:
            return call(body, metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error


def test_a_malformed_protobuf_is_invalid_argument(guarded):
    server, key, cert = guarded
    error = _raw_grpc(server, cert, key, "ModelInfer", b"\xff\xff\xff\xff")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid ModelInferRequest" in error.details()


def test_unknown_model_names_the_served_one_only_to_callers_with_a_key(guarded):
    """Without a key, a model's health check answers the same whatever name it asks (a 404 for a wrong name and a
    200 for the right one told which is served); with a key, a wrong name gets a 404 naming the served model."""
    server, key, cert = guarded
    keyless = {name: server.request("GET", f"/v2/models/{name}/ready") for name in ("WRONG", "mha")}
    assert keyless["WRONG"][0] == keyless["mha"][0] == 200
    assert keyless["WRONG"][2] == keyless["mha"][2] and b"mha" not in keyless["mha"][2]
    status, _, payload = server.request("GET", "/v2/models/WRONG/ready", headers={"Authorization": f"Bearer {key}"})
    assert status == 404 and b"serves 'mha'" in payload
    answers = {name: _raw_grpc(server, cert, None, "ModelReady", pb.ModelReadyRequest(name=name).SerializeToString())
               for name in ("WRONG", "mha")}
    assert answers["WRONG"] == answers["mha"] and pb.ModelReadyResponse.FromString(answers["mha"]).ready
    error = _raw_grpc(server, cert, key, "ModelReady", pb.ModelReadyRequest(name="WRONG").SerializeToString())
    assert error.code() == grpc.StatusCode.NOT_FOUND and "serves 'mha'" in error.details(), error.details()


# An input with both JSON data and binary data: REST answered 200 with the binary data, gRPC refused.
BOTH = json.dumps({"inputs": [{"name": "x", "shape": [1, 1, D], "datatype": "FP32", "data": [0.0] * D,
                               "parameters": {"binary_data_size": 4 * D}}]}).encode()


@pytest.mark.parametrize(("headers", "body", "message"), [
    ({"Inference-Header-Content-Length": "\u00b2"}, _infer_body(), b"Inference-Header-Content-Length"),
    ({"Content-Length": "\u00b2"}, None, b"Invalid HTTP request"),  # httptools' own refusal, before the app
    ({"Inference-Header-Content-Length": str(len(BOTH))}, BOTH + bytes(4 * D), b"not both"),
])
def test_odd_requests_get_400_saying_what_is_wrong(guarded, headers, body, message):
    """A superscript two passes str.isdigit (a 500 and a traceback); data with binary_data_size was answered 200."""
    server, key, cert = guarded
    with _tls_socket(server, cert) as sock:
        lines = [b"POST /v2/models/mha/infer HTTP/1.1", b"Host: x", f"Authorization: Bearer {key}".encode()]
        lines += [f"{name}: {value}".encode() for name, value in headers.items()]
        if "Content-Length" not in headers:
            lines.append(f"Content-Length: {len(body)}".encode())
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert message in answer and b"internal" not in answer


@pytest.mark.parametrize(("content", "message"), [
    ("\ufeff{key}\n", None),  # a BOM, as some editors write: the key still works
    ("{key}\u00e9\n", "beyond printable ASCII"),
])
def test_key_files_that_could_never_authenticate_are_refused(tmp_path, content, message):
    from mha_deploy.serving.http.auth import ApiKeyError, ApiKeys

    key = secrets.token_urlsafe(24)
    path = tmp_path / "keys.txt"
    path.write_text(content.format(key=key), encoding="utf-8")
    if message is None:
        assert ApiKeys.from_file(path).allows(f"Bearer {key}")
        return
    with pytest.raises(ApiKeyError, match=message) as refused:
        ApiKeys.from_file(path)
    assert str(path) in str(refused.value)


def test_a_passphrase_protected_tls_key_is_named_as_such(tmp_path, export_model):
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    cert, key_file = self_signed_certificate(tmp_path)
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    protected = tmp_path / "protected.pem"
    protected.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(export_model(Signature("self", "padding"))[0]),
               "--port", str(free_port()), "--ssl-certfile", str(cert), "--ssl-keyfile", str(protected)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and line.startswith("error: ") and "protected by a passphrase" in line, result.stderr
    assert str(protected) in line
