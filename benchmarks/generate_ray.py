"""``generate --engine ray``: new tokens/s of 1 Ray actor against 2 (issue 41's target: 2 actors >= 1.6x one, one
thread per actor, on a 2-core machine), beside the local engine with 1 and 2 threads.

A script, not a test:

    .venv/bin/python benchmarks/generate_ray.py                  # 2,000 prompts, about 2 minutes on 2 cores
    .venv/bin/python benchmarks/generate_ray.py --prompts 200 --repeats 1   # checks it runs
    .venv/bin/python benchmarks/generate_ray.py --model bench --max-new-tokens 8 --repeats 1   # a model whose work
                                                                 # outweighs an actor's start (about 6 minutes)

The model is ``tests/user_models/tutorial_gpt.py``'s ``build()`` (the small tutorial GPT: 2 layers, d_model 32, a
60-token vocabulary, 512 positions; ``--model bench``: ``build_bench()``, 6 layers, d_model 512), exported as
users export it (``export_model(..., kv_cache=True)``). The
prompts: random ids of 16 to 64 tokens in 8 JSONL shards; greedy, ``--max-new-tokens`` new tokens each (no end id,
so every prompt runs to the end), batches of 16. A local Ray of 2 CPUs is started once, before anything is timed,
as a cluster is up before a job is sent to it; each timed run is a fresh job (a new output directory) timed from
the call to its return, so the Ray runs include their actors starting and loading the model, as a user pays it.
The runs alternate, ``--repeats`` rounds, medians; each waits for a quiet machine first (``QuietGate``), and every
run's outputs are checked to be the first run's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPOSITORY = Path(__file__).resolve().parents[1]
SHARDS, BATCH = 8, 16


def export(workdir: Path, size: str) -> Path:
    sys.path.insert(0, str(REPOSITORY / "tests" / "user_models"))
    import tutorial_gpt

    from mha_deploy.exporters import export_model

    path = workdir / "gpt.onnx"
    module = tutorial_gpt.build_bench() if size == "bench" else tutorial_gpt.build()
    export_model(module, path, tutorial_gpt.INPUTS, kv_cache=True)
    return path


def write_prompts(root: Path, count: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir()
    per_shard = -(-count // SHARDS)
    for shard in range(SHARDS):
        ids = range(shard * per_shard, min(count, (shard + 1) * per_shard))
        lines = (json.dumps({"id": i, "input_ids": rng.integers(0, 60, rng.integers(16, 65)).tolist()}) for i in ids)
        (root / f"shard-{shard}.jsonl").write_text("".join(line + "\n" for line in lines))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    # tiny: each actor's start (Ray, onnxruntime, the model: a few seconds) is most of a run; bench: the work is.
    parser.add_argument("--model", choices=("tiny", "bench"), default="tiny",
                        help="tiny: tutorial_gpt.build() (d_model 32); bench: build_bench() (6 layers, d_model 512, "
                             "32k vocabulary)")
    args = parser.parse_args()

    import ray

    from mha_deploy.batch.generation import (
        GenerationShards,
        PromptGenerator,
        generation_job,
        pads_exactly,
        run_generation,
        run_generation_on_ray,
    )
    from mha_deploy.batch.ray_engine import RayOptions
    from mha_deploy.batching import RunnerOptions
    from mha_deploy.bench import QuietGate
    from mha_deploy.runtime.generation import GenerationConfig
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    workdir = Path(tempfile.mkdtemp(prefix="generate-ray-"))
    try:
        model = export(workdir, args.model)
        prompts = write_prompts(workdir / "prompts", args.prompts)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens)
        options = RunnerOptions(batch_size=BATCH)

        def generator(threads: int) -> PromptGenerator:
            stepper = KVCacheStepper(model, threads=threads)
            return PromptGenerator(stepper, config, options, pad_prompts=pads_exactly(stepper))

        local = {threads: generator(threads) for threads in (1, 2)}
        task = GenerationShards.of(local[1])
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        runs = {
            "local engine, 1 thread": lambda job: run_generation(job, local[1]),
            "local engine, 2 threads": lambda job: run_generation(job, local[2]),
            "ray, 1 actor x 1 thread": lambda job: run_generation_on_ray(job, task, 1, RayOptions(concurrency=1)),
            "ray, 2 actors x 1 thread": lambda job: run_generation_on_ray(job, task, 1, RayOptions(concurrency=2)),
        }
        gate, load_before = QuietGate(wait_s=15.0, total_wait_s=240.0), os.getloadavg()
        rates: dict[str, list[float]] = {label: [] for label in runs}
        reference: dict[str, bytes] | None = None
        for round_ in range(args.repeats):
            for number, (label, run) in enumerate(runs.items()):
                output = workdir / f"out-{round_}-{number}"
                gate.wait()
                started = time.perf_counter()
                stats = run(generation_job(prompts, output, model, local[1]))
                seconds = time.perf_counter() - started
                rates[label].append(stats.tokens / seconds)
                print(f"{label}: {stats.items} prompts, {stats.tokens} new tokens in {seconds:.1f} s", flush=True)
                written = {p.name: p.read_bytes() for p in sorted(output.glob("*.jsonl"))}
                reference = reference or written
                assert written == reference, f"{label}: outputs differ from the first run's"
                shutil.rmtree(output)
        ray.shutdown()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n{args.prompts} prompts of 16-64 tokens, {args.max_new_tokens} new tokens each, batches of {BATCH}, "
          f"greedy; medians of {args.repeats}:")
    medians = {label: statistics.median(values) for label, values in rates.items()}
    for label, rate in medians.items():
        print(f"  {label:26s} {rate:8,.0f} new tokens/s")
    one, two = medians["ray, 1 actor x 1 thread"], medians["ray, 2 actors x 1 thread"]
    print(f"2 actors / 1 actor: {two / one:.2f}x (target >= 1.6x); 2 actors / local engine with 2 threads: "
          f"{two / medians['local engine, 2 threads']:.2f}x")
    print(gate.summary())
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
