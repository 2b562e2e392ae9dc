"""Your own model, the target of issue 21: a user's classifier exported and fused, against ORT unfused and torch.

A script, not a test:

    .venv/bin/python benchmarks/own_model.py            # the target: ~3 min on 2 quiet cores, ~12 when shared
    .venv/bin/python benchmarks/own_model.py --quick    # small shapes and budgets: a smoke test
    .venv/bin/python benchmarks/own_model.py --json figures.json --threads 2

The model is the classifier of ``tests/user_models/classifier.py`` (token ids, learned positions, pre-norm
blocks around the reference attention with ``masked_fill(mask == 0, -1e9)``, masked mean pooling, a linear
head) at 6 layers, d_model 512, 8 heads, d_ff 2048. It is exported as users export it,
``export_model(module, path, inputs=INPUTS, ...)``, three times: ``fuse="auto"`` (what users get),
the same with ``pack_tokens=False`` (the attention fusion alone, every token through every layer) and
``fuse="none"`` (the plain ONNX graph), all run by ``MHASession`` on the CPU. torch runs a copy whose
attention calls ``F.scaled_dot_product_attention`` with the same boolean mask (True = attend), same weights,
and the original module for reference. ORT and torch use the same thread count.

Inputs: random ids, right padding, the last quarter of every row's positions padded (the same in every row,
so that every row does equal work). Throughput counts the real (unpadded) tokens. Timed blocks of every
row interleave over several passes (``mha_deploy.bench.timing``); medians. Memory: the peak RSS that one
run adds, each measurement in a fresh process, one at a time (``mha_deploy.bench.memory``). The ORT MatMul
rate of the same run (``mha_deploy.bench.gemm``) is printed so that figures compare across hosts.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F

from mha_deploy.bench import MaskMode, QuietGate, parse_shapes
from mha_deploy.bench.backends import ort_file, torch_module
from mha_deploy.bench.gemm import GEMM_SIZES, peak_gemm_gflops
from mha_deploy.bench.memory import measure_module_peak_rss, measure_peak_rss
from mha_deploy.bench.target import CPU_FP32
from mha_deploy.bench.timing import load_average, load_line, time_blocks
from mha_deploy.compare import compare_outputs
from mha_deploy.exporters import export_model
from mha_deploy.exporters.own_model import import_model_file
from mha_deploy.exporters.parity import DEFAULT_ATOL, DEFAULT_RTOL

CLASSIFIER_FILE = Path(__file__).resolve().parents[1] / "tests" / "user_models" / "classifier.py"
SIZES = {"d_model": 512, "heads": 8, "layers": 6, "vocab": 8000, "max_len": 4096}
SHAPES, QUICK_SHAPES = ((8, 128), (1, 1024)), ((2, 32), (1, 128))
MEMORY_SHAPE, QUICK_MEMORY_SHAPE = (2, 4096), (1, 256)
PADDED_PCT = 25.0  # right padding: the last quarter of every row
# Targets (issue 21), per shape: the fused export's throughput over each of these rows'.
TARGETS = {"ORT plain": 1.3, "torch SDPA": 1.0}
FUSED, UNPACKED, PLAIN, SDPA = "ORT fused", "ORT unpacked", "ORT plain", "torch SDPA"
EAGER = "torch eager"
COMPARED = (UNPACKED, PLAIN, SDPA, EAGER)


# The user's model file, imported by path as `mha-deploy export --module` imports it.
classifier = import_model_file(CLASSIFIER_FILE)


class SDPAAttention(classifier.MultiHeadAttention):
    """The user's attention, its softmax(QK^T/sqrt(d_k)) masked_fill(mask == 0) replaced by torch's SDPA.

    ``mask`` is the classifier's [batch, 1, 1, seq] bool view of its padding input: True = attend, which is
    what SDPA's boolean ``attn_mask`` means too. SDPA's default scale is 1/sqrt(d_k).
    """

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        q = self.W_q(q).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = self.W_k(k).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = self.W_v(v).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.bool())
        return self.W_o(out.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.d_k))


def build(d_model=512, heads=8, layers=6, vocab=8000, max_len=4096):
    """The classifier at the given size, d_ff = 4 x d_model, seeded weights, in eval mode."""
    torch.manual_seed(0)
    return classifier.TextClassifier(vocab, d_model, heads, layers, num_classes=3, max_len=max_len).eval()


def with_sdpa(model):
    """A copy of ``model`` (same weights) whose attentions call ``F.scaled_dot_product_attention``."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        attention = SDPAAttention(block.attn.num_heads * block.attn.d_k, block.attn.num_heads)
        attention.load_state_dict(block.attn.state_dict())
        block.attn = attention
    return model.eval()


def build_sdpa(**sizes):
    return with_sdpa(build(**sizes))


