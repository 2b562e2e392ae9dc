"""Hugging Face models, the target of issue 28: what the default export buys over ORT on the plain graph,
ONNX Runtime's own transformer optimizer and torch.

A script, not a test:

    .venv/bin/python benchmarks/hf_models.py                  # the target (see docs/own-model.md for its time)
    .venv/bin/python benchmarks/hf_models.py --quick --layers 1 --d-model 32 --heads 4 --ffn 64 --vocab 96
    .venv/bin/python benchmarks/hf_models.py --models gpt2 --shapes 8x128 --json figures.json

The models are Hugging Face's DistilBERT (``DistilBertModel``), GPT-2 (``GPT2LMHeadModel``) and BART
(``BartForConditionalGeneration``), built from configs with random weights as ``tests/user_models/hf_*.py``
build them (nothing is downloaded), at 6 layers (BART: 6 encoder + 6 decoder), d_model 512, 8 heads, FFN 2048,
a vocabulary of 32,000 (T5-small's and Marian's size at this width; GPT-2's and BART's own 50k would make the
LM head, which no fusion touches, an even larger share of the work) and 1024 positions (DistilBERT's config
says 512 by default: 1x1024 needs more). Each is exported with the inputs its test file declares, per row:

- ``ORT default``: ``export_model(module, path, INPUTS, max_length=positions)``, what ``mha-deploy export
  --module`` writes with its defaults;
- ``ORT plain``: the same with ``fuse="none"``, the project's plain ONNX graph (torch.onnx.export, dynamo);
- ``ORT optimizer``: ``onnxruntime.transformers.optimizer.optimize_model`` (model_type bert / gpt2 / bart,
  num_heads, hidden_size, its default opt_level) applied to that plain file; the ops it fused are recorded
  (where the model's own type fails, as "gpt2" does on ORT 1.31, "bert" instead, and the row says so);
- ``torch SDPA``: the exported module itself (``attn_implementation="sdpa"``, transformers' default);
- ``torch eager``: the same weights with ``attn_implementation="eager"``: the reference of every row's error.

All ORT rows run in ``MHASession`` on the CPU; ORT and torch use the same thread count. Inputs: random ids,
a quarter of every row's positions padded (the same count in every row, so that every row does equal work),
padded on the right for DistilBERT and BART (both the source and the target), on the left for GPT-2, as
batched generation pads its prompts (``--padding-side`` overrides; GPT-2 is given no position ids, as its test
file declares none, so its positions count from the first slot, padded or not: the same work either way).
BART runs BATCHxSEQ as SEQ source and SEQ target tokens. Timing, errors and rows are ``mha-deploy bench``'s
(``mha_deploy.bench.suite.bench_case``): blocks of every row interleave over several passes, medians; errors
on real query rows of the first output
(DistilBERT's hidden states, the logits of the others). The ORT MatMul rate of the same run
(``mha_deploy.bench.gemm``) is printed so that figures compare across hosts. A row whose export fails is
reported with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from mha_deploy.bench import BenchReport, MaskMode, QuietGate, parse_shapes
from mha_deploy.bench.backends import ort_file, torch_module
from mha_deploy.bench.gemm import GEMM_SIZES, peak_gemm_gflops
from mha_deploy.bench.suite import bench_case
from mha_deploy.bench.target import CPU_FP32
from mha_deploy.bench.timing import load_average, load_line
from mha_deploy.errors import first_line
from mha_deploy.exporters import export_model
from mha_deploy.exporters.own_model import declare_model, import_model_file

USER_MODELS = Path(__file__).resolve().parents[1] / "tests" / "user_models"
SIZES = {"layers": 6, "d_model": 512, "heads": 8, "ffn": 2048, "vocab": 32000, "max_positions": 1024}
SHAPES, QUICK_SHAPES = ((8, 128), (1, 1024)), ((2, 32), (1, 128))
PADDED_PCT = 25.0
DEFAULT, PLAIN, ORT_OPTIMIZER, SDPA, EAGER = "ORT default", "ORT plain", "ORT optimizer", "torch SDPA", "torch eager"
ROWS = (DEFAULT, PLAIN, ORT_OPTIMIZER, SDPA, EAGER)
# Targets (issue 28), per model and shape: the default export's throughput over each of these rows'.
TARGETS = {PLAIN: 1.3, SDPA: 1.2, ORT_OPTIMIZER: 1.0}
# ORT's optimizer ops worth naming: the attentions it fused, and what it fuses around them.
ORT_ATTENTIONS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")

# The test models' files, imported as `mha-deploy export --module` imports them: their declared inputs and
# their way of building a model from a config.
hf_models = import_model_file(USER_MODELS / "hf_models.py")
hf_encoder = import_model_file(USER_MODELS / "hf_encoder.py")
hf_gpt2 = import_model_file(USER_MODELS / "hf_gpt2.py")
hf_seq2seq = import_model_file(USER_MODELS / "hf_seq2seq.py")


def distilbert_config(layers, d_model, heads, ffn, vocab, max_positions):
    from transformers import DistilBertConfig

    return DistilBertConfig(vocab_size=vocab, dim=d_model, n_layers=layers, n_heads=heads, hidden_dim=ffn,
                            max_position_embeddings=max_positions, pad_token_id=hf_models.PAD_ID)


def gpt2_config(layers, d_model, heads, ffn, vocab, max_positions):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab, n_embd=d_model, n_layer=layers, n_head=heads, n_inner=ffn,
                      n_positions=max_positions, use_cache=False, bos_token_id=0, eos_token_id=0)


def bart_config(layers, d_model, heads, ffn, vocab, max_positions):
    from transformers import BartConfig

    return BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                      encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                      decoder_ffn_dim=ffn, max_position_embeddings=max_positions, pad_token_id=hf_models.PAD_ID,
                      bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, use_cache=False)


@dataclass(frozen=True)
class HFModel:
    label: str
    model_class: str  # in transformers
    config: Callable[..., object]  # sizes -> the model's config
    inputs: tuple[str, ...]  # declared as its test file declares them
    ort_model_type: str  # optimize_model's model_type
    padding_side: str  # where its batches are padded

    def build(self, sizes: dict, attn_implementation: str) -> torch.nn.Module:
        import transformers

        cls = getattr(transformers, self.model_class)
        return hf_models.from_config(cls, self.config(**sizes), attn_implementation, seed=0)


MODELS = {
    "distilbert": HFModel("DistilBERT", "DistilBertModel", distilbert_config, hf_encoder.INPUTS, "bert", "right"),
    "gpt2": HFModel("GPT-2", "GPT2LMHeadModel", gpt2_config, hf_gpt2.INPUTS, "gpt2", "left"),
    "bart": HFModel("BART", "BartForConditionalGeneration", bart_config, hf_seq2seq.INPUTS, "bart", "right"),
}


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


def export_rows(module, spec: HFModel, sizes: dict, workdir: Path) -> dict:
    """The three ORT files of one model: row -> {"path" | "error", "seconds", what was fused}."""
    exports = {}
    for row, options in ((DEFAULT, {}), (PLAIN, {"fuse": "none"})):
        started = time.perf_counter()
        try:
            result = export_model(module, workdir / f"{row.replace(' ', '-')}.onnx", spec.inputs,
                                  max_length=sizes["max_positions"], **options)
        except Exception as exc:  # a failed export is a row of the report, not the end of the run
            exports[row] = {"error": failure(exc), "seconds": time.perf_counter() - started}
        else:
            exports[row] = {"path": str(result.path), "seconds": time.perf_counter() - started,
                            "fusion": result.fusion.summary(), "warnings": list(result.warnings),
                            "packing": result.packing.describe() if result.packing else None}
        print(f"  exported {row} in {exports[row]['seconds']:.0f} s: {export_line(exports[row])}", flush=True)
    exports[ORT_OPTIMIZER] = ort_optimized(exports[PLAIN], spec, sizes, workdir)
    return exports


def export_line(export: dict) -> str:
    """What one export did: its fusion (and token packing), or why it failed."""
    if "error" in export:
        return f"FAILED: {export['error']}"
    return "; ".join(filter(None, (export["fusion"], export.get("packing"))))


def ort_optimized(plain: dict, spec: HFModel, sizes: dict, workdir: Path) -> dict:
    """ORT's transformer optimizer on the plain file, as its users call it; the ops it fused.

    When the model's own model_type fails, "bert" (the fusions every transformer type builds on: layer norms,
    GELU, embeddings) is tried next and the row says so: ORT 1.31's "gpt2" crashes on torch's dynamo export of
    GPT-2 (its postprocess takes every Gemm after a layer norm to have a bias; Conv1D's addmm exports as a
    bias-free Gemm and an Add).
    """
    if "path" not in plain:
        return {"error": f"no plain export to optimize ({plain['error']})", "seconds": 0.0}
    from onnxruntime.transformers.optimizer import optimize_model

    started = time.perf_counter()
    path = workdir / "ORT-optimizer.onnx"
    failed = []
    for model_type in dict.fromkeys((spec.ort_model_type, "bert")):
        try:
            optimized = optimize_model(plain["path"], model_type=model_type, num_heads=sizes["heads"],
                                       hidden_size=sizes["d_model"])
            optimized.save_model_to_file(str(path))
            break
        except Exception as exc:
            failed.append(f"model_type {model_type!r} failed: {failure(exc)}")
    else:
        return {"error": f"optimize_model: {'; '.join(failed)}", "seconds": time.perf_counter() - started}
    fused = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    ops = Counter(node.op_type for node in onnx.load(path, load_external_data=False).graph.node)
    attentions = sum(ops[op] for op in ORT_ATTENTIONS)
    summary = (f"optimize_model(model_type={model_type!r}): {attentions} attention(s) fused, "
               f"{ops['Softmax']} Softmax left; fused {', '.join(f'{op} {n}' for op, n in fused.items()) or 'nothing'}"
               + "".join(f"; {line}" for line in failed))
    print(f"  {summary} ({time.perf_counter() - started:.0f} s)", flush=True)
    return {"path": str(path), "seconds": time.perf_counter() - started, "fusion": summary, "model_type": model_type,
            "failed_model_types": failed, "fused_ops": fused, "attentions": attentions,
            "softmax_left": ops["Softmax"]}


def padded_inputs(signature, d_model: int, batch: int, seq: int, padding: MaskMode, side: str) -> dict:
    """The bench's inputs (``MaskMode.inputs``: the last quarter of every row padded), mirrored for left padding."""
    feeds = padding.inputs(d_model, batch, seq, signature=signature)
    if side == "left":
        for name in signature.padding_masks:
            feeds[name] = np.ascontiguousarray(feeds[name][:, ::-1])
    return feeds


