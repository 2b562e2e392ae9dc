"""One cached step against recomputing the prefix, on a user's own causal LM exported with --kv-cache.

A script, not a test:

    .venv/bin/python benchmarks/kv_step.py                 # the tutorial GPT (d_model 512, 8 heads, 6 layers,
                                                           # 32k vocabulary), context 1024, batch 1, 2 threads
    .venv/bin/python benchmarks/kv_step.py --context 256 --budget 2

Both figures come from the same session (one file): a step is one new token after ``context - 1`` cached
ones; a recompute is the whole ``context``-token prefix in one call with an empty cache. Medians over
interleaved blocks (``bench.timing.time_blocks``), each block waiting for a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from mha_deploy.bench import QuietGate
from mha_deploy.bench.timing import load_average, load_line, time_blocks
from mha_deploy.exporters import export_model
from mha_deploy.runtime import MHASession

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "user_models"))
import tutorial_gpt  # the benchmark model lives with the other user models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024, help="tokens of context at the step (at most 1024)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timing per figure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpt.onnx"
        result = export_model(tutorial_gpt.build_bench(), path, tutorial_gpt.INPUTS, kv_cache=True)
        for warning in result.warnings:
            print(f"warning: {warning}")
        session = MHASession(path, threads=args.threads)
        ids = np.random.default_rng(0).integers(0, 32000, (1, args.context))
        mask = np.ones((1, args.context), bool)
        pairs = session.signature.cache_pairs
        empty = {name: np.zeros((1, *_dims(session, name)), np.float32) for name in pairs}
        prefix = session.run({"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], **empty})
        past = {name: prefix[present] for name, present in pairs.items()}
        step = {"input_ids": ids[:, -1:], "attention_mask": mask, **past}
        whole = {"input_ids": ids, "attention_mask": mask, **empty}
        before = load_average()
        timings = time_blocks({"step": lambda: session.run(step), "recompute": lambda: session.run(whole)},
                              args.budget, gate=QuietGate(wait_s=15.0, total_wait_s=60.0))
        after = load_average()
    step_ms, whole_ms = timings["step"].median_ms, timings["recompute"].median_ms
    print(f"context {args.context}, batch 1, {args.threads} threads: one cached step {step_ms:.2f} ms, "
          f"recomputing the prefix {whole_ms:.2f} ms: {whole_ms / step_ms:.1f}x (target >= 10x)")
    print(load_line(before, after, args.threads))


def _dims(session: MHASession, name: str) -> tuple[int, int, int]:
    _, heads, _, head_dim = session.signature.tensors[name].axes
    return heads, 0, head_dim


if __name__ == "__main__":
    main()
