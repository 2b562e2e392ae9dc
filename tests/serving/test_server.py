"""The HTTP server as a real process on loopback: load, bad input, readiness, metrics, SIGTERM under load."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mha_deploy.batching import BatchingConfig
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.conftest import TEST_D_MODEL
from tests.serving.helpers import NETWORK_ERRORS, TIMEOUT, Server, app_on_loopback, free_port, sigterm_under_load

D = TEST_D_MODEL
MAX_TOKENS, MAX_BODY_MB = 256, 1


def request(port: int, method: str, path: str, body: bytes | None = None, content_type: str | None = None,
            conn: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        # The server may answer (413) and close before the whole body is sent: its answer is still there.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        if own:
            conn.close()


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    return request(port, "GET", path)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def infer(port: int, item: dict[str, np.ndarray], binary: bool, conn=None) -> tuple[int, np.ndarray | bytes]:
    """POST one item (JSON or binary); the output array on 200, else the body."""
    if not binary:
        body, content_type = json.dumps({k: v.tolist() for k, v in item.items()}).encode(), "application/json"
    elif set(item) == {"x"}:
        body, content_type = npy(item["x"]), "application/x-npy"
    else:
        body, content_type = npz(**item), "application/x-npz"
    status, headers, payload = request(port, "POST", "/v1/infer", body, content_type, conn)
    if status != 200:
        return status, payload
    if headers["content-type"].startswith("application/json"):
        return status, np.asarray(json.loads(payload)["output"], np.float32)
    if content_type == "application/x-npy":
        return status, np.load(io.BytesIO(payload))
    return status, np.load(io.BytesIO(payload))["output"]


def random_items(signature: Signature, count: int, seed: int, max_len: int = 48) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(count):
        q_len, kv_len = (int(n) for n in rng.integers(1, max_len + 1, size=2))
        if signature.attention == "self":
            items.append({"x": rng.standard_normal((q_len, D), dtype=np.float32)})
        else:
            items.append({name: rng.standard_normal((n, D), dtype=np.float32)
                          for name, n in (("query", q_len), ("key", kv_len), ("value", kv_len))})
    return items


def direct(session: MHASession, item: dict[str, np.ndarray]) -> np.ndarray:
    """The item alone through the session: the reference every server response must match."""
    feeds = {name: array[None] for name, array in item.items()}
    if session.signature.has_padding_mask:
        kv = item["x" if "x" in item else "key"]
        feeds["key_padding_mask"] = np.ones((1, kv.shape[0]), bool)
    return session.run(feeds)["output"][0]


def load(port: int, session: MHASession, clients: int, per_client: int, seed: int) -> tuple[int, list[str]]:
    """``clients`` threads, each with its own keep-alive connection, ``per_client`` requests of mixed lengths."""
    items = random_items(session.signature, clients * per_client, seed)
    expected = [direct(session, item) for item in items]
    failures: list[str] = []
    start = threading.Barrier(clients)

    def client(c: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        start.wait(timeout=30)
        ok = 0
        try:
            for index in range(c, len(items), clients):
                status, output = infer(port, items[index], binary=index % 2 == 1, conn=conn)
                if status != 200:
                    failures.append(f"item {index}: HTTP {status}: {output[:200]!r}")
                elif output.shape != expected[index].shape or not np.allclose(output, expected[index], atol=1e-5):
                    failures.append(f"item {index}: max abs diff {np.abs(output - expected[index]).max():.3g}")
                else:
                    ok += 1
        finally:
            conn.close()
        return ok

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        ok = sum(f.result(timeout=120) for f in futures)
    return ok, failures


def metric(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in Prometheus text."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


@pytest.fixture(scope="module")
def self_server(export_model, start_server):
    path, _ = export_model(Signature("self", "padding"))
    server = start_server(path, "--max-batch", "16", "--max-wait-ms", "2", "--threads", "2",
                          "--max-item-tokens", str(MAX_TOKENS), "--max-body-mb", str(MAX_BODY_MB))
    return server, MHASession(path, provider="cpu")


def test_32_clients_get_exactly_the_direct_result(self_server):
    """32 concurrent clients × 50 requests of mixed lengths, JSON and .npy: all 200, all equal to a direct run."""
    server, session = self_server
    ok, failures = load(server.port, session, clients=32, per_client=50, seed=0)
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert ok == 32 * 50
    text = get(server.port, "/metrics")[2].decode()
    assert metric(text, "mha_batch_size_sum") / metric(text, "mha_batch_size_count") > 1.5, "requests were batched"
    assert metric(text, "mha_padded_positions_total") > 0
    assert metric(text, "mha_request_latency_seconds_count") >= ok


@pytest.mark.parametrize(
    ("signature", "args"),
    [
        (Signature("cross", "padding"), ()),
        # No mask: keys cannot be padded, so the batcher runs one batch per key length.
        (Signature("self", "none"), ("--max-wait-ms", "5")),
    ],
    ids=["cross-padding", "self-none-equal-lengths-only"],
)
def test_other_models_under_load(export_model, start_server, signature, args):
    path, _ = export_model(signature)
    server = start_server(path, "--max-batch", "8", *args)
    ok, failures = load(server.port, MHASession(path, provider="cpu"), clients=8, per_client=20, seed=1)
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert ok == 8 * 20


def _json(x) -> bytes:
    return json.dumps(x).encode()


ROW = [0.5] * D
TOO_BIG = b"[" + b"0.0," * (MAX_BODY_MB * 2**20 // 4 + 10) + b"0.0]"
BAD_REQUESTS = [
    ("malformed_json", b'{"x": [[1.0, 2.0]', "application/json", 400),
    ("json_not_object", b"[[1.0]]", "application/json", 400),
    ("wrong_d_model", _json({"x": [[0.5] * (D + 1)] * 3}), "application/json", 422),
    ("wrong_rank", _json({"x": ROW}), "application/json", 422),
    ("wrong_rank_3d", _json({"x": [[ROW]]}), "application/json", 422),
    ("not_numeric", _json({"x": [["a"] * D]}), "application/json", 422),
    ("booleans", _json({"x": [[True] * D]}), "application/json", 422),
    ("null", _json({"x": [[None] * D]}), "application/json", 422),
    ("ragged", _json({"x": [ROW, ROW[:-1]]}), "application/json", 422),
    ("nan", b'{"x": [[' + b", ".join([b"NaN"] + [b"0.5"] * (D - 1)) + b"]]}", "application/json", 422),
    ("inf", b'{"x": [[' + b", ".join([b"Infinity"] + [b"0.5"] * (D - 1)) + b"]]}", "application/json", 422),
    ("beyond_float32", _json({"x": [[1e39, *ROW[1:]]]}), "application/json", 422),
    ("empty_sequence", _json({"x": []}), "application/json", 422),
    ("empty_rows", _json({"x": [[]]}), "application/json", 422),
    ("missing_input", _json({"y": [ROW]}), "application/json", 422),
    ("too_many_tokens", _json({"x": [ROW] * (MAX_TOKENS + 1)}), "application/json", 422),
    ("body_too_large", TOO_BIG, "application/json", 413),
    ("unsupported_type", b"x=1", "application/x-www-form-urlencoded", 415),
    ("npy_garbage", b"\x93NUMPY garbage", "application/x-npy", 400),
    ("npy_wrong_d_model", npy(np.ones((3, D + 1), np.float32)), "application/x-npy", 422),
    ("npy_nan", npy(np.full((3, D), np.nan, np.float32)), "application/x-npy", 422),
    ("npy_strings", npy(np.full((3, D), "a")), "application/x-npy", 422),
    ("npy_too_many_tokens", npy(np.ones((MAX_TOKENS + 1, D), np.float16)), "application/x-npy", 422),
    ("npz_missing_x", npz(y=np.ones((3, D), np.float32)), "application/x-npz", 422),
    ("npz_garbage", b"PK\x03\x04 not a zip", "application/x-npz", 400),
]


@pytest.mark.parametrize(("case", "body", "content_type", "status"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_4xx_and_the_server_keeps_serving(self_server, case, body, content_type, status):
    server, session = self_server
    got, _, payload = request(server.port, "POST", "/v1/infer", body, content_type)
    assert got == status, payload[:300]
    error = json.loads(payload)["error"]
    assert error["kind"] and error["message"], error
    if status == 422 and not case.startswith(("npz", "missing")):
        assert "x" in error["message"], f"the message names the input: {error}"

    good = random_items(session.signature, 1, seed=7)[0]
    status, output = infer(server.port, good, binary=False)
    assert status == 200
    np.testing.assert_allclose(output, direct(session, good), atol=1e-5)


def test_finite_inputs_that_overflow_get_422_not_nan(self_server):
    server, _ = self_server
    body = npy(np.full((3, D), 1e30, np.float32))
    got, _, payload = request(server.port, "POST", "/v1/infer", body, "application/x-npy")
    assert got == 422 and json.loads(payload)["error"]["kind"] == "not_finite_output", payload[:300]


def test_body_over_the_limit_without_content_length(self_server):
    """A chunked body is counted as it arrives and refused once over the limit."""
    server, _ = self_server
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        chunks = (TOO_BIG[i : i + 65536] for i in range(0, len(TOO_BIG), 65536))
        conn.request("POST", "/v1/infer", body=chunks, headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["kind"] == "body_too_large"
    finally:
        conn.close()


def test_health_readiness_metrics_and_errors_as_json(self_server):
    server, _ = self_server
    assert get(server.port, "/healthz")[0] == 200
    status, _, body = get(server.port, "/readyz")
    assert status == 200 and json.loads(body) == {"status": "ready", "provider": "cpu"}
    status, _, body = get(server.port, "/v1/model")
    assert status == 200 and json.loads(body)["d_model"] == D
    status, _, body = get(server.port, "/nope")
    assert status == 404 and json.loads(body)["error"]["kind"] == "not_found"
    status, _, body = get(server.port, "/v1/infer")
    assert status == 405 and json.loads(body)["error"]["kind"] == "method_not_allowed"

    request(server.port, "POST", "/v1/infer", b"{", "application/json")
    status, headers, body = get(server.port, "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'mha_request_errors_total{kind="malformed_json"}' in text
    for name in ("mha_requests_total", "mha_batch_size_bucket", "mha_request_latency_seconds_bucket",
                 "mha_batch_run_seconds_bucket", "mha_queue_wait_seconds_bucket", "mha_ready 1.0"):
        assert name in text
    assert f"Uvicorn running on http://127.0.0.1:{server.port}" in server.log(), "binds loopback by default"


def test_sigterm_under_load_answers_every_accepted_request(export_model, tmp_path):
    """SIGTERM while 16 clients keep sending: every request the app accepted gets a 200, none is dropped."""
    path, _ = export_model(Signature("self", "padding"))
    session = MHASession(path, provider="cpu")
    # A batch larger than the client count and a long window: requests sit in the batcher for 300 ms,
    # so SIGTERM always lands while some are accepted and unanswered.
    server = Server(path, tmp_path / "server.log", "--max-batch", "64", "--max-wait-ms", "300")
    try:
        server.wait_ready()
        items = random_items(session.signature, 64, seed=3)
        expected = [direct(session, item) for item in items]
        stop_sending = threading.Event()
        sent_after_term = threading.Event()
        results = {"ok": 0, "http_errors": [], "wrong": 0}
        lock = threading.Lock()

        def client(c: int) -> None:
            # A new connection per request: after SIGTERM every attempt either gets a full answer or is refused.
            for n in range(400):  # bounded even if the server never stops
                if stop_sending.is_set():
                    return
                index = (c * 7 + n) % len(items)
                try:
                    status, output = infer(server.port, items[index], binary=n % 2 == 0)
                except NETWORK_ERRORS:
                    if sent_after_term.is_set():
                        return  # refused or closed: the server has stopped taking requests
                    raise
                with lock:
                    if status != 200:
                        results["http_errors"].append(status)
                    elif not np.allclose(output, expected[index], atol=1e-5):
                        results["wrong"] += 1
                    else:
                        results["ok"] += 1

        code, accepted, answered = sigterm_under_load(
            server, client, 16, lambda: results["ok"], stop_sending, terminating=sent_after_term)
        assert code in (0, -signal.SIGTERM), server.log()
        log = server.log()
        assert "Waiting for connections to close" in log, "SIGTERM landed while requests were in flight"
        assert results["http_errors"] == [] and results["wrong"] == 0, results
        assert accepted == answered == results["ok"], (accepted, answered, results, log[-2000:])
    finally:
        server.stop()


def test_unloadable_model_exits_with_one_line_error(tmp_path):
    missing = tmp_path / "missing.onnx"
    command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(missing), "--port", str(free_port()),
               "--provider", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: model file not found: {missing}"


def test_readyz_waits_for_the_model(export_model):
    """/healthz answers while the model loads; /readyz says 503 until it is loaded and warm."""

    from mha_deploy.serving.http.app import create_app

    path, _ = export_model(Signature("self", "padding"))
    release = threading.Event()

    def slow_load() -> MHASession:
        assert release.wait(timeout=30)
        return MHASession(path, provider="cpu", warmup=True)

    deadline = time.monotonic() + 30
    with app_on_loopback(create_app(slow_load), ready=False, log_level="warning") as port:
        try:
            assert get(port, "/healthz")[0] == 200
            status, _, body = get(port, "/readyz")
            assert status == 503 and json.loads(body)["status"] == "loading"
            status, _, body = request(port, "POST", "/v1/infer", _json({"x": [ROW]}), "application/json")
            assert status == 503 and json.loads(body)["error"]["kind"] == "not_ready"
            release.set()
            while get(port, "/readyz")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert get(port, "/readyz")[0] == 200
            assert infer(port, {"x": np.ones((2, D), np.float32)}, binary=True)[0] == 200
        finally:
            release.set()


def test_help_shows_an_example():
    from click.testing import CliRunner

    from mha_deploy.cli import main

    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0 and "Example" in result.output and "mha-deploy serve" in result.output
    for option in ("--grpc-port", "--api-key-file", "--ssl-certfile", "--max-queue", "--body-timeout", "--name"):
        assert option in result.output


def test_server_and_triton_modules_import_without_torch():
    """The serving side knows the model only through its file: no torch, models or exporters."""
    code = (
        "import sys\n"
        "for name in ('torch', 'onnxscript', 'mha_deploy.models', 'mha_deploy.exporters'):\n"
        "    sys.modules[name] = None\n"
        "import mha_deploy.serving.http.app, mha_deploy.serving.http.server, mha_deploy.serving.triton\n"
        "import mha_deploy.serving.http.grpc_server, mha_deploy.serving.http.rest_v2\n"
        "import mha_deploy.serving\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plain = subprocess.run([sys.executable, "-c", "import sys, mha_deploy.serving; print('starlette' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert plain.stdout.strip() == "False", "embedding MHASession does not load the HTTP stack"


def test_batcher_groups_concurrent_items_and_isolates_a_failing_one(export_model):
    """In-process: 24 concurrent submits share runs; an item that breaks its batch fails alone."""
    import asyncio

    from mha_deploy.serving.http.batcher import MicroBatcher

    path, _ = export_model(Signature("self", "padding"))
    session = MHASession(path, provider="cpu")
    items = random_items(session.signature, 24, seed=11, max_len=12)
    broken = {"x": np.zeros((3, D + 1), np.float32)}  # wrong width: collate or ORT fails on it

    async def main():
        batcher = MicroBatcher(session, BatchingConfig(max_batch=32, max_wait_ms=20))
        await batcher.start()
        try:
            good = await asyncio.gather(*(batcher.submit(item) for item in items))
            runs = batcher.metrics.registry.get_sample_value("mha_batch_size_count")
            mixed = await asyncio.gather(*(batcher.submit(i) for i in [*items, broken]), return_exceptions=True)
        finally:
            await batcher.stop()
        return good, runs, mixed

    good, runs, mixed = asyncio.run(main())
    assert runs < len(items) / 2, f"{runs} ORT runs for {len(items)} items: they were not batched"
    assert isinstance(mixed[-1], Exception)
    for item, first, second in zip(items, good, mixed[:-1], strict=True):
        np.testing.assert_allclose(first["output"], direct(session, item), atol=1e-5)
        np.testing.assert_allclose(second["output"], direct(session, item), atol=1e-5)


def test_micro_batcher_refuses_a_kv_cache_model(export_model):
    from mha_deploy.errors import OptionError
    from mha_deploy.serving.http.batcher import MicroBatcher

    session = MHASession(export_model(Signature("self", "padding-causal", kv_cache=True))[0], provider="cpu")
    with pytest.raises(OptionError, match="carries state"):
        MicroBatcher(session)
