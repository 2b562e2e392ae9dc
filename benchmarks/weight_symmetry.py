"""Weight-only int4 (and int8) with a zero point per block (the default) against scales only (``--symmetric``):
quality on a trained model and host time per decoded token, the figures behind docs/precision.md's choice.

A script, not a test:

    .venv/bin/python benchmarks/weight_symmetry.py --workdir DIR                 # int4: quality, then speed
    .venv/bin/python benchmarks/weight_symmetry.py --workdir DIR --kinds int4,int8 --repeats 6 --new 64
    .venv/bin/python benchmarks/weight_symmetry.py --workdir DIR --bench-fp32 F  # F: the LLM bench's fp32 export

Quality: the tiny Llama that benchmarks/llm_builder.py trains in 45 s (``write_trained_llama``, imported: the same
model, text source and held-out.jsonl), exported per variant by ``mha-deploy export --hf DIR --kv-cache --quantize
KIND [--symmetric] --eval-data held-out.jsonl`` (the export's own figures: relative error and top-1 on the parity
cases; perplexity and greedy agreement on held-out.jsonl), then run on a larger held-out text of the same source
(128 sequences of 65 ids, seed 11: 8,192 scored tokens) against the fp32 torch module: the file's perplexity and its
top-1 agreement with the module at every position.

Speed: the LLM bench's Llama (hidden 512, 6 layers, 32k vocabulary, random weights; ``--bench-fp32`` or exported
here with ``mha-deploy export --hf DIR --kv-cache``) quantized per variant as that bench quantizes it
(``Quantization.apply``, the token table too at int4: its random weights are refused by the int4 budget), decoded by
``runtime.generation`` (onnxruntime's CPU provider, 2 threads): per step, a 128-token prompt's ``--new`` tokens less
its first, at batch 1 and 16, the variants interleaved in one process (order reversed every other repeat). Ratios
within one run are what to read on a shared machine; the load average is printed.

A rerun with the same ``--workdir`` reuses the trained model, the exports and the quantized files.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from llm_builder import TARGET, TRAINED, markov_text, write_llama, write_trained_llama

MHA_DEPLOY = Path(sys.executable).with_name("mha-deploy")
SYMMETRY = {"asym": (), "sym": ("--symmetric",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="where the models and files go, kept")
    parser.add_argument("--kinds", default="int4", help="int4, int8 or int4,int8")
    parser.add_argument("--bench-fp32", type=Path, help="the LLM bench's fp32 export (else exported here)")
    parser.add_argument("--repeats", type=int, default=6, help="timed runs per variant and batch")
    parser.add_argument("--new", type=int, default=64, help="new tokens per timed run")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    figures = {}
    if not args.no_quality:
        figures["quality"] = quality(args.workdir / "trained", kinds)
    if not args.no_speed:
        figures["speed"] = speed(args.workdir, kinds, args.bench_fp32, args.repeats, args.new)
    (args.workdir / "weight-symmetry.json").write_text(json.dumps(figures, indent=1))
    print(f"figures written to {args.workdir / 'weight-symmetry.json'}")


def quality(workdir: Path, kinds: list[str]) -> list[dict]:
    import torch
    from transformers import LlamaForCausalLM

    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    folder = workdir / "llama"
    write_trained_llama(folder)
    held, source = markov_text(128, TRAINED.prompt + 1, seed=11, vocab=TRAINED.vocab)
    torch.set_num_threads(2)
    module = LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        want = module(input_ids=torch.from_numpy(held)).logits.numpy()  # [rows, seq, vocab]
    rows = [{"variant": "fp32 torch", "perplexity": perplexity(want, held), "source_perplexity": source}]
    print(json.dumps(rows[-1]), flush=True)
    for kind in kinds:
        for symmetry, flags in SYMMETRY.items():
            path = workdir / f"{kind}-{symmetry}" / "model.onnx"
            text = export(folder, path, ["--quantize", kind, *flags, "--eval-data", str(folder / "held-out.jsonl")])
            parity = re.search(r"relative error ([\d.]+)%.*?top-1 agreement ([\d.]+)%", text)
            judged = re.search(r"perplexity ([\d.]+) against fp32's ([\d.]+).*?greedy \d+ new tokens: ([\d.]+)% equal "
                               r"before the first difference, (\d+) of", text)
            stepper = KVCacheStepper(str(path), threads=2)
            got = np.concatenate([stepper.prefill(held[i:i + 16], np.ones_like(held[i:i + 16]), every_position=True)
                                  for i in range(0, len(held), 16)])
            rows.append({"variant": f"{kind} {symmetry}", "parity_rel_err": float(parity.group(1)) / 100,
                         "parity_top1": float(parity.group(2)) / 100, "eval_perplexity": float(judged.group(1)),
                         "eval_perplexity_fp32": float(judged.group(2)),
                         "greedy_equal": float(judged.group(3)) / 100, "greedy_identical": int(judged.group(4)),
                         "perplexity": perplexity(got, held),
                         "perplexity_ratio": perplexity(got, held) / rows[0]["perplexity"],
                         "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
                         "rel_err": float(np.linalg.norm(got - want) / np.linalg.norm(want))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of each next id ([rows, seq, vocab] logits of [rows, seq] ids)."""
    logits = logits[:, :-1].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.exp(-np.take_along_axis(log_probs, ids[:, 1:, None], -1).mean()))


