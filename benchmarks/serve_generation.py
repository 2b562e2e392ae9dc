"""Generated tokens/s of `mha-deploy serve` on a KV-cache decoder: continuous batching vs one request at a time vs
static batches, and the same load through Triton's generate route, in one run.

A burst of ``--requests`` requests arrives at once (prompts of ``--prompt`` MIN MAX tokens, ``max_tokens`` in
``--new`` MIN MAX, greedy, no end id so each runs to its max_tokens), and is served:

- ``continuous``: every request at once to one server (``/v1/completions`` with ``stream: true``): the engine
  admits them, prefills them in chunks between decode steps, and rows leave when done;
- ``triton generate``: the same burst through ``/v2/models/NAME/generate_stream``;
- ``one at a time``: the same server, each request sent when the previous one has finished;
- ``static batches``: ``--static-batch`` requests at a time in arrival order through the library loop
  (``runtime.generation.generate``, in this process, no HTTP), each batch running until its longest request
  finishes (what a server without continuous batching does).

Reported per mode: generated tokens/s over the whole burst (the tokens asked for, not padding), median and p90
time to first token counted from the burst's start. Greedy tokens of every served mode are checked equal request by
request. Clients run on the same machine as the server and compete with it for the CPU.

    .venv/bin/python benchmarks/serve_generation.py              # the 6-layer GPT, 64 requests (long on 2 cores)
    .venv/bin/python benchmarks/serve_generation.py --module tests/user_models/tutorial_gpt.py:build \\
        --requests 8 --prompt 4 32 --new 2 12                   # a quick check that it runs

The GPT (tests/user_models/tutorial_gpt.py) has learned positions: ``export --kv-cache`` gives it a
``position_ids`` input by default and writes the ragged cache layout (each row's keys and values written in place at
its own length), so that requests of any length share one cache and each still gets its tokens alone.
``--no-position-ids`` exports it without (the holes layout: the engine then batches only requests of one length
together, exact, as alone; the startup line says so). A model without positions (tests/user_models/causal_lm.py)
is ragged either way: its export records so.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mha_deploy.bench.timing import load_average, load_line

ROOT = Path(__file__).resolve().parent.parent
NAME = "lm"


@dataclass
class Served:
    """One mode's result: tokens per request (in request order), seconds from the burst's start to each first
    token, and the burst's wall time."""

    tokens: list[list[int]]
    first: list[float]
    seconds: float

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


def export(module: str, directory: Path, position_ids: bool) -> Path:
    path = directory / "lm.onnx"
    command = [sys.executable, "-m", "mha_deploy.cli", "export", "--module", module, "--input", "tokens:tokens",
               "--input", "mask:padding-mask", "--kv-cache", "--position-ids" if position_ids else "--no-position-ids",
               "-o", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"export failed:\n{done.stdout}{done.stderr}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(model: Path, args: list[str], log: Path):
    port = free_port()
    command = [sys.executable, "-m", "mha_deploy.cli", "serve", str(model), "--port", str(port), "--name", NAME,
               "--provider", "cpu", *args]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"server exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready after 120 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(30)


def stream_one(port: int, route: str, prompt: list[int], max_tokens: int, start: float) -> tuple[list[int], float]:
    """One streamed request: its tokens, and when its first token came (seconds after ``start``)."""
    if route == "openai":
        path, body = "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0, "stream": True}
        ids = lambda event: event["choices"][0]["token_ids"] if event["choices"] else []  # noqa: E731
    else:
        path, body = f"/v2/models/{NAME}/generate_stream", {"input_ids": prompt, "max_tokens": max_tokens}
        ids = lambda event: event["output_ids"]  # noqa: E731
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"{path}: {response.status} {response.read()[:300]!r}")
    tokens, first = [], None
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        new = ids(json.loads(line[6:]))
        if new and first is None:
            first = time.perf_counter() - start
        tokens.extend(new)
    conn.close()
    return tokens, first


