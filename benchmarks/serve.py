"""Requests/s and latency of `mha-deploy serve` per protocol, micro-batching on vs off, and a burst, in one run.

Starts one real server process per mode (REST and gRPC on free loopback ports)
and drives it with ``--clients`` threads, each with its own keep-alive
connection (gRPC: its own channel), for each protocol in turn:

- ``v1 JSON``: ``POST /v1/infer`` with ``{"x": [[...]]}``, answered in JSON;
- ``v2 REST JSON``: ``POST /v2/models/NAME/infer`` with JSON tensor data, JSON outputs;
- ``v2 REST binary``: the same with Triton's binary tensor data extension both ways
  (what tritonclient.http sends by default);
- ``gRPC``: ``ModelInfer`` with ``raw_input_contents`` (what tritonclient.grpc sends).

Every request is one item of 4-32 tokens; bodies are built before the clock
starts, and every answer is checked against ``MHASession`` after its run (so
checking costs the clients no CPU while the server is timed). The modes and
protocols are driven in alternating short rounds, so that load from other
processes on a shared machine hits all of them alike. Clients run on the same
machine as the server and compete with it for the CPU: read the figures as
relative, not as capacity.

Then a burst: ``--burst-clients`` clients at once (every protocol) against a
server whose queue holds only ``--burst-queue`` items, counting answers that
are right, 503 / UNAVAILABLE (expected), and anything else (there should be none).

    .venv/bin/python benchmarks/serve.py                       # exports a d_model 512, 8-head model (needs torch)
    .venv/bin/python benchmarks/serve.py --model mha.onnx --seconds 6 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODES = {
    "batching on": ["--max-batch", "32", "--max-wait-ms", "2"],
    "batching off": ["--max-batch", "1"],
}
PROTOCOLS = ("v1 JSON", "v2 REST JSON", "v2 REST binary", "gRPC")
MODEL_NAME = "mha"
ATOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_default_model(directory: Path, d_model: int, heads: int) -> Path:
    import torch

    from mha_deploy.exporters import export_mha
    from mha_deploy.metadata import Signature
    from mha_deploy.models import MultiHeadAttention

    torch.manual_seed(0)
    path = directory / f"mha-{d_model}.onnx"
    export_mha(MultiHeadAttention(d_model, heads).eval(), path, Signature("self", "padding"))
    return path


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    grpc_port: int


def start_server(model: Path, args: list[str], threads: int | None, log: Path) -> ServerProcess:
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(model), "--port", str(port),
               "--grpc-port", str(grpc_port), "--name", MODEL_NAME, "--log-level", "warning", *args]
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return ServerProcess(process, port, grpc_port)
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"server not ready after 60 s:\n{log.read_text()}")


# --- requests, built before the clock starts --------------------------------------------------------


@dataclass
class Request:
    """One item, encoded for every protocol, and the output it must get back."""

    x: np.ndarray  # [seq, d_model]
    expected: np.ndarray
    v1: bytes = b""
    v2_json: bytes = b""
    v2_binary: bytes = b""
    v2_header_length: int = 0
    grpc: object = None


def make_requests(model: Path, count: int, seed: int) -> list[Request]:
    from tritonclient.grpc import service_pb2 as pb

    from mha_deploy.runtime import MHASession

    session = MHASession(model, provider="cpu")
    d_model = session.metadata.d_model
    rng = np.random.default_rng(seed)
    requests = []
    for n in rng.integers(4, 33, size=count):
        x = rng.standard_normal((int(n), d_model), dtype=np.float32)
        expected = session.run({"x": x[None], "key_padding_mask": np.ones((1, int(n)), bool)})["output"][0]
        request = Request(x, expected)
        request.v1 = json.dumps({"x": x.tolist()}).encode()
        tensor = {"name": "x", "shape": [1, int(n), d_model], "datatype": "FP32"}
        request.v2_json = json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist()}]}).encode()
        header = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"binary_data_output": True}}).encode()
        request.v2_binary, request.v2_header_length = header + x.tobytes(), len(header)
        message = pb.ModelInferRequest(model_name=MODEL_NAME)
        message.inputs.add(name="x", datatype="FP32", shape=[1, int(n), d_model])
        message.raw_input_contents.append(x.tobytes())
        request.grpc = message
        requests.append(request)
    return requests


def ort_per_item_ms(model: Path, threads: int | None, batch: int = 8, tokens: int = 18) -> tuple[float, float]:
    """ORT alone, median ms per item: one item of ``tokens`` run alone, and in a padded batch of ``batch``."""
    from mha_deploy.runtime import MHASession

    options = {"session.intra_op.allow_spinning": "0"}  # as the server runs it
    session = MHASession(model, provider="cpu", threads=threads, session_config=options)
    rng = np.random.default_rng(0)
    times = []
    for size in (1, batch):
        x = rng.standard_normal((size, tokens, session.metadata.d_model), dtype=np.float32)
        feeds = {"x": x, "key_padding_mask": np.ones((size, tokens), bool)}
        for _ in range(10):
            session.run(feeds)
        runs = []
        for _ in range(100):
            start = time.perf_counter()
            session.run(feeds)
            runs.append(time.perf_counter() - start)
        times.append(float(np.median(runs)) / size * 1e3)
    return times[0], times[1]


# --- clients ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    answers: list[tuple[int, object]] = field(default_factory=list)  # (request index, raw answer) to check later
    statuses: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


class HttpClient:
    def __init__(self, port: int, protocol: str):
        self.port, self.protocol = port, protocol
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def send(self, request: Request) -> tuple[str, object]:
        if self.protocol == "v1 JSON":
            path, body, headers = "/v1/infer", request.v1, {"Content-Type": "application/json"}
        elif self.protocol == "v2 REST JSON":
            path, body, headers = f"/v2/models/{MODEL_NAME}/infer", request.v2_json, {}
        else:
            path, body = f"/v2/models/{MODEL_NAME}/infer", request.v2_binary
            headers = {"Inference-Header-Content-Length": str(request.v2_header_length),
                       "Content-Type": "application/octet-stream"}
        try:
            self.conn.request("POST", path, body=body, headers=headers)
            response = self.conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            return "network error", None
        if response.status != 200:
            return str(response.status), None
        return "200", (payload, response.getheader("Inference-Header-Content-Length"))

    def close(self) -> None:
        self.conn.close()


class GrpcClient:
    def __init__(self, port: int):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.grpc = grpc
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def send(self, request: Request) -> tuple[str, object]:
        try:
            return "200", self.stub.ModelInfer(request.grpc, timeout=30)
        except self.grpc.RpcError as exc:
            return exc.code().name, None

    def close(self) -> None:
        self.channel.close()


def client_for(ports: tuple[int, int], protocol: str):
    """A client of ``protocol`` for the server at (REST port, gRPC port)."""
    return GrpcClient(ports[1]) if protocol == "gRPC" else HttpClient(ports[0], protocol)


def decode(protocol: str, answer: object, shape: tuple[int, ...]) -> np.ndarray:
    if protocol == "gRPC":
        return np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(shape)
    payload, header_length = answer
    if protocol == "v2 REST binary":
        return np.frombuffer(payload[int(header_length):], np.float32).reshape(shape)
    document = json.loads(payload)
    if protocol == "v1 JSON":
        return np.asarray(document["output"], np.float32)
    return np.asarray(document["outputs"][0]["data"], np.float32).reshape(shape)


def check(protocol: str, answers: list[tuple[int, object]], requests: list[Request]) -> tuple[int, float]:
    """Wrong answers and the largest difference from MHASession."""
    wrong, worst = 0, 0.0
    for index, answer in answers:
        expected = requests[index].expected
        try:
            output = decode(protocol, answer, expected.shape)
            diff = float(np.abs(output - expected).max()) if output.shape == expected.shape else float("inf")
        except (ValueError, KeyError, TypeError):
            diff = float("inf")
        worst = max(worst, diff)
        wrong += not diff <= ATOL
    return wrong, worst


def _load(task: dict, requests: list[Request]) -> dict:
    """In a client process: ``task["clients"]`` threads sending in a loop until the shared deadline."""
    outcome, lock = Outcome(), threading.Lock()
    start_at, stop_at = task["start_at"], task["start_at"] + task["seconds"]
    protocol, server = task["protocol"], task["server"]

    def client(c: int) -> None:
        connection = client_for(server, protocol)
        mine = Outcome()
        n = task["first_client"] + c
        time.sleep(max(0.0, start_at - time.time()))
        while time.time() < stop_at:
            index = n % len(requests)
            n += task["all_clients"]
            t0 = time.perf_counter()
            status, answer = connection.send(requests[index])
            mine.count(status)
            if status == "200":
                mine.latencies.append(time.perf_counter() - t0)
                mine.answers.append((index, answer))
        connection.close()
        with lock:
            outcome.latencies += mine.latencies
            outcome.answers += mine.answers
            for status, count in mine.statuses.items():
                outcome.statuses[status] = outcome.statuses.get(status, 0) + count

    threads = [threading.Thread(target=client, args=(c,)) for c in range(task["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=task["seconds"] + 60)
    elapsed = time.time() - start_at
    wrong, worst = check(protocol, outcome.answers, requests)  # after the clock: costs the server nothing
    return {"latencies": outcome.latencies, "statuses": outcome.statuses, "wrong": wrong, "worst": worst,
            "elapsed": elapsed}


def _burst(task: dict, requests: list[Request]) -> dict:
    """In a client process: every thread sends 4 requests at the shared start, each protocol in turn."""
    counts, lock = {}, threading.Lock()

    def client(c: int) -> None:
        index = task["first_client"] + c
        protocol = PROTOCOLS[index % len(PROTOCOLS)]
        connection = client_for(task["server"], protocol)
        time.sleep(max(0.0, task["start_at"] - time.time()))
        mine: dict[str, int] = {}
        for k in range(4):
            item = (index * 4 + k) % len(requests)
            status, answer = connection.send(requests[item])
            if status == "200":
                status = "200" if check(protocol, [(item, answer)], requests)[0] == 0 else "wrong answer"
            elif status == "UNAVAILABLE":  # gRPC's 503
                status = "503"
            mine[status] = mine.get(status, 0) + 1
        connection.close()
        with lock:
            for status, count in mine.items():
                counts[status] = counts.get(status, 0) + count

    threads = [threading.Thread(target=client, args=(c,)) for c in range(task["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return {"statuses": counts}


def _client_process(pipe, requests: list[Request]) -> None:
    while (task := pipe.recv()) is not None:
        pipe.send((_load if task["kind"] == "load" else _burst)(task, requests))


class ClientPool:
    """Client processes, so that 32 client threads do not all queue for one interpreter lock.

    Forked before any gRPC channel exists (each process makes its own), they share
    the prepared requests; a task runs in all of them at once from a shared start time.
    """

    def __init__(self, requests: list[Request], processes: int):
        context = multiprocessing.get_context("fork")
        self.pipes, self.processes = [], []
        for _ in range(processes):
            parent, child = context.Pipe()
            process = context.Process(target=_client_process, args=(child, requests), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)

    def run(self, kind: str, server: ServerProcess, clients: int, protocol: str = "", seconds: float = 0.0):
        """Run ``clients`` clients spread over the processes; one result per process."""
        start_at = time.time() + 0.3
        share, extra = divmod(clients, len(self.pipes))
        first = 0
        for index, pipe in enumerate(self.pipes):
            mine = share + (index < extra)
            pipe.send({"kind": kind, "server": (server.port, server.grpc_port), "protocol": protocol,
                       "seconds": seconds, "clients": mine, "first_client": first, "all_clients": clients,
                       "start_at": start_at})
            first += mine
        return [pipe.recv() for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(timeout=30)


# --- measurements -------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_totals(port: int) -> tuple[float, float]:
    """(items, runs) the server's batcher has done so far."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    total = re.search(r"^mha_batch_size_sum (\S+)$", text, re.MULTILINE)
    count = re.search(r"^mha_batch_size_count (\S+)$", text, re.MULTILINE)
    return (float(total.group(1)), float(count.group(1))) if total and count else (0.0, 0.0)


