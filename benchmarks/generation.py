"""Generating with your own GPT, the target of issue 29: a KV-cache export against recomputing the prefix, against
transformers' ``generate`` with its cache in torch, and against onnxruntime-genai running the same file.

A script, not a test:

    .venv/bin/python benchmarks/generation.py            # the target's sizes, one quiet run on 2 cores
    .venv/bin/python benchmarks/generation.py --quick    # the small tutorial GPT, short prompts: checks it runs

The model is ``tests/user_models/tutorial_gpt.py``'s ``build_bench()`` (``build()`` with --quick): a GPT in the
tutorial form on the reference attention, learned positions, 6 layers, d_model 512, 8 heads, a 32k vocabulary,
1024 positions, random weights. It is exported as users export it, ``export_model(module, path, INPUTS,
kv_cache=True)`` (fused, parity checked call by call), and ``genai_config.json`` is written beside it for
onnxruntime-genai (``.venv-genai``, scripts/setup.sh). Greedy, 2 threads everywhere, fp32 CPU.

- Per-token latency at batch 1 and context 1024: one call of the file with 1023 cached positions and one new
  token, against one call over the whole 1024-token prefix with an empty cache (what generating without a cache
  costs per token), both through the same ``MHASession``; timed blocks over several passes, medians.
- Throughput at batch 16: prompts of 128 random ids, 128 new tokens (no eos, so every row runs to the end), new
  tokens per second of the whole ``generate`` call (prompt included): ours (``runtime.generation.generate`` over a
  ``KVCacheStepper``), transformers' ``generate`` on ``GPT2LMHeadModel`` of the same sizes (sdpa, random
  weights, its cache), and onnxruntime-genai on our file. Each runs in a fresh process of its own (one untimed
  short run, then timed runs; median), which also reports its peak RSS (VmHWM); whether onnxruntime-genai's
  greedy tokens equal ours is checked on the way.
- Memory: our cache grows with the requests (prompt + new tokens), not to the model's 1024 positions; its size at
  the end is printed beside the size a max-length cache would take.

Each timed block waits for a quiet machine (``QuietGate``); the load average before and after ends the report.

With ``--quantize int4`` (or int8) it measures the weight-only quantized export against the fp32 one instead, in
one run: both exported the same way (the quantized one with its error and top-1 agreement against fp32 torch),
their file sizes, the weight bytes a decoded token reads (every stored weight, scales and zero points included,
an embedding table counted as one row), this machine's memory bandwidth (what the decoders' threads read,
``_decode_limits.read_bandwidth``) and the batch-1 limit it sets, and new tokens/s of ``runtime.generation`` at
batch 1 and at batch 16 (prompts of 128, 128 new tokens; each in a fresh process, the two files alternating).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _decode_limits import peak_rss_mb, read_bandwidth, weight_bytes_per_token
from _probe import run_probe, time_our_decoding, time_transformers_decoding

REPOSITORY = Path(__file__).resolve().parents[1]
THREADS, PAD = 2, 0


@dataclass(frozen=True)
class Sizes:
    factory: str  # of tests/user_models/tutorial_gpt.py
    vocab: int
    d_model: int
    heads: int
    layers: int
    positions: int
    prompt: int
    new: int
    batch: int
    context: int  # the per-token latency's
    repeats: int  # timed generate runs per backend


TARGET = Sizes("build_bench", 32000, 512, 8, 6, 1024, prompt=128, new=128, batch=16, context=1024, repeats=2)
QUICK = Sizes("build", 60, 32, 4, 2, 512, prompt=16, new=16, batch=4, context=128, repeats=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small tutorial GPT, short prompts")
    parser.add_argument("--workdir", type=Path, help="where to export (default: a temporary directory)")
    parser.add_argument("--quantize", choices=("int4", "int8"),
                        help="measure this weight-only export against the fp32 one (sizes, bytes per token, tokens/s)")
    parser.add_argument("--probe", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--request", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:  # a fresh process measuring one backend (see _probe)
        print(json.dumps(_PROBES[args.probe](json.loads(args.request.read_text()))))
        return
    sizes = QUICK if args.quick else TARGET
    measure = (lambda s, w: run_quantized(s, w, args.quantize)) if args.quantize else run
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        measure(sizes, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="mha-generation-bench-") as workdir:
            measure(sizes, Path(workdir))


def run(sizes: Sizes, workdir: Path) -> None:
    from mha_deploy.bench import QuietGate
    from mha_deploy.bench.genai import genai_python, run_genai_greedy
    from mha_deploy.bench.timing import load_average, load_line

    before = load_average()
    gate = QuietGate(wait_s=2.0, total_wait_s=20.0) if sizes is QUICK else QuietGate(wait_s=15.0, total_wait_s=240.0)
    path = export(sizes, workdir)
    print(f"model: tutorial_gpt.{sizes.factory}() d_model {sizes.d_model}, {sizes.heads} heads, {sizes.layers} "
          f"layers, vocabulary {sizes.vocab}, {sizes.positions} positions; {THREADS} threads, greedy", flush=True)

    cached_ms, recompute_ms = per_token_latency(path, sizes, gate)
    print(f"per-token latency, batch 1, context {sizes.context}: {cached_ms:.2f} ms with the cache, "
          f"{recompute_ms:.2f} ms recomputing the prefix: {recompute_ms / cached_ms:.1f}x", flush=True)

    rng = np.random.default_rng(0)
    prompts = rng.integers(1, sizes.vocab, (sizes.batch, sizes.prompt)).tolist()  # no pad id among them
    request = {"model": str(path), "prompts": prompts, "new": sizes.new, "repeats": sizes.repeats,
               "threads": THREADS, "sizes": sizes.__dict__}
    results = {}
    for name in ("ours", "transformers"):
        gate.wait()
        results[name] = _probe(name, request, workdir)
    genai = None
    if genai_python() is None:
        print("onnxruntime-genai: not measured (no .venv-genai: run scripts/setup.sh)")
    else:
        gate.wait()
        genai = run_genai_greedy(workdir, prompts, sizes.prompt + sizes.new, repeats=sizes.repeats, warmup=True)
        results["onnxruntime-genai"] = {"seconds": genai.seconds, "peak_rss_mb": genai.peak_rss_mb}

    tokens = sizes.batch * sizes.new
    rates = {name: tokens / float(np.median(result["seconds"])) for name, result in results.items()}
    print(f"throughput, batch {sizes.batch}, prompts of {sizes.prompt}, {sizes.new} new tokens "
          f"(median of {sizes.repeats} runs, each in a fresh process):")
    labels = {"ours": "ours (KV-cache export, runtime.generation)", "transformers": "transformers generate (sdpa)",
              "onnxruntime-genai": "onnxruntime-genai, same file"}
    for name, result in results.items():
        print(f"  {labels[name]:<46} {rates[name]:8.0f} new tokens/s   peak RSS {result['peak_rss_mb']:7.0f} MB")
    if genai is not None:
        theirs = genai.new_tokens(sizes.prompt)
        same = sum(row == mine for row, mine in zip(theirs, results["ours"]["tokens"], strict=True))
        print(f"  onnxruntime-genai's greedy tokens equal ours in {same} of {sizes.batch} rows")
    cache_mb, held = results["ours"]["cache_mb"], results["ours"]["cache_positions"]
    # A holes cache ends at prompt + new - 1 (the last token is never fed); a ragged one was sized prompt + new.
    print(f"memory: our cache at the end holds {held} positions per row (prompt {sizes.prompt}, {sizes.new} new "
          f"tokens), {cache_mb:.1f} MB; sized to the model's {sizes.positions} positions it would hold "
          f"{cache_mb * sizes.positions / held:.1f} MB")

    print("targets (this run's own figures):")
    checks = [("per-token latency >= 10x recomputing the prefix", recompute_ms / cached_ms, 10.0),
              ("throughput >= 1.5x transformers generate", rates["ours"] / rates["transformers"], 1.5)]
    if genai is not None:
        checks.append(("throughput >= 1.0x onnxruntime-genai", rates["ours"] / rates["onnxruntime-genai"], 1.0))
    for words, ratio, target in checks:
        print(f"  {words}: {ratio:.2f}x {'met' if ratio >= target else 'NOT met'}")
    print(gate.summary())
    print(load_line(before, load_average(), THREADS))


def run_quantized(sizes: Sizes, workdir: Path, kind: str) -> None:
    """The fp32 export against the ``kind`` weight-only one: sizes, weight bytes per token against the memory
    bandwidth, and new tokens/s at batch 1 and at batch ``sizes.batch``, the two files alternating."""
    from mha_deploy.bench import QuietGate
    from mha_deploy.bench.timing import load_average, load_line

    before = load_average()
    gate = QuietGate(wait_s=2.0, total_wait_s=20.0) if sizes is QUICK else QuietGate(wait_s=15.0, total_wait_s=240.0)
    paths = {"fp32": export(sizes, workdir), kind: export(sizes, workdir, kind)}
    print(f"model: tutorial_gpt.{sizes.factory}() d_model {sizes.d_model}, {sizes.heads} heads, {sizes.layers} "
          f"layers, vocabulary {sizes.vocab}, {sizes.positions} positions; {THREADS} threads, greedy", flush=True)
    gate.wait()  # a busy core halves what two threads read
    memory = read_bandwidth(THREADS)
    bandwidth = memory.gb_s
    read = {name: weight_bytes_per_token(path) for name, path in paths.items()}
    print(memory.line())
    for name, path in paths.items():
        print(f"  {name:<5} file {path.stat().st_size / 2**20:7.1f} MB; a decoded token reads "
              f"{read[name] / 2**20:6.1f} MB of weights: at most {bandwidth * 1e9 / read[name]:6.0f} tokens/s "
              "at batch 1")
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, sizes.vocab, (sizes.batch, sizes.prompt)).tolist()
    rates: dict[tuple[str, int], float] = {}
    for batch in (1, sizes.batch):
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(sizes.repeats):  # alternating, so that a noisy moment hits both
            for name, path in paths.items():
                gate.wait()
                request = {"model": str(path), "prompts": prompts[:batch], "new": sizes.new, "repeats": 1,
                           "threads": THREADS, "sizes": sizes.__dict__}
                seconds[name] += _probe("ours", request, workdir)["seconds"]
        for name in paths:
            rates[name, batch] = batch * sizes.new / float(np.median(seconds[name]))
    print(f"new tokens/s, prompts of {sizes.prompt}, {sizes.new} new tokens (runtime.generation; median of "
          f"{sizes.repeats} runs each, fresh processes):")
    for batch in (1, sizes.batch):
        line = "   ".join(f"{name} {rates[name, batch]:7.0f}" for name in paths)
        print(f"  batch {batch:>2}: {line}   {kind} / fp32 {rates[kind, batch] / rates['fp32', batch]:.2f}x; "
              f"{kind} at {rates[kind, batch] * read[kind] / 1e9 / bandwidth:.0%} of the bandwidth (batch-1 terms)")
    size_ratio = paths[kind].stat().st_size / paths["fp32"].stat().st_size
    print(f"file size {kind} / fp32: {size_ratio:.2f}; weight bytes per token {read[kind] / read['fp32']:.2f}")
    print(gate.summary())
    print(load_line(before, load_average(), THREADS))


def export(sizes: Sizes, workdir: Path, quantize: str = "none") -> Path:
    """The benchmark's GPT exported with --kv-cache (a pad id recorded, ``quantize`` as asked) and
    genai_config.json beside it."""
    sys.path.insert(0, str(REPOSITORY / "tests" / "user_models"))
    import tutorial_gpt

    from mha_deploy.exporters import export_model
    from mha_deploy.metadata import GenerationIds
    from mha_deploy.runtime.genai_config import write_genai_config

    # genai_config.json names model.onnx: a quantized file gets a folder of its own
    path = (workdir if quantize == "none" else workdir / quantize) / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = export_model(getattr(tutorial_gpt, sizes.factory)(), path, tutorial_gpt.INPUTS, kv_cache=True,
                          generation=GenerationIds([], PAD), quantize=quantize)
    write_genai_config(path, threads=THREADS)
    print(f"exported {quantize if quantize != 'none' else 'fp32'} in {time.perf_counter() - started:.0f} s: "
          f"{result.fusion.summary()}; cache layout "
          f"{result.metadata.cache_layout or 'holes'}; {result.parity.summary()}",
          flush=True)
    return path


def per_token_latency(path: Path, sizes: Sizes, gate) -> tuple[float, float]:
    """Median ms of one call with context - 1 cached positions and one new token, and of one call over the whole
    context with an empty cache, through one session."""
    from mha_deploy.bench.timing import time_blocks
    from mha_deploy.runtime import MHASession

    session = MHASession(path, provider="cpu", threads=THREADS)
    rng = np.random.default_rng(1)
    caches = list(session.signature.cache_pairs)
    _, heads, _, head_dim = session.signature.tensors[caches[0]].axes
    mask = np.ones((1, sizes.context), np.int64)

    def feeds(new: int) -> dict[str, np.ndarray]:
        past = sizes.context - new
        cache = {name: rng.standard_normal((1, heads, past, head_dim)).astype(np.float32) for name in caches}
        ids = {"input_ids": rng.integers(1, sizes.vocab, (1, new)), "attention_mask": mask, **cache}
        if "position_ids" in session.signature.tensors:  # the default export takes them (its ragged layout)
            ids["position_ids"] = np.arange(past, sizes.context)[None, :]
        return ids

    step, whole = feeds(1), feeds(sizes.context)
    timings = time_blocks({"cached": lambda: session.run(step), "recompute": lambda: session.run(whole)},
                          budget_s=6.0 if sizes is QUICK else 20.0, gate=gate)
    return timings["cached"].median_ms, timings["recompute"].median_ms


def _probe(name: str, request: dict, workdir: Path) -> dict:
    """One backend measured in a fresh process (this script with --probe), so that its peak RSS is its own."""
    return run_probe(sys.executable, __file__, name, request, workdir)


def _ours(request: dict) -> dict:
    """runtime.generation over the file: torch-free, as users run it."""
    seconds, out, stepper = time_our_decoding(request)
    # The cache as the last step left it (every row ran to the end, so none was freed).
    # A ragged file's cache is its buffers (sized once from prompt + new tokens), a holes file's the last present.
    cache_bytes = sum(array.nbytes for array in (stepper.buffers if stepper.ragged else stepper.past).values())
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "tokens": [t.tolist() for t in out.tokens],
            "cache_mb": cache_bytes / 2**20, "cache_positions": stepper.capacity}


def _transformers(request: dict) -> dict:
    """transformers' generate with its own cache on GPT-2 of the benchmark's sizes (sdpa, random weights)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(request["threads"])
    sizes = request["sizes"]
    config = GPT2Config(vocab_size=sizes["vocab"], n_embd=sizes["d_model"], n_head=sizes["heads"],
                        n_layer=sizes["layers"], n_positions=sizes["positions"], bos_token_id=PAD,
                        eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    seconds, _ = time_transformers_decoding(model, request, PAD, None)
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb()}


_PROBES = {"ours": _ours, "transformers": _transformers}


if __name__ == "__main__":
    main()
