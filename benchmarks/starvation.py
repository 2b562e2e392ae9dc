"""Can idle, keyless or stalled clients starve authorised ones? Latency of an authorised client under each attack.

Starts one real ``mha-deploy serve`` (API keys, REST and gRPC on free loopback
ports, ``--max-connections 20`` as in the report that found the problem), then,
for each attack class, holds the attack open while an authorised client sends
inferences one after another (``--requests`` at least, for ``--seconds`` at
least) and checks every answer against
``MHASession``:

- ``idle sockets``: ``--idle`` TCP connections that connect and send nothing
  (1000 by default: the target is an answer within 2 s while they are open);
- ``keyless requests``: as many connections sending requests without a key, again and again;
- ``partial headers``: connections that send half a request line and stall;
- ``stalled gRPC calls``: calls (with and without a key) whose request message never comes;
- ``malformed protobufs``: gRPC messages that do not parse (for these three, the authorised client
  sends its inferences over gRPC);
- ``60 MB typed gRPC``: a message of ``fp32_contents`` (decoded in a thread), during which the client's
  ``/healthz`` round trips are timed instead.

Each class prints the authorised client's worst and median latency and counts
its answers: right, wrong (a different output), expected refusals (the attack's
own: 401, UNAUTHENTICATED, DEADLINE_EXCEEDED, INVALID_ARGUMENT, closed
connections) and unexpected ones (anything else: a 5xx, 503 for the authorised
client, a traceback). The target: 0 wrong, 0 unexpected, worst latency under 2 s.

    .venv/bin/python benchmarks/starvation.py                  # exports a d_model 64 model (needs torch)
    .venv/bin/python benchmarks/starvation.py --model mha.onnx --idle 1000 --requests 20
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

MODEL_NAME = "mha"
SERVICE = "/inference.GRPCInferenceService"
TARGET_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_model(directory: Path, d_model: int, heads: int) -> Path:
    import torch

    from mha_deploy.exporters import export_mha
    from mha_deploy.metadata import Signature
    from mha_deploy.models import MultiHeadAttention

    torch.manual_seed(0)
    path = directory / "mha.onnx"
    export_mha(MultiHeadAttention(d_model, heads).eval(), path, Signature("self", "padding"))
    return path


class Probe:
    def __init__(self, model: Path, directory: Path, slots: int):
        from mha_deploy.runtime import MHASession

        self.session = MHASession(model, provider="cpu")
        self.d_model = self.session.metadata.d_model
        self.key = secrets.token_urlsafe(24)
        (directory / "keys.txt").write_text(self.key + "\n")
        self.port, self.grpc_port = free_port(), free_port()
        command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(model), "--name", MODEL_NAME,
                   "--port", str(self.port), "--grpc-port", str(self.grpc_port), "--provider", "cpu",
                   "--api-key-file", str(directory / "keys.txt"), "--max-connections", str(slots),
                   "--threads", "1", "--log-level", "warning"]
        self.log = directory / "server.log"
        self.process = subprocess.Popen(command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((1, 16, self.d_model), dtype=np.float32)
        self.expected = self.session.run({"x": self.x, "key_padding_mask": np.ones((1, 16), bool)})["output"]
        self.body = json.dumps({"inputs": [{"name": "x", "shape": list(self.x.shape), "datatype": "FP32",
                                            "data": self.x.ravel().tolist()},
                                           {"name": "key_padding_mask", "shape": [1, 16], "datatype": "BOOL",
                                            "data": [True] * 16}]}).encode()
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited:\n{self.log.read_text()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.get("/readyz")[0] == 200:
                    return
            time.sleep(0.2)
        raise SystemExit(f"the server was not ready in {timeout} s")

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def authorised_infer(self) -> str:
        """One authorised v2 request: "right", "wrong", or "unexpected <status>"."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", f"/v2/models/{MODEL_NAME}/infer", self.body,
                         {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            return f"unexpected {type(exc).__name__}"
        finally:
            conn.close()
        if response.status != 200:
            return f"unexpected {response.status}"
        output = np.asarray(json.loads(payload)["outputs"][0]["data"], np.float32).reshape(self.expected.shape)
        return "right" if np.allclose(output, self.expected, atol=1e-4) else "wrong"

    def authorised_grpc_infer(self) -> str:
        """The same request over gRPC (raw contents, as tritonclient sends it)."""
        import grpc
        from tritonclient.grpc import service_pb2 as pb

        if not hasattr(self, "_grpc_infer"):
            self._grpc_infer = self.grpc_channel().unary_unary(
                f"{SERVICE}/ModelInfer", request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString)
            request = pb.ModelInferRequest(model_name=MODEL_NAME)
            request.inputs.add(name="x", datatype="FP32", shape=list(self.x.shape))
            request.raw_input_contents.append(self.x.tobytes())
            request.inputs.add(name="key_padding_mask", datatype="BOOL", shape=[1, self.x.shape[1]])
            request.raw_input_contents.append(np.ones((1, self.x.shape[1]), np.uint8).tobytes())
            self._grpc_request = request
        try:
            response = self._grpc_infer(self._grpc_request, metadata=[("authorization", f"Bearer {self.key}")],
                                        timeout=30)
        except grpc.RpcError as error:
            return f"unexpected {error.code().name}"
        output = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(self.expected.shape)
        return "right" if np.allclose(output, self.expected, atol=1e-4) else "wrong"

    def grpc_channel(self):
        import grpc

        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def measure(probe: Probe, requests: int, seconds: float, client: Callable[[], str] | None = None):
    """(latencies, outcomes) of at least ``requests`` requests, sent one after another for at least ``seconds``."""
    latencies, outcomes = [], Counter()
    end = time.perf_counter() + seconds
    while len(latencies) < requests or time.perf_counter() < end:
        start = time.perf_counter()
        outcomes[(client or probe.authorised_infer)()] += 1
        latencies.append(time.perf_counter() - start)
    return latencies, outcomes


# --- the attacks: each opens its attack, returns a function that ends it and counts what the attackers saw --


def idle_sockets(probe: Probe, count: int):
    sockets = [socket.create_connection(("127.0.0.1", probe.port), timeout=10) for _ in range(count)]

    def end() -> Counter:
        seen = Counter()
        for sock in sockets:
            sock.setblocking(False)
            try:
                seen["closed by the server (idle timeout)" if sock.recv(1) == b"" else "unexpected data"] += 1
            except BlockingIOError:
                seen["still open"] += 1
            except OSError:
                seen["closed by the server (idle timeout)"] += 1
            sock.close()
        return seen

    return end


def repeating(count: int, attack: Callable[[], str]):
    """``count`` threads running ``attack`` until told to stop; returns (end)."""
    stop, seen, lock = threading.Event(), Counter(), threading.Lock()

    def loop() -> None:
        while not stop.is_set():
            outcome = attack()
            with lock:
                seen[outcome] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)

    def end() -> Counter:
        stop.set()
        for thread in threads:
            thread.join(30)
        return seen

    return end


