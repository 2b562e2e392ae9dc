"""When token packing pays: a user's classifier exported packed and unpacked, per width, one run.

A script, not a test:

    .venv/bin/python benchmarks/token_packing.py                 # d_model 64, 128, 256, 512: ~3 min
    .venv/bin/python benchmarks/token_packing.py --widths 256 --json packing.json
    .venv/bin/python benchmarks/token_packing.py --model encoder --widths 512 --layers 6

The model is the classifier of ``tests/user_models/classifier.py`` (pre-norm blocks, d_ff 4 x d_model, d_model / 64
heads) at ``--layers`` layers, or with ``--model encoder`` the built-in encoder stack (post-norm, the same sizes,
float inputs). Each width is exported twice with ``fuse="auto"``: packed whatever its size
(``MIN_WORK_PER_COPIED_ELEMENT`` set to 0 for the export) and ``pack_tokens=False``; both run by ``MHASession``
on the CPU, interleaved, on right-padded batches (the last quarter of every row) and unpadded ones. It prints
packed over unpacked per width and shape, with each width's multiply-adds per copied element (what the
export's bound ``MIN_WORK_PER_COPIED_ELEMENT`` is compared with) and the run's ORT MatMul rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from mha_deploy.bench import MaskMode, parse_shapes
from mha_deploy.bench.backends import ort_file
from mha_deploy.bench.gemm import GEMM_SIZES, peak_gemm_gflops
from mha_deploy.bench.target import CPU_FP32
from mha_deploy.bench.timing import load_average, time_blocks
from mha_deploy.exporters import export_builtin, export_model, token_packing
from mha_deploy.exporters.own_model import import_model_file
from mha_deploy.models.build import random_stack
from mha_deploy.signature import Signature

CLASSIFIER_FILE = Path(__file__).resolve().parents[1] / "tests" / "user_models" / "classifier.py"
WIDTHS = (64, 128, 256, 512)
SHAPES = ((8, 128), (1, 512))
PADDINGS = (MaskMode("padding", 25.0), MaskMode("padding", 0.0))


def export_pair(kind: str, d_model: int, layers: int, workdir: Path) -> dict:
    """The model at ``d_model`` exported packed (whatever its size) and unpacked: name -> ExportResult."""
    heads = max(d_model // 64, 1)
    if kind == "encoder":
        model = random_stack("encoder", layers, d_model, heads, 4 * d_model, 0)
        signature = Signature("self", "padding", model="encoder")

        def export(path, **options):
            return export_builtin(model, path, signature, **options)
    else:
        classifier = import_model_file(CLASSIFIER_FILE)  # as `mha-deploy export --module` imports it
        torch.manual_seed(0)
        model = classifier.TextClassifier(1000, d_model, heads, layers, num_classes=3, max_len=1024).eval()

        def export(path, **options):
            return export_model(model, path, classifier.INPUTS, max_length=1024, **options)
    bound = token_packing.MIN_WORK_PER_COPIED_ELEMENT
    token_packing.MIN_WORK_PER_COPIED_ELEMENT = 0
    try:
        packed = export(workdir / f"packed-{d_model}.onnx")
    finally:
        token_packing.MIN_WORK_PER_COPIED_ELEMENT = bound
    return {"packed": packed, "unpacked": export(workdir / f"unpacked-{d_model}.onnx", pack_tokens=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("classifier", "encoder"), default="classifier",
                        help="tests/user_models' classifier, or the built-in encoder stack (classifier)")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="d_model list (default 64,128,256,512)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (2)")
    parser.add_argument("--shapes", default="8x128,1x512", help="BATCHxSEQ list (default 8x128,1x512)")
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (2)")
    parser.add_argument("--budget-s", type=float, default=3.0, help="timing budget per row and case (3)")
    parser.add_argument("--gemm-sizes", default=",".join(map(str, GEMM_SIZES)),
                        help="square MatMul sizes of the yardstick (default 512,...,4096; a smoke test: 256)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    widths = [int(width) for width in args.widths.split(",")]
    shapes = parse_shapes(args.shapes)
    load_before = load_average()
    gemm_sizes = tuple(int(n) for n in args.gemm_sizes.split(","))
    gemm_gflops, gemm_size = peak_gemm_gflops(args.threads, CPU_FP32, gemm_sizes)
    figures = {"model": args.model, "layers": args.layers, "threads": args.threads, "gemm_gflops": gemm_gflops,
               "rows": []}
    model = "classifier of tests/user_models" if args.model == "classifier" else "built-in encoder stack"
    print(f"{model}, {args.layers} layers, d_ff 4 x d_model; {args.threads} threads; "
          f"ORT fp32 MatMul peak {gemm_gflops:.0f} GFLOP/s (at {gemm_size}^3)")
    print(f"{'d_model':>7} {'MACs/copied':>11} {'shape':>7} {'padded':>6} {'packed ms':>10} {'unpacked ms':>12} "
          f"{'packed over unpacked':>21}")
    with tempfile.TemporaryDirectory(prefix="mha-token-packing-") as tmp:
        for d_model in widths:
            exports = export_pair(args.model, d_model, args.layers, Path(tmp))
            packing = exports["packed"].packing
            ratio = round(packing.work_per_copied)
            signature = exports["packed"].metadata.signature
            backends = [ort_file(result.path, CPU_FP32, args.threads, name) for name, result in exports.items()]
            for batch, seq in shapes:
                for padding in PADDINGS:
                    feeds = padding.inputs(d_model, batch, seq, signature=signature)
                    runs = {backend.name: backend.prepare(feeds) for backend in backends}
                    timings = time_blocks(runs, args.budget_s, passes=3)
                    packed, unpacked = timings["packed"].median_ms, timings["unpacked"].median_ms
                    row = {"d_model": d_model, "macs_per_copied_element": ratio, "batch": batch, "seq": seq,
                           "padded_pct": padding.padded_pct, "packed_ms": packed, "unpacked_ms": unpacked,
                           "speedup": unpacked / packed, "packing": packing.describe()}
                    figures["rows"].append(row)
                    print(f"{d_model:7d} {ratio:11d} {batch:>3}x{seq:<4} {padding.padded_pct:5.0f}% {packed:10.2f} "
                          f"{unpacked:12.2f} {unpacked / packed:20.2f}x", flush=True)
    after = load_average()
    if load_before is not None and after is not None:
        print(f"load average {load_before[0]:.2f} before, {after[0]:.2f} after (1 min)")
    print(f"the export packs a run when its MACs per copied element are >= "
          f"{token_packing.MIN_WORK_PER_COPIED_ELEMENT}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
