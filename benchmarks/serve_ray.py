"""``mha-deploy serve --ray-replicas``: new tokens/s of 1 Ray Serve replica against 2 under 64 concurrent requests
(issue 41's target: 2 replicas >= 1.5x one, one ORT thread per replica, on a 2-core machine).

A script, not a test:

    .venv/bin/python benchmarks/serve_ray.py                     # the 6-layer GPT, 64 requests, 2 rounds
    .venv/bin/python benchmarks/serve_ray.py --module tests/user_models/tutorial_gpt.py:build \\
        --requests 8 --new 4 8 --repeats 1                      # a quick check that it runs

The model is ``serve_generation.py``'s (``tests/user_models/tutorial_gpt.py``'s ``build_bench()``: d_model 512, 8
heads, 6 layers, a 32,000-token vocabulary, exported with ``--kv-cache`` and position ids, the ragged cache). A
burst of ``--requests`` requests arrives at once at Ray Serve's proxy, each a plain (not streamed) POST
/v1/completions of random prompt ids (``--prompt`` MIN MAX tokens), greedy, ``max_tokens`` in ``--new`` MIN MAX (no
end id, so each runs to it). A local Ray of 2 CPUs and the proxy start once, before anything is timed; each run
deploys the application with 1 or 2 replicas (1 CPU and 1 ORT thread each, continuous batching inside each), warms
each replica up, then times the burst from its first request to its last answer. Runs alternate, ``--repeats``
rounds, medians; each waits for a quiet machine first (``QuietGate``). The clients and the proxy share the machine
with the replicas. Every request's tokens are checked equal across runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_generation import NAME, export, free_port

from mha_deploy.bench import QuietGate
from mha_deploy.bench.timing import load_average, load_line


def complete(port: int, prompt: list[int], max_tokens: int) -> list[int]:
    """One plain /v1/completions request: its new token ids."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = response.read()
    conn.close()
    if response.status != 200:
        raise SystemExit(f"/v1/completions: {response.status} {answer[:300]!r}")
    return json.loads(answer)["choices"][0]["token_ids"]


def burst(port: int, prompts, lengths) -> tuple[list[list[int]], float]:
    """Every request at once, one client thread each: (tokens per request, seconds from first sent to last answer)."""
    tokens: list = [None] * len(prompts)

    def run(i):
        tokens[i] = complete(port, prompts[i], lengths[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="tests/user_models/tutorial_gpt.py:build_bench",
                        help="the causal LM to export with --kv-cache (default: the 6-layer GPT)")
    parser.add_argument("--model", type=Path, help="an exported KV-cache decoder instead of --module")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--new", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray
    from ray import serve

    from mha_deploy.batching import BatchingConfig
    from mha_deploy.runtime.kv_stepper import KVCacheStepper
    from mha_deploy.serving.http import GenerationOptions, ServeConfig
    from mha_deploy.serving.ray_serve import RayServeOptions, deploy, replica_reports

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or export(args.module, Path(tmp), position_ids=True)
        vocab = KVCacheStepper(model, threads=1).graph.vocab_size or 50
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(1, vocab, rng.integers(args.prompt[0], args.prompt[1] + 1)).tolist()
                   for _ in range(args.requests)]
        lengths = rng.integers(args.new[0], args.new[1] + 1, args.requests).tolist()
        longest = max(len(p) + n for p, n in zip(prompts, lengths, strict=True))
        port = free_port()
        config = ServeConfig(
            model, port=port, provider="cpu", threads=1, name=NAME, log_level="warning",
            batching=BatchingConfig(max_batch=args.requests, max_queue=args.requests),
            generation=GenerationOptions(max_kv_tokens=args.requests * longest, max_new_tokens=max(lengths),
                                         max_length=longest),
        )
        print(f"model: {args.model or args.module}; {args.requests} concurrent requests, prompts {args.prompt[0]}-"
              f"{args.prompt[1]} tokens, max_tokens {args.new[0]}-{args.new[1]} ({sum(lengths)} new tokens), greedy, "
              "plain /v1/completions through Ray Serve's proxy; 1 CPU and 1 ORT thread per replica", flush=True)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        gate, before = QuietGate(wait_s=15.0, total_wait_s=240.0), load_average()
        rates: dict[int, list[float]] = {1: [], 2: []}
        reference: list[list[int]] | None = None
        try:
            for _ in range(args.repeats):
                for replicas in (1, 2):
                    deploy(config, RayServeOptions(replicas=replicas, app_name="bench"))
                    burst(port, prompts[: 4 * replicas], [4] * (4 * replicas))  # warm every replica up
                    gate.wait()
                    tokens, seconds = burst(port, prompts, lengths)
                    split = "/".join(str(r["accepted"]) for r in replica_reports("bench"))
                    serve.delete("bench")
                    generated = sum(len(t) for t in tokens)
                    rates[replicas].append(generated / seconds)
                    print(f"{replicas} replica{'s' if replicas > 1 else ''}: {generated} new tokens in {seconds:.1f} s "
                          f"(requests per replica, warm-up included: {split})", flush=True)
                    reference = reference or tokens
                    if tokens != reference:
                        print("  tokens differ from the first run's:",
                              sum(a != b for a, b in zip(tokens, reference, strict=True)), "requests")
        finally:
            serve.shutdown()
            ray.shutdown()
        after = load_average()

    medians = {replicas: statistics.median(values) for replicas, values in rates.items()}
    print(f"\nmedians of {args.repeats}:")
    for replicas, rate in medians.items():
        print(f"  {replicas} replica{'s' if replicas > 1 else ' '} x 1 thread {rate:8,.1f} new tokens/s")
    print(f"2 replicas / 1 replica: {medians[2] / medians[1]:.2f}x (target >= 1.5x)")
    print(gate.summary())
    print(load_line(before, after, 2))


if __name__ == "__main__":
    main()
