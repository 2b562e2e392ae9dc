"""Requests/s and latency of `mha-deploy serve` with micro-batching on vs off, under the same concurrent load.

Starts one real server process per mode on a free loopback port, drives it with
``--clients`` threads (each with a keep-alive connection) for ``--seconds``,
and prints one line per mode. Clients run on the same machine as the server and
compete with it for the CPU: read the figures as relative, not as capacity.

    .venv/bin/python benchmarks/serve.py                      # exports a d_model 512, 8-head model (needs torch)
    .venv/bin/python benchmarks/serve.py --model mha.onnx --clients 32 --seconds 8 --format json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MODES = {
    "batching on": ["--max-batch", "32", "--max-wait-ms", "2"],
    "batching off": ["--max-batch", "1"],
}


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


def model_d_model(path: Path) -> int:
    from mha_deploy.runtime import MHASession

    return MHASession(path, provider="cpu").metadata.d_model


def start_server(model: Path, port: int, args: list[str], threads: int | None, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(model), "--port", str(port)]
    command += ["--log-level", "warning", *args]
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
                return process
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"server not ready after 60 s:\n{log.read_text()}")


WORKLOADS = {
    # Uniform 4..32 tokens: where per-run overhead and small matrix products dominate.
    "short": lambda rng, n: rng.integers(4, 33, size=n),
    # Lognormal, median ~40 tokens, clipped to 8..256: compute-bound on a CPU.
    "mixed": lambda rng, n: np.clip(rng.lognormal(np.log(40), 0.6, size=n), 8, 256).astype(int),
}


def make_bodies(d_model: int, count: int, fmt: str, workload: str, seed: int) -> tuple[list[bytes], list[int]]:
    """``count`` request bodies with lengths drawn from ``WORKLOADS[workload]``."""
    rng = np.random.default_rng(seed)
    lengths = WORKLOADS[workload](rng, count)
    bodies = []
    for n in lengths:
        x = rng.standard_normal((int(n), d_model), dtype=np.float32)
        if fmt == "json":
            bodies.append(json.dumps({"x": x.tolist()}).encode())
        else:
            buffer = io.BytesIO()
            np.save(buffer, x)
            bodies.append(buffer.getvalue())
    return bodies, lengths.tolist()


def drive(port: int, bodies: list[bytes], content_type: str, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine = []
        start.wait()
        n = c
        while time.perf_counter() < stop_at[0]:
            body = bodies[n % len(bodies)]
            n += clients
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/infer", body=body, headers={"Content-Type": content_type})
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            if ok:
                mine.append(time.perf_counter() - t0)
            else:
                with lock:
                    errors[0] += 1
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join(timeout=seconds + 60)
    return {"latencies": latencies, "errors": errors[0], "seconds": time.perf_counter() - began}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(runs: list[dict]) -> dict:
    ms = np.array([latency for run in runs for latency in run["latencies"]]) * 1e3
    seconds = sum(run["seconds"] for run in runs)
    return {
        "requests": len(ms),
        "errors": sum(run["errors"] for run in runs),
        "rps": len(ms) / seconds,
        "p50": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
        "p99": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
        "cpu_ms": sum(run["cpu"] for run in runs) / max(len(ms), 1) * 1e3,
    }


def mean_batch_size(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    total = re.search(r"^mha_batch_size_sum (\S+)$", text, re.MULTILINE)
    count = re.search(r"^mha_batch_size_count (\S+)$", text, re.MULTILINE)
    return float(total.group(1)) / max(float(count.group(1)), 1.0) if total and count else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an exported model (default: export d_model 512, 8 heads, padding)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="load duration per mode and workload (bounded)")
    parser.add_argument("--rounds", type=int, default=4, help="alternate the modes this many times")
    parser.add_argument("--format", choices=("npy", "json"), default="npy")
    parser.add_argument("--threads", type=int, help="ORT intra-op threads in the server")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 120:
        parser.error("keep the load bounded: 1..256 clients, at most 120 s per mode")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or export_default_model(tmp, args.d_model, args.heads)
        d_model = model_d_model(model)
        content_type = "application/json" if args.format == "json" else "application/x-npy"
        print(
            f"model {model.name} (d_model {d_model}), {args.clients} clients x {args.seconds:g} s per run, "
            f"{args.format} bodies, loopback, {os.cpu_count()} cores shared by server and clients"
        )
        print(
            f"{'workload':22} {'mode':13} {'requests':>8} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'errors':>6} {'mean batch':>10} {'server CPU ms/req':>17}"
        )
        for workload in args.workloads:
            bodies, lengths = make_bodies(d_model, 512, args.format, workload, seed=0)
            label = f"{workload} ({min(lengths)}-{max(lengths)}, med {int(np.median(lengths))})"
            # Both servers up at once, driven in turn for short rounds: load from other processes on
            # a shared machine then hits both modes alike instead of whichever ran second.
            servers, runs = {}, {mode: [] for mode in MODES}
            try:
                for mode, server_args in MODES.items():
                    port = free_port()
                    log = tmp / f"{workload}-{mode.replace(' ', '-')}.log"
                    servers[mode] = (port, start_server(model, port, server_args, args.threads, log))
                    drive(port, bodies[:64], content_type, args.clients, 0.5)  # warm-up
                for _ in range(args.rounds):
                    for mode, (port, process) in servers.items():
                        cpu = cpu_seconds(process.pid)
                        run = drive(port, bodies, content_type, args.clients, args.seconds / args.rounds)
                        run["cpu"] = cpu_seconds(process.pid) - cpu
                        runs[mode].append(run)
                batches = {mode: mean_batch_size(port) for mode, (port, _process) in servers.items()}
            finally:
                for _port, process in servers.values():
                    process.terminate()
                    process.wait(timeout=60)
            for mode in MODES:
                result = summarize(runs[mode])
                print(
                    f"{label:22} {mode:13} {result['requests']:>8} {result['rps']:>7.1f} {result['p50']:>7.1f} "
                    f"{result['p99']:>7.1f} {result['errors']:>6} {batches[mode]:>10.1f} {result['cpu_ms']:>17.2f}",
                    flush=True,
                )

if __name__ == "__main__":
    main()