def bench_model(name: str, spec: HFModel, sizes: dict, shapes, threads: int, budget_s: float, gate,
                padding: MaskMode, side: str, gemm: tuple[float, int], workdir: Path) -> dict:
    """One model: its exports, then every row that has a file (or a module) timed at every shape."""
    print(f"{spec.label}: building and exporting", flush=True)
    module = spec.build(sizes, "sdpa")
    eager = spec.build(sizes, "eager")
    eager.load_state_dict(module.state_dict())
    figures = {"model": spec.model_class, "padding_side": side, "exports": {}, "not_timed": {}, "shapes": []}
    try:
        # The module as the export declares it: the torch rows take the file's inputs as the file does.
        declared, declared_eager = declare_model(module, spec.inputs), declare_model(eager, spec.inputs)
    except Exception as exc:
        figures["error"] = f"the declared inputs fail: {failure(exc)}"
        return figures
    signature = declared.signature
    (workdir / name).mkdir()
    figures["exports"] = exports = export_rows(module, spec, sizes, workdir / name)
    backends = []
    for row in (DEFAULT, PLAIN, ORT_OPTIMIZER):
        if "path" not in exports[row]:
            figures["not_timed"][row] = exports[row]["error"]
            continue
        try:
            backends.append(ort_file(exports[row]["path"], CPU_FP32, threads, row))
        except Exception as exc:
            figures["not_timed"][row] = f"MHASession refuses the file: {failure(exc)}"
    backends += [torch_module(declared.wrapper, signature, SDPA),
                 torch_module(declared_eager.wrapper, signature, EAGER)]
    label = f"{side}-{padding.padded_pct:g}%"  # the padding, where the bench's rows name their mask mode
    report = BenchReport(sizes["d_model"], sizes["heads"], threads, "cpu", "fp32", *gemm, mask_modes=[label])
    for batch, seq in shapes:
        feeds = padded_inputs(signature, sizes["d_model"], batch, seq, padding, side)
        expected = {signature.output_names[0]: backends[-1].prepare(feeds)()}
        rows = bench_case(report, label, signature, backends, feeds, expected, batch, seq, budget_s, gate,
                          flops=None)
        report.rows += rows
        median = {row.backend: row.median_ms for row in rows}
        ratios = {f"default vs {row}": median[row] / median[DEFAULT]
                  for row in ROWS[1:] if DEFAULT in median and row in median}
        figures["shapes"].append({"batch": batch, "seq": seq, "ratios": ratios})
        print(f"  timed {batch}x{seq}", flush=True)
    figures["report"] = report.to_dict()
    figures["table"] = report.table()
    return figures


