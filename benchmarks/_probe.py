"""Each measured tool of the generation benchmarks runs in a fresh process of its own (the benchmark script again,
with ``--probe NAME --request FILE``), so that its peak RSS is its own; and the decode loop they time for ours.

numpy at import and nothing else, so that a probe running in another environment (onnxruntime-genai's) imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

REPOSITORY = Path(__file__).resolve().parents[1]


def run_probe(python: str | Path, script: str, name: str, request: dict, workdir: Path) -> dict:
    """``script --probe name`` on ``request`` under ``python`` (the repository importable): the JSON it prints last."""
    path = workdir / f"{name}-request.json"
    path.write_text(json.dumps(request))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([str(python), script, "--probe", name, "--request", str(path)], capture_output=True,
                          text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the {name} probe failed on {request.get('model', 'its model')}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_our_decoding(request: dict):
    """``runtime.generation`` over ``request["model"]`` (torch-free, as users run it), no eos so that every row runs
    to the end: the seconds of each of ``request["repeats"]`` runs after an untimed one, the last output and the
    stepper."""
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    stepper = KVCacheStepper(request["model"], threads=request["threads"])
    prompts = np.asarray(request["prompts"], np.int64)
    generate(stepper, prompts, max_new_tokens=2, eos_token_id=[])  # untimed: first-run allocations
    seconds, out = [], None
    for _ in range(request["repeats"]):
        started = time.perf_counter()
        out = generate(stepper, prompts, max_new_tokens=request["new"], eos_token_id=[])
        seconds.append(time.perf_counter() - started)
    return seconds, out, stepper


def time_transformers_decoding(model, request: dict, pad: int, eos: int | None):
    """transformers' ``generate`` (greedy, its own cache) on ``request["prompts"]``, exactly ``request["new"]`` new
    tokens each: the seconds of each of ``request["repeats"]`` runs after an untimed one, and the last run's new
    tokens."""
    import torch

    prompts = torch.tensor(request["prompts"])
    mask = torch.ones_like(prompts)
    options = {"do_sample": False, "use_cache": True, "pad_token_id": pad, "eos_token_id": eos}
    with torch.inference_mode():
        model.generate(prompts, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **options)
        seconds = []
        for _ in range(request["repeats"]):
            started = time.perf_counter()
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=request["new"],
                                 min_new_tokens=request["new"], **options)
            seconds.append(time.perf_counter() - started)
    assert out.shape[1] == prompts.shape[1] + request["new"]
    return seconds, out[:, prompts.shape[1]:]