def burst(port: int, route: str, prompts, lengths) -> Served:
    results: list = [None] * len(prompts)
    start = time.perf_counter()

    def run(i):
        results[i] = stream_one(port, route, prompts[i], lengths[i], start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    return Served([r[0] for r in results], [r[1] for r in results], seconds)


def one_at_a_time(port: int, prompts, lengths) -> Served:
    start = time.perf_counter()
    results = [stream_one(port, "openai", p, n, start) for p, n in zip(prompts, lengths, strict=True)]
    return Served([r[0] for r in results], [r[1] for r in results], time.perf_counter() - start)


def static_batches(model: Path, prompts, lengths, batch: int, threads: int) -> Served:
    """Batches in arrival order through the library loop, each until its longest request is done; a request's
    tokens are the first max_tokens of its row."""
    from mha_deploy.runtime.generation import stream
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    stepper = KVCacheStepper(model, threads=threads)
    tokens: list[list[int]] = [[] for _ in prompts]
    first: list[float] = [0.0] * len(prompts)
    start = time.perf_counter()
    for at in range(0, len(prompts), batch):
        rows = list(range(at, min(at + batch, len(prompts))))
        longest = max(lengths[i] for i in rows)
        for step, out in enumerate(stream(stepper, [prompts[i] for i in rows], max_new_tokens=longest)):
            for row, token in zip(out.prompts, out.tokens, strict=True):
                i = rows[row]
                if step == 0:
                    first[i] = time.perf_counter() - start
                if len(tokens[i]) < lengths[i]:
                    tokens[i].append(int(token))
    return Served(tokens, first, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="tests/user_models/tutorial_gpt.py:build_bench",
                        help="the causal LM to export with --kv-cache (default: the 6-layer GPT)")
    parser.add_argument("--model", type=Path, help="an exported KV-cache decoder instead of --module")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--new", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--static-batch", type=int, default=16, help="requests per static batch")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (server and static)")
    parser.add_argument("--position-ids", action=argparse.BooleanOptionalAction, default=True,
                        help="export with each row's positions as an input (a model with learned positions)")
    parser.add_argument("--mix-lengths", action="store_true",
                        help="let the server mix lengths in one cache (a model without positions)")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model = args.model or export(args.module, directory, args.position_ids)
        from mha_deploy.runtime.kv_stepper import KVCacheStepper

        vocab = KVCacheStepper(model).graph.vocab_size or 50
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(1, vocab, rng.integers(args.prompt[0], args.prompt[1] + 1)).tolist()
                   for _ in range(args.requests)]
        lengths = rng.integers(args.new[0], args.new[1] + 1, args.requests).tolist()
        needs = [len(p) + n for p, n in zip(prompts, lengths, strict=True)]
        server_args = ["--max-batch", str(args.requests), "--max-queue", str(args.requests),
                       "--max-kv-tokens", str(len(needs) * max(needs)), "--max-new-tokens", str(max(lengths)),
                       "--max-length", str(max(needs)), "--threads", str(args.threads), "--log-level", "warning",
                       "--prefill-chunk", str(args.prefill_chunk), *(["--mix-lengths"] if args.mix_lengths else [])]
        print(f"model: {args.model or args.module}; {args.requests} requests, prompts {args.prompt[0]}-"
              f"{args.prompt[1]} tokens, max_tokens {args.new[0]}-{args.new[1]} ({sum(lengths)} tokens to generate), "
              f"{args.threads} ORT threads")
        before = load_average()
        results: dict[str, Served] = {}
        log = directory / "server.log"
        with server(model, server_args, log) as port:
            describe = http.client.HTTPConnection("127.0.0.1", port)
            describe.request("GET", f"/v2/models/{NAME}")
            print("server:", json.loads(describe.getresponse().read())["parameters"]["batching"])
            results["continuous"] = burst(port, "openai", prompts, lengths)
            results["triton generate"] = burst(port, "triton", prompts, lengths)
            results["one at a time"] = one_at_a_time(port, prompts, lengths)
        results[f"static batches of {args.static_batch}"] = static_batches(
            model, prompts, lengths, args.static_batch, args.threads)
        after = load_average()

    print(f"\n{'mode':<22} {'tokens':>7} {'seconds':>9} {'tokens/s':>9} {'TTFT p50 s':>11} {'TTFT p90 s':>11}")
    for label, served in results.items():
        first = sorted(served.first)
        p90 = first[min(len(first) - 1, int(0.9 * len(first)))]
        print(f"{label:<22} {served.generated:>7} {served.seconds:>9.2f} {served.generated / served.seconds:>9.1f} "
              f"{statistics.median(first):>11.3f} {p90:>11.3f}")
    rate = {label: served.generated / served.seconds for label, served in results.items()}
    continuous = rate["continuous"]
    static = next(v for k, v in rate.items() if k.startswith("static"))
    print(f"\ncontinuous / one at a time: {continuous / rate['one at a time']:.2f}x (target >= 3x)")
    print(f"continuous / static batches: {continuous / static:.2f}x (target >= 1.5x)")
    print(f"triton generate / continuous (OpenAI route): {rate['triton generate'] / continuous:.2f}x")
    served = [k for k in results if not k.startswith("static")]
    alone = results["one at a time"].tokens
    differ = [(k, i) for k in served for i, t in enumerate(results[k].tokens) if t != alone[i]]
    print(f"greedy tokens of every served mode equal one at a time's: {'yes' if not differ else f'NO {differ[:5]}'}")
    print(load_line(before, after, args.threads))


if __name__ == "__main__":
    main()