def ratio_lines(figures: dict) -> list[str]:
    """The default export's throughput over each row's, per model and shape, against the targets."""
    lines = ["default export's throughput over each row's (same shape, same run, medians; target in brackets):",
             f"{'model':<11} {'shape':<7} " + " ".join(f"{row + (f' (>={TARGETS[row]})' if row in TARGETS else ''):>22}"
                                                      for row in ROWS[1:])]
    quarter = figures["padded_pct"] == PADDED_PCT  # the targets are set for a quarter padded
    for name, model in figures["models"].items():
        for shape in model["shapes"]:
            label = f"{shape['batch']}x{shape['seq']}"
            if not shape["ratios"]:
                lines.append(f"{name:<11} {label:<7} {DEFAULT} not timed")
                continue
            cells = []
            for row in ROWS[1:]:
                ratio = shape["ratios"].get(f"default vs {row}")
                if ratio is None:
                    cells.append(f"{'not timed':>22}")
                    continue
                verdict = "" if row not in TARGETS or not quarter else " met" if ratio >= TARGETS[row] else " MISSED"
                cells.append(f"{f'{ratio:.2f}x{verdict}':>22}")
            lines.append(f"{name:<11} {label:<7} " + " ".join(cells))
        if not model["shapes"]:
            lines.append(f"{name:<11} not timed")
    for name, model in figures["models"].items():
        optimizer = model["exports"].get(ORT_OPTIMIZER, {})
        if optimizer.get("failed_model_types"):
            lines.append(f"{name}: {ORT_OPTIMIZER} is model_type {optimizer['model_type']!r} "
                         f"({'; '.join(optimizer['failed_model_types'])})")
    return lines


