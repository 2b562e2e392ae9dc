"""Generation on ORT's CUDA provider against its CPU provider: the same KV-cache model, the same greedy tokens?

Exports the benchmark GPT of ``tests/user_models/tutorial_gpt.py`` (``build_bench``: 6 layers, d_model 512, 8
heads, 32k vocabulary, random weights; ``--quick``: the tiny ``build``) with ``--kv-cache`` as users export it,
and again in the holes layout for CUDA (the ragged one runs on the CPU only), then decodes the same prompts (of
different lengths, so rows are padded) greedily with ``runtime.generation.generate`` over a ``KVCacheStepper`` on
each provider, checks the tokens agree, and times new tokens/s at batch 1 and batch 32 on each (one untimed run
first, then the median of three). Needs a GPU for the CUDA half; writes a JSON report.

    python scripts/cuda_generation.py OUT.json [--quick]        # run by scripts/gpu-check.sh
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _export(path: Path, quick: bool, cache_layout: str) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "user_models"))
    import torch
    import tutorial_gpt

    from mha_deploy.exporters import export_model

    torch.manual_seed(0)
    module = tutorial_gpt.build() if quick else tutorial_gpt.build_bench()
    started = time.perf_counter()
    export_model(module, path, tutorial_gpt.INPUTS, kv_cache=True, cache_layout=cache_layout)
    return {"export_s": round(time.perf_counter() - started, 1), "vocab": int(module.tok.num_embeddings)}


def _prompts(rows: int, length: int, vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Lengths differ per row: the padded batch is what a service sees.
    return [rng.integers(1, vocab, size=max(4, length - 7 * (row % 4))) for row in range(rows)]


def _decode(stepper, prompts, new_tokens: int) -> tuple[list[list[int]], float]:
    from mha_deploy.runtime.generation import generate

    generate(stepper, prompts, max_new_tokens=2, eos_token_id=[])  # untimed: allocations, kernel choice
    times, tokens = [], None
    for _ in range(3):
        started = time.perf_counter()
        out = generate(stepper, prompts, max_new_tokens=new_tokens, eos_token_id=[])
        times.append(time.perf_counter() - started)
        tokens = [list(map(int, row)) for row in out.tokens]
    return tokens, len(prompts) * new_tokens / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    report: dict = {"model": "tutorial_gpt.build" if args.quick else "tutorial_gpt.build_bench"}
    prompt, new = (12, 8) if args.quick else (128, 64)
    with tempfile.TemporaryDirectory() as tmp:
        # The ragged layout (the CPU's default) is GroupQueryAttention in place, which runs on the CPU only
        # (runtime.cuda_support): CUDA gets the holes layout of the same module, as the refusal tells users.
        files = {"cpu": Path(tmp, "ragged.onnx"), "cuda": Path(tmp, "holes.onnx")}
        for provider, layout in (("cpu", "ragged"), ("cuda", "holes")):
            report[f"{provider}_export"] = _export(files[provider], args.quick, layout)
        vocab = report["cpu_export"]["vocab"]
        for provider in ("cpu", "cuda"):
            stepper = KVCacheStepper(files[provider], threads=None, provider=provider)
            for batch in (1, 32):
                tokens, rate = _decode(stepper, _prompts(batch, prompt, vocab, batch), new)
                report[f"{provider}_b{batch}"] = {"new_tokens_per_s": round(rate, 1), "tokens": tokens}
                print(f"{provider:<4} batch {batch:>2}: {rate:8.1f} new tokens/s", flush=True)
    for batch in (1, 32):
        cpu, cuda = report[f"cpu_b{batch}"]["tokens"], report[f"cuda_b{batch}"]["tokens"]
        equal = sum(a == b for a, b in zip(cpu, cuda, strict=True))
        report[f"rows_equal_b{batch}"] = f"{equal}/{len(cpu)}"
        print(f"batch {batch}: {equal}/{len(cpu)} rows give the same greedy tokens on CUDA as on the CPU")
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