def keyless_request(probe: Probe) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", probe.port, timeout=30)
    try:
        conn.request("POST", f"/v2/models/{MODEL_NAME}/infer", probe.body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return "401 (expected)" if response.status == 401 else f"unexpected {response.status}"
    except (OSError, http.client.HTTPException) as exc:
        return f"unexpected {type(exc).__name__}"
    finally:
        conn.close()


def partial_headers(probe: Probe) -> str:
    with socket.create_connection(("127.0.0.1", probe.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n")
        try:
            return "closed by the server (header timeout)" if sock.recv(1) == b"" else "unexpected data"
        except TimeoutError:
            return "unexpected: still open after 30 s"
        except OSError:
            return "closed by the server (header timeout)"


def stalled_grpc(probe: Probe, with_key: bool) -> Callable[[], str]:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    channel = probe.grpc_channel()
    call = channel.stream_unary(f"{SERVICE}/ModelInfer", request_serializer=lambda m: m,
                                response_deserializer=pb.ModelInferResponse.FromString)
    metadata = [("authorization", f"Bearer {probe.key}")] if with_key else None
    expected = "DEADLINE_EXCEEDED" if with_key else "UNAUTHENTICATED"

    def attack() -> str:
        def nothing():
            time.sleep(60)
            return
            yield

        try:
            call(nothing(), metadata=metadata, timeout=60)
            return "unexpected OK"
        except grpc.RpcError as error:
            name = error.code().name
            return f"{name} (expected)" if name == expected else f"unexpected {name}"

    return attack


def malformed_grpc(probe: Probe) -> Callable[[], str]:
    import grpc

    channel = probe.grpc_channel()
    call = channel.unary_unary(f"{SERVICE}/ModelInfer", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    metadata = [("authorization", f"Bearer {probe.key}")]

    def attack() -> str:
        try:
            call(b"\xff" * 64, metadata=metadata, timeout=30)
            return "unexpected OK"
        except grpc.RpcError as error:
            name = error.code().name
            return f"{name} (expected)" if name == "INVALID_ARGUMENT" else f"unexpected {name}"

    return attack


def typed_grpc(probe: Probe, megabytes: int) -> Callable[[], str]:
    """An authorised ModelInfer of ``megabytes`` MB of fp32_contents, [rows, 1024, d_model] with a NaN in its
    last value: decoded and checked in full, then refused (INVALID_ARGUMENT) without running the model."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    from mha_deploy.runtime.session import length_delimited

    rows = max(1, megabytes * 2**20 // (4 * 1024 * probe.d_model))
    values = np.zeros(rows * 1024 * probe.d_model, np.float32)
    values[-1] = np.nan
    # Encoded by hand (field 6, packed): extending the repeated field from Python takes minutes.
    packed = values.astype("<f4").tobytes()
    contents = pb.InferTensorContents.FromString(length_delimited(6, packed))
    request = pb.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 1024, probe.d_model], contents=contents)
    flags = np.ones(rows * 1024, np.uint8).tobytes()  # bool_contents (field 1), packed one byte per value
    mask = pb.InferTensorContents.FromString(length_delimited(1, flags))
    request.inputs.add(name="key_padding_mask", datatype="BOOL", shape=[rows, 1024], contents=mask)
    raw = request.SerializeToString()
    channel = grpc.insecure_channel(f"127.0.0.1:{probe.grpc_port}",
                                    options=[("grpc.max_send_message_length", -1)])
    call = channel.unary_unary(f"{SERVICE}/ModelInfer", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)

    def attack() -> str:
        try:
            call(raw, metadata=[("authorization", f"Bearer {probe.key}")], timeout=60)
            return "unexpected OK"
        except grpc.RpcError as error:
            name = error.code().name
            return f"{name} (expected)" if name in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") else f"unexpected {name}"

    return attack




def healthz(probe: Probe) -> str:
    status, _ = probe.get("/healthz")
    return "right" if status == 200 else f"unexpected {status}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an exported padding-mask model (default: export d_model 64)")
    parser.add_argument("--idle", type=int, default=1000, help="idle sockets (and keyless clients / 20)")
    parser.add_argument("--requests", type=int, default=20, help="authorised requests per attack class, at least")
    parser.add_argument("--seconds", type=float, default=3.0, help="time each attack class is measured, at least")
    parser.add_argument("--slots", type=int, default=20, help="the server's --max-connections")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.idle + 100:
        raise SystemExit(f"the open-file limit ({hard}) is too low for {args.idle} sockets")

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model = args.model or export_model(directory, 64, 4)
        probe = Probe(model, directory, args.slots)
        crowd = max(2 * args.slots, args.idle // 20)
        classes = [
            (f"{args.idle} idle sockets", lambda: idle_sockets(probe, args.idle), None),
            (f"{crowd} keyless clients", lambda: repeating(crowd, lambda: keyless_request(probe)), None),
            (f"{crowd} partial headers", lambda: repeating(crowd, lambda: partial_headers(probe)), None),
            (f"{crowd} stalled gRPC, no key (gRPC timed)",
             lambda: repeating(crowd, stalled_grpc(probe, with_key=False)), probe.authorised_grpc_infer),
            (f"{2 * args.slots} stalled gRPC, keyed (gRPC timed)",
             lambda: repeating(2 * args.slots, stalled_grpc(probe, with_key=True)), probe.authorised_grpc_infer),
            ("malformed protobufs (gRPC timed)", lambda: repeating(4, malformed_grpc(probe)),
             probe.authorised_grpc_infer),
            ("60 MB typed gRPC (/healthz timed)", lambda: repeating(1, typed_grpc(probe, 60)),
             lambda: healthz(probe)),
        ]
        rows, totals = [], Counter()
        try:
            for label, start, client in classes:
                end = start()
                try:
                    latencies, outcomes = measure(probe, args.requests, args.seconds, client)
                finally:
                    seen = end()
                totals.update(outcomes)
                totals.update(seen)
                rows.append((label, max(latencies), statistics.median(latencies), outcomes, seen))
        finally:
            probe.stop()
    print(f"{'attack':44} {'worst s':>8} {'median s':>8}  authorised client        attackers saw")
    for label, worst, median, outcomes, seen in rows:
        print(f"{label:44} {worst:8.3f} {median:8.3f}  {dict(outcomes)!s:22}  {dict(seen)}")
    wrong = totals["wrong"]
    unexpected = sum(n for outcome, n in totals.items() if outcome.startswith("unexpected"))
    worst = max(row[1] for row in rows)
    print(f"wrong answers: {wrong}; unexpected answers: {unexpected}; worst authorised latency {worst:.3f} s "
          f"(target < {TARGET_S:g} s): {'MET' if wrong == 0 and unexpected == 0 and worst < TARGET_S else 'MISSED'}")


if __name__ == "__main__":
    main()
