"""``mha-deploy serve`` as a real subprocess on loopback, and what the server tests share."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import ipaddress
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mha_deploy.runtime import MHASession

TIMEOUT = 20.0  # seconds, for any one request
NETWORK_ERRORS = (ConnectionError, http.client.HTTPException, OSError)


# numpy dtype -> the Open Inference Protocol's datatype name.
V2_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port: int, ca: Path | None = None, timeout: float = TIMEOUT) -> http.client.HTTPConnection:
    """A connection to 127.0.0.1:``port``: HTTPS verified with ``ca`` when given."""
    if ca is None:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    context = ssl.create_default_context(cafile=str(ca))
    return http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)


@contextlib.contextmanager
def app_on_loopback(app, ready: bool = True, timeout_s: float = 30.0, log_level: str = "critical"):
    """``app`` served by uvicorn in a thread on a free loopback port, for settings the CLI does not take: yields the
    port once the server listens (and, with ``ready``, once /readyz answers 200); stops it on the way out."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(*NETWORK_ERRORS):
                if server.started and (not ready or http_request(connect(port), "GET", "/readyz")[0] == 200):
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not start")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def http_request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None, close: bool = True) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of one request on ``conn``."""
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        if close:
            conn.close()


class Server:
    """``mha-deploy serve`` in a subprocess, its log in a file; ``grpc=True`` adds --grpc-port on a free port."""

    def __init__(self, model: Path, log: Path, *args: str, grpc: bool = False, ca: Path | None = None):
        self.model = model
        self.port = free_port()
        self.grpc_port = free_port() if grpc else None
        self.ca = ca  # the server speaks TLS, with a certificate this file verifies
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # Pinned: on a GPU runner the default (auto) would serve from CUDA, and "provider" in answers says so.
        command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(model), "--port", str(self.port),
                   "--provider", "cpu", *args]
        if grpc:
            command += ["--grpc-port", str(self.grpc_port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def connection(self, timeout: float = TIMEOUT) -> http.client.HTTPConnection:
        return connect(self.port, self.ca, timeout)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], bytes]:
        return http_request(conn or self.connection(), method, path, body, headers, close=conn is None)

    def wait_ready(self, timeout: float = 60.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(*NETWORK_ERRORS):
                if self.request("GET", "/readyz")[0] == 200:
                    return self
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log.close()


def openai_client(server: Server):
    """OpenAI's official client on ``server``'s /v1 routes (imported here: only the generation tests need it)."""
    import openai

    return openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def completions_concurrent_and_together(server: Server, model: str, prompts: list, max_tokens: int
                                       ) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's greedy token ids from a served generator two ways: one request per prompt, all sent together
    (threads released by one barrier, as far as threads can), and one request of every prompt; each in prompt
    order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    api = openai_client(server).completions
    start = threading.Barrier(len(prompts))

    def complete(prompt):
        start.wait(timeout=30)
        return api.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(complete, prompts))
    together = api.create(model=model, prompt=prompts, max_tokens=max_tokens, temperature=0).choices
    return concurrent, [choice.token_ids for choice in sorted(together, key=lambda c: c.index)]


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost and its key, as PEM files (cryptography, else the openssl CLI)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60,
        )
        return cert, key
    private_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private_key, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


def batch_request(signature, rng: np.random.Generator, batch: int, lengths: list[int], d_model: int,
                  padding: str = "right", kv_lengths: list[int] | None = None) -> dict[str, np.ndarray]:
    """A v2 batch: sequences padded to the longest, and the padding mask (right, left or mixed padding)."""
    def mask_for(real: list[int]) -> np.ndarray:
        longest = max(real)
        mask = np.zeros((batch, longest), dtype=bool)
        for row, n in enumerate(real):
            if padding == "right":
                mask[row, :n] = True
            elif padding == "left":
                mask[row, longest - n :] = True
            else:  # mixed: real tokens scattered, first and last kept
                positions = rng.choice(longest, size=n, replace=False)
                mask[row, positions] = True
        return mask

    q_mask = mask_for(lengths)
    if signature.attention == "self":
        inputs = {"x": rng.standard_normal((batch, q_mask.shape[1], d_model), dtype=np.float32)}
        if signature.has_padding_mask:
            inputs["key_padding_mask"] = q_mask
        return inputs
    kv_mask = mask_for(kv_lengths or lengths)
    inputs = {
        "query": rng.standard_normal((batch, q_mask.shape[1], d_model), dtype=np.float32),
        "key": rng.standard_normal((batch, kv_mask.shape[1], d_model), dtype=np.float32),
        "value": rng.standard_normal((batch, kv_mask.shape[1], d_model), dtype=np.float32),
    }
    if signature.has_padding_mask:
        inputs["key_padding_mask"] = kv_mask
    return inputs


def reference(session: MHASession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What MHASession returns for the same batch (padding mask all true when the request has none)."""
    feeds = dict(inputs)
    signature = session.signature
    for mask, marks in signature.padding_masks.items():
        feeds.setdefault(mask, np.ones(feeds[marks].shape[:2], dtype=bool))
    return session.run(feeds)


def real_positions(session: MHASession, inputs: dict[str, np.ndarray], output: str,
                   shape: tuple[int, ...]) -> np.ndarray:
    """Bool mask over ``output``: True where the position is real on every axis (padding is zeros in responses)."""
    signature = session.signature
    spec = signature.tensors[output]
    keep = np.ones(shape, dtype=bool)
    for mask_name, marks in signature.padding_masks.items():
        if mask_name not in inputs:
            continue
        axis = signature.axis_of(marks)
        for position, name in enumerate(spec.axes):
            if name == axis and position > 0:
                view = [1] * len(shape)
                view[0], view[position] = inputs[mask_name].shape
                keep = keep & inputs[mask_name].reshape(view)
    return keep


def assert_matches(session: MHASession, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
    """Each output equals MHASession's at real positions (atol 1e-5) and is zero at padded ones."""
    expected = reference(session, inputs)
    for name, actual in outputs.items():
        assert actual.shape == expected[name].shape, (name, actual.shape, expected[name].shape)
        keep = real_positions(session, inputs, name, actual.shape)
        np.testing.assert_allclose(actual[keep], expected[name][keep], atol=1e-5, err_msg=name)
        assert not actual[~keep].any(), f"{name}: padded positions are not zero"


def sigterm_under_load(
    server: Server, client: Callable[[int], None], clients: int, answered_ok: Callable[[], int],
    stop: threading.Event, terminating: threading.Event | None = None,
) -> tuple[int, int, int]:
    """Run ``client(c)`` for ``clients`` clients; once answers come back, SIGTERM the server and wait for it to
    exit, then set ``stop`` and wait for the clients (an exception in one fails the test). ``terminating`` is set
    just before the signal. Returns (exit code, requests accepted, requests answered) from the server's last log
    line."""
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        time.sleep(1.0)
        assert answered_ok() > 0, server.log()
        if terminating is not None:
            terminating.set()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        stop.set()
        for future in futures:
            future.result(timeout=60)
    match = re.search(r"stopped: (\d+) requests accepted, (\d+) answered", server.log())
    assert match, server.log()
    return code, int(match.group(1)), int(match.group(2))