def export_all(model, workdir: Path, max_len: int) -> dict:
    """The exports of ``model``: fuse='auto' (what users get), the same without token packing, and
    fuse='none': name -> (ExportResult, seconds)."""
    exports = {}
    for name, options in ((FUSED, {"fuse": "auto"}), (UNPACKED, {"fuse": "auto", "pack_tokens": False}),
                          (PLAIN, {"fuse": "none"})):
        started = time.perf_counter()
        result = export_model(model, workdir / f"{name.replace(' ', '-')}.onnx", classifier.INPUTS,
                              max_length=max_len, **options)
        exports[name] = (result, time.perf_counter() - started)
        packing = f"; {result.packing.describe()}" if result.packing else ""
        print(f"exported {name} ({options}) in {exports[name][1]:.0f} s: {result.fusion.summary()}{packing}",
              flush=True)
        for warning in result.warnings:
            print(f"  warning: {warning}", flush=True)
    return exports


def bench_shape(backends, signature, d_model, batch, seq, budget_s, passes, gate, padding: MaskMode) -> dict:
    """Every backend checked against torch eager on one padded batch, then timed in interleaved blocks."""
    feeds = padding.inputs(d_model, batch, seq, signature=signature)
    real_tokens = int(sum(feeds[name].sum() for name in signature.padding_masks))
    runs = {backend.name: backend.prepare(feeds) for backend in backends}
    expected = {"output": runs[EAGER]()}
    errors = {}
    for name, run in runs.items():
        comparison = compare_outputs(signature, {"output": run()}, expected, names=("output",),
                                     atol=DEFAULT_ATOL, rtol=DEFAULT_RTOL)[0]
        errors[name] = {"max_abs_err": comparison.max_abs_err, "within_parity_tolerance": comparison.passed}
    timings = time_blocks(runs, budget_s, passes=passes, gate=gate)
    rows = {
        name: {
            "median_ms": t.median_ms, "p90_ms": t.p90_ms, "best_ms": t.best_ms, "runs": t.runs,
            "tokens_per_s": real_tokens / (t.median_ms * 1e-3), **errors[name],
        }
        for name, t in timings.items()
    }
    ratios = {f"fused vs {name}": rows[name]["median_ms"] / rows[FUSED]["median_ms"] for name in COMPARED}
    best_ratios = {f"fused vs {name}": rows[name]["best_ms"] / rows[FUSED]["best_ms"] for name in COMPARED}
    return {"batch": batch, "seq": seq, "tokens": batch * seq, "real_tokens": real_tokens, "rows": rows,
            "ratios": ratios, "best_call_ratios": best_ratios}


def measure_memory(exports, sizes: dict, checkpoint: Path, batch: int, seq: int, threads: int,
                   padding: MaskMode) -> list[dict]:
    """Peak RSS added by one run of each row, each in its own fresh process, one after the other."""
    rows = []
    for name in (FUSED, UNPACKED, PLAIN):
        result = exports[name][0]
        rows.append(measure_peak_rss(result.path, name, batch, seq, threads, arena=True,
                                     padded_pct=padding.padded_pct))
        print(f"  memory {name} done", flush=True)
    metadata = exports[FUSED][0].metadata
    for name, factory in ((SDPA, "build_sdpa"), (EAGER, "build")):
        rows.append(measure_module_peak_rss(f"{Path(__file__).resolve()}:{factory}", sizes, checkpoint, metadata,
                                            name, batch, seq, threads, padding.padded_pct))
        print(f"  memory {name} done", flush=True)
    return [asdict(row) for row in rows]