def report_lines(figures: dict) -> list[str]:
    sizes = figures["sizes"]
    lines = [
        "",
        f"models: {', '.join(m['model'] for m in figures['models'].values())}, {sizes['layers']} layers "
        f"(BART: {sizes['layers']}+{sizes['layers']}), d_model {sizes['d_model']}, {sizes['heads']} heads, "
        f"FFN {sizes['ffn']}, vocab {sizes['vocab']}, {sizes['max_positions']} positions, random weights",
        f"threads: {figures['threads']} (ORT intra-op and torch); ORT fp32 MatMul peak "
        f"{figures['gemm_gflops']:.0f} GFLOP/s (at {figures['gemm_size']}^3)",
        f"inputs: random ids, {figures['padding']}",
        f"rows: {DEFAULT} = export_model defaults (mha-deploy export --module); {PLAIN} = fuse='none'; "
        f"{ORT_OPTIMIZER} = onnxruntime.transformers optimize_model on {PLAIN}; {SDPA} = the exported module; "
        f"{EAGER} = attn_implementation='eager', same weights",
    ]
    for name, model in figures["models"].items():
        lines += ["", f"{name} ({model['model']}, {model['padding_side']} padding):"]
        if "error" in model:
            lines.append(f"  not exported, not timed: {model['error']}")
        for row in ROWS:
            export, reason = model["exports"].get(row), model["not_timed"].get(row)
            if export is not None:
                lines.append(f"  {row} ({export['seconds']:.0f} s): {export_line(export)}")
            if reason is not None and (export is None or "error" not in export):
                lines.append(f"  {row}: not timed: {reason}")
        if "table" in model:
            # The rows of its report, without the header lines the run's own above already say.
            table = model["table"].splitlines()
            start = next(i for i, line in enumerate(table) if line.startswith("mask"))
            lines += ["  " + line for line in table[start:table.index("", start)]]
    lines += ["", *ratio_lines(figures), "", figures["load"]]
    if figures["quiet"]:
        lines.append(figures["quiet"])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke test: shapes {QUICK_SHAPES}, tiny budgets")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--shapes", help="BATCHxSEQ list (default 8x128,1x1024)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads and torch threads")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--budget-s", type=float, help="timing budget per row and shape (default 8, quick 0.2)")
    parser.add_argument("--padded-pct", type=float, default=PADDED_PCT,
                        help=f"PCT%% of every row's positions padded ({PADDED_PCT:g}; 0: nothing padded)")
    parser.add_argument("--padding-side", choices=("model", "right", "left"), default="model",
                        help="where the padding goes (model: right, GPT-2 left as generation pads prompts)")
    parser.add_argument("--gemm-sizes", help="square MatMul sizes of the yardstick (default 512,...,4096; quick 256)")
    for name, default in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"model size ({default})")
    args = parser.parse_args()
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    if unknown := [name for name in names if name not in MODELS]:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    sizes = {name: getattr(args, name) for name in SIZES}
    shapes = parse_shapes(args.shapes) if args.shapes else QUICK_SHAPES if args.quick else SHAPES
    budget_s = args.budget_s or (0.2 if args.quick else 8.0)
    gemm_sizes = tuple(int(n) for n in args.gemm_sizes.split(",")) if args.gemm_sizes else (
        (256,) if args.quick else GEMM_SIZES)
    gate = None if args.quick else QuietGate(wait_s=10.0, total_wait_s=180.0)
    torch.set_num_threads(args.threads)
    padding = MaskMode("padding", args.padded_pct)
    load_before = load_average()
    started = time.perf_counter()

    gemm = peak_gemm_gflops(args.threads, CPU_FP32, gemm_sizes)
    models = {}
    with tempfile.TemporaryDirectory(prefix="mha-hf-bench-") as tmp:
        for name in names:
            spec = MODELS[name]
            side = spec.padding_side if args.padding_side == "model" else args.padding_side
            models[name] = bench_model(name, spec, sizes, shapes, args.threads, budget_s, gate, padding, side, gemm,
                                       Path(tmp))
    figures = {
        "sizes": sizes, "threads": args.threads, "padded_pct": args.padded_pct,
        "padding": f"{args.padded_pct:g}% of every row's positions padded "
                   f"({'per model' if args.padding_side == 'model' else args.padding_side})",
        "gemm_gflops": gemm[0], "gemm_size": gemm[1], "targets": TARGETS, "models": models,
        "seconds": time.perf_counter() - started,
        "load": load_line(load_before, load_average(), args.threads), "quiet": gate.summary() if gate else "",
    }
    print("\n".join(report_lines(figures)))
    print(f"run took {figures['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