@dataclass
class Row:
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    worst: float = 0.0
    cpu: float = 0.0
    items: float = 0.0
    runs: float = 0.0

    def add(self, results: list[dict], cpu: float, items: float, runs: float) -> None:
        for result in results:
            self.requests += len(result["latencies"])
            self.latencies += result["latencies"]
            for status, count in result["statuses"].items():
                self.statuses[status] = self.statuses.get(status, 0) + count
            self.wrong += result["wrong"]
            self.worst = max(self.worst, result["worst"])
        self.seconds += max(result["elapsed"] for result in results)
        self.cpu += cpu
        self.items += items
        self.runs += runs

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.array(self.latencies) * 1e3, q)) if self.latencies else float("nan")

    @property
    def errors(self) -> str:
        failed = {status: count for status, count in self.statuses.items() if status != "200"}
        return ",".join(f"{s}:{c}" for s, c in sorted(failed.items())) or "0"


def measure(model: Path, pool: ClientPool, args, tmp: Path) -> dict[tuple[str, str], Row]:
    servers: dict[str, ServerProcess] = {}
    rows = {(mode, protocol): Row() for mode in MODES for protocol in PROTOCOLS}
    try:
        for mode, server_args in MODES.items():
            servers[mode] = start_server(model, server_args, args.threads, tmp / f"{mode.replace(' ', '-')}.log")
            for protocol in PROTOCOLS:  # warm-up: connections, code paths, ORT's first runs at these shapes
                pool.run("load", servers[mode], args.clients, protocol, 0.3)
        for _ in range(args.rounds):
            for mode, server in servers.items():
                for protocol in PROTOCOLS:
                    cpu, (items, runs) = cpu_seconds(server.process.pid), batch_totals(server.port)
                    results = pool.run("load", server, args.clients, protocol, args.seconds / args.rounds)
                    cpu = cpu_seconds(server.process.pid) - cpu
                    items_after, runs_after = batch_totals(server.port)
                    rows[mode, protocol].add(results, cpu, items_after - items, runs_after - runs)
    finally:
        for server in servers.values():
            server.process.terminate()
            server.process.wait(timeout=60)
    return rows