def report_lines(figures: dict) -> list[str]:
    sizes = figures["sizes"]
    lines = [
        "",
        f"model: tests/user_models/classifier.py TextClassifier, {sizes['layers']} pre-norm layers, d_model "
        f"{sizes['d_model']}, {sizes['heads']} heads, d_ff {4 * sizes['d_model']}, vocab {sizes['vocab']}, "
        f"positions {sizes['max_len']}",
        f"threads: {figures['threads']} (ORT intra-op and torch); ORT fp32 MatMul peak "
        f"{figures['gemm_gflops']:.0f} GFLOP/s (at {figures['gemm_size']}^3)",
        f"inputs: random ids, right padding, {figures['padding']}; tokens/s counts real tokens",
        f"rows: {FUSED} = export_model(fuse='auto'), what users get; {UNPACKED} = the same with "
        "pack_tokens=False; ORT plain = fuse='none'",
        "",
        f"{'shape':<8} {'row':<12} {'median ms':>10} {'p90 ms':>9} {'best ms':>9} {'tokens/s':>10} "
        f"{'max abs err':>12}  parity",
    ]
    for shape in figures["shapes"]:
        for name, row in shape["rows"].items():
            lines.append(
                f"{shape['batch']}x{shape['seq']:<6} {name:<12} {row['median_ms']:10.1f} {row['p90_ms']:9.1f} "
                f"{row['best_ms']:9.1f} {row['tokens_per_s']:10.0f} {row['max_abs_err']:12.1e}  "
                f"{'ok' if row['within_parity_tolerance'] else 'DIFFERS'}"
            )
    lines += ["", "fused throughput over each row's (same shape, same run; tokens/s and targets on medians):"]
    for shape in figures["shapes"]:
        label = f"{shape['batch']}x{shape['seq']}"
        parts = []
        for name in COMPARED:
            ratio = shape["ratios"][f"fused vs {name}"]
            target = TARGETS.get(name) if figures["padded_pct"] == PADDED_PCT else None  # set for a quarter padded
            verdict = "" if target is None else f" (target >= {target}x: {'met' if ratio >= target else 'MISSED'})"
            parts.append(f"vs {name} {ratio:.2f}x{verdict}")
        lines.append(f"  {label}: " + "; ".join(parts))
        best = [f"vs {name} {shape['best_call_ratios'][f'fused vs {name}']:.2f}x" for name in COMPARED]
        lines.append(f"  {' ' * len(label)}  fastest calls: {'; '.join(best)}")
    if figures["memory"]:
        lines += ["", f"memory, one run, right padding, {figures['padding']}, fresh process each (ORT with its CPU "
                  "arena):",
                  f"{'shape':<8} {'row':<12} {'peak RSS MB':>11} {'added by run MB':>16}"]
        for m in figures["memory"]:
            lines.append(f"{m['batch']}x{m['seq']:<6} {m['backend']:<12} {m['peak_rss_mb']:11.0f} {m['run_mb']:16.0f}")
    lines += ["", figures["load"]]
    if figures["quiet"]:
        lines.append(figures["quiet"])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: shapes {QUICK_SHAPES}, memory at {QUICK_MEMORY_SHAPE}, tiny budgets")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads and torch threads")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--shapes", help="BATCHxSEQ list (default 8x128,1x1024)")
    parser.add_argument("--memory-shape", help="BATCHxSEQ of the memory runs (default 2x4096; '' skips them)")
    parser.add_argument("--budget-s", type=float, help="timing budget per row and shape (default 8, quick 0.2)")
    parser.add_argument("--passes", type=int, help="interleaved timed passes over every row (default 5, quick 2)")
    parser.add_argument("--padded-pct", type=float, default=PADDED_PCT,
                        help=f"the last PCT%% of every row padded ({PADDED_PCT:g}; 0: nothing padded)")
    for name, default in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"model size ({default})")
    args = parser.parse_args()
    sizes = {name: getattr(args, name) for name in SIZES}
    shapes = parse_shapes(args.shapes) if args.shapes else QUICK_SHAPES if args.quick else SHAPES
    if args.memory_shape is not None:
        memory_shape = parse_shapes(args.memory_shape)[0] if args.memory_shape else None
    else:
        memory_shape = QUICK_MEMORY_SHAPE if args.quick else MEMORY_SHAPE
    budget_s = args.budget_s or (0.2 if args.quick else 8.0)
    passes = args.passes or (2 if args.quick else 5)
    gate = None if args.quick else QuietGate(wait_s=10.0, total_wait_s=180.0)
    torch.set_num_threads(args.threads)
    padding = MaskMode("padding", args.padded_pct)
    load_before = load_average()

    model = build(**sizes)
    with tempfile.TemporaryDirectory(prefix="mha-own-model-bench-") as tmp:
        workdir = Path(tmp)
        exports = export_all(model, workdir, sizes["max_len"])
        signature = exports[FUSED][0].metadata.signature
        gemm_gflops, gemm_size = peak_gemm_gflops(args.threads, CPU_FP32, (256,) if args.quick else GEMM_SIZES)
        backends = [*(ort_file(exports[name][0].path, CPU_FP32, args.threads, name)
                      for name in (FUSED, UNPACKED, PLAIN)),
                    torch_module(with_sdpa(model), signature, SDPA), torch_module(model, signature, EAGER)]
        results = []
        for batch, seq in shapes:
            results.append(bench_shape(backends, signature, sizes["d_model"], batch, seq, budget_s, passes, gate,
                                       padding))
            print(f"  timed {batch}x{seq}", flush=True)
        del backends  # the sessions' memory, before the memory runs start their own processes
        memory = []
        if memory_shape is not None:
            checkpoint = workdir / "classifier.safetensors"
            safetensors.torch.save_file(model.state_dict(), checkpoint)
            memory = measure_memory(exports, sizes, checkpoint, *memory_shape, args.threads, padding)
    figures = {
        "sizes": sizes, "threads": args.threads, "padding": f"the last {args.padded_pct:g}% of every row padded",
        "padded_pct": args.padded_pct,
        "gemm_gflops": gemm_gflops, "gemm_size": gemm_size, "targets": TARGETS,
        "exports": {name: {"fusion": result.fusion.summary(), "seconds": seconds, "warnings": result.warnings,
                           "packing": result.packing.describe() if result.packing else None}
                    for name, (result, seconds) in exports.items()},
        "shapes": results, "memory": memory,
        "load": load_line(load_before, load_average(), args.threads), "quiet": gate.summary() if gate else "",
    }
    print("\n".join(report_lines(figures)))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