def export(folder: Path, path: Path, flags: list[str]) -> str:
    """``mha-deploy export --hf folder --kv-cache`` with ``flags`` to ``path`` (its output kept beside it and reused
    by a rerun); the output, or SystemExit when it failed."""
    log = path.with_name("export.log")
    if not log.exists():
        command = [str(MHA_DEPLOY), "export", "--hf", str(folder), "--kv-cache", *flags, "-o", str(path)]
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the export failed:\n{(done.stdout + done.stderr)[-3000:]}")
        log.write_text(done.stdout + done.stderr)
    return log.read_text()


def speed(workdir: Path, kinds: list[str], fp32: Path | None, repeats: int, new: int) -> dict:
    import onnx

    from mha_deploy.bench.timing import load_average
    from mha_deploy.exporters.quantize import Quantization
    from mha_deploy.metadata import METADATA_KEY, ModelMetadata
    from mha_deploy.runtime.generation import generate
    from mha_deploy.runtime.kv_stepper import KVCacheStepper

    if fp32 is None:
        fp32 = workdir / "bench-fp32" / "model.onnx"
        export(write_llama(TARGET, workdir / "bench-llama"), fp32, [])
    steppers = {}
    for kind in kinds:
        for symmetry in SYMMETRY:
            path = workdir / "speed" / f"{kind}-{symmetry}.onnx"
            if not path.exists():  # as benchmarks/llm_builder.py's _quantize_file, with the symmetry asked for
                quantization = Quantization(kind, symmetric=symmetry == "sym", embeddings=kind == "int4")
                model = quantization.apply(onnx.load(str(fp32)))
                metadata = replace(ModelMetadata.from_props({p.key: p.value for p in model.metadata_props}, str(fp32)),
                                   quantization=kind, weight_only=quantization.record(model))
                for prop in model.metadata_props:
                    if prop.key == METADATA_KEY:
                        prop.value = metadata.to_json()
                path.parent.mkdir(parents=True, exist_ok=True)
                onnx.save(model, str(path))
            steppers[f"{kind} {symmetry}"] = KVCacheStepper(str(path), threads=2)
    rng = np.random.default_rng(0)
    steps = {(name, batch): [] for name in steppers for batch in (1, 16)}
    before = load_average()
    for repeat in range(repeats):
        for batch in (1, 16):
            prompts = rng.integers(3, TARGET.vocab, (batch, 128))
            for name in list(steppers)[:: 1 if repeat % 2 == 0 else -1]:
                stepper = steppers[name]
                if repeat == 0:
                    generate(stepper, prompts, max_new_tokens=2, eos_token_id=[])  # untimed: first-run allocations
                started = time.perf_counter()
                generate(stepper, prompts, max_new_tokens=1, eos_token_id=[])
                first = time.perf_counter()
                generate(stepper, prompts, max_new_tokens=new, eos_token_id=[])
                steps[name, batch].append(((time.perf_counter() - first) - (first - started)) / (new - 1))
    summary = {"load_average": [before, load_average()]}
    for kind in kinds:
        for batch in (1, 16):
            asym, sym = (np.array(steps[f"{kind} {s}", batch]) for s in SYMMETRY)
            summary[f"{kind} batch {batch}"] = {
                "ms_per_step_asym": float(np.median(asym) * 1e3), "ms_per_step_sym": float(np.median(sym) * 1e3),
                "sym_over_asym": float(np.median(sym) / np.median(asym)),
                "sym_over_asym_paired": float(np.median(sym / asym))}
            print(kind, f"batch {batch}", json.dumps(summary[f"{kind} batch {batch}"]), flush=True)
    print("load average before / after:", summary["load_average"])
    return summary


if __name__ == "__main__":
    main()