def burst(model: Path, pool: ClientPool, args, tmp: Path) -> dict[str, int]:
    """``burst_clients`` clients at once, 4 requests each, against a queue of ``burst_queue`` items."""
    server = start_server(model, ["--max-queue", str(args.burst_queue), "--max-batch", "32", "--max-wait-ms", "2"],
                          args.threads, tmp / "burst.log")
    try:
        results = pool.run("burst", server, args.burst_clients)
    finally:
        server.process.terminate()
        server.process.wait(timeout=60)
    counts: dict[str, int] = {}
    for result in results:
        for status, count in result["statuses"].items():
            counts[status] = counts.get(status, 0) + count
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an exported model (default: export d_model 512, 8 heads, padding)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--client-processes", type=int, default=4, help="processes the clients are spread over")
    parser.add_argument("--seconds", type=float, default=6.0, help="load per mode and protocol, over all rounds")
    parser.add_argument("--rounds", type=int, default=3, help="alternate the modes and protocols this many times")
    parser.add_argument("--threads", type=int, help="ORT intra-op threads in the server")
    parser.add_argument("--burst-clients", type=int, default=128)
    parser.add_argument("--burst-queue", type=int, default=16, help="the burst server's --max-queue")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 120 or not 1 <= args.burst_clients <= 512:
        parser.error("keep the load bounded: 1..256 clients, at most 120 s per mode, 1..512 burst clients")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or export_default_model(tmp, args.d_model, args.heads)
        requests = make_requests(model, 256, seed=0)
        lengths = [r.x.shape[0] for r in requests]
        print(f"model {model.name} (d_model {requests[0].x.shape[1]}), {args.clients} clients, "
              f"{args.seconds:g} s per mode and protocol in {args.rounds} rounds, items of {min(lengths)}-"
              f"{max(lengths)} tokens, loopback, {os.cpu_count()} cores shared by server and clients")
        alone, batched = ort_per_item_ms(model, args.threads)
        print(f"ORT alone: {alone:.3f} ms per 18-token item run alone, {batched:.3f} ms per item in a batch of 8")
        pool = ClientPool(requests, args.client_processes)
        try:
            rows = measure(model, pool, args, tmp)
            counts = burst(model, pool, args, tmp)
        finally:
            pool.close()
        print(f"\n{'protocol':15} {'mode':13} {'requests':>8} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'errors':>7} {'wrong':>5} {'max diff':>9} {'mean batch':>10} {'CPU ms/req':>10}")
        for protocol in PROTOCOLS:
            for mode in MODES:
                row = rows[mode, protocol]
                print(f"{protocol:15} {mode:13} {row.requests:>8} {row.rps:>7.1f} {row.percentile(50):>7.1f} "
                      f"{row.percentile(99):>7.1f} {row.errors:>7} {row.wrong:>5} {row.worst:>9.2e} "
                      f"{row.items / max(row.runs, 1):>10.1f} {row.cpu / max(row.requests, 1) * 1e3:>10.2f}")
        print(f"\nburst: {args.burst_clients} clients x 4 requests at once (every protocol), --max-queue "
              f"{args.burst_queue}: " + ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())))

        on, off = "batching on", "batching off"
        v1 = rows[on, "v1 JSON"].rps
        print("\ntargets:")
        for protocol in ("v2 REST binary", "gRPC"):
            ratio = rows[on, protocol].rps / v1
            print(f"  {protocol} >= v1 JSON (batching on): {ratio:.2f}x -> {'met' if ratio >= 1 else 'NOT met'}")
        for protocol in PROTOCOLS:
            ratio = rows[on, protocol].rps / rows[off, protocol].rps
            print(f"  batching on >= 1.5x off, {protocol}: {ratio:.2f}x -> {'met' if ratio >= 1.5 else 'NOT met'}")
        wrong = sum(row.wrong for row in rows.values()) + counts.get("wrong answer", 0)
        other = sum(n for s, n in counts.items() if s not in ("200", "503", "wrong answer"))
        other += sum(n for row in rows.values() for s, n in row.statuses.items() if s != "200")
        print(f"  zero wrong answers: {wrong} wrong -> {'met' if wrong == 0 else 'NOT met'}")
        print(f"  zero errors but 503 under the burst: {other} others -> {'met' if other == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
