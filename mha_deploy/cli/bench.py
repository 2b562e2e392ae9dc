"""``mha-deploy bench``: torch, ORT and OpenVINO per mask mode, in one run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mha_deploy.cli.builtin import load_model
from mha_deploy.cli.group import main
from mha_deploy.cli.options import model_options, session_options
from mha_deploy.metadata import MASK_MODES


@main.command()
@click.argument("model", type=click.Path(path_type=Path), required=False)
@model_options
@click.option("--mask", "masks", multiple=True,
              help=f"Mask mode(s) to bench, repeatable or comma-separated: {', '.join(MASK_MODES)}; a padding "
                   "mode keeps every key real unless suffixed with the share of keys to pad, e.g. padding-25%. "
                   "Default: none and causal; with MODEL, the file's own mask mode.")
@click.option("--shapes", default="8x128,1x1024,32x64,1x4096", show_default=True, help="BATCHxSEQ,...")
@session_options(provider="cpu", threads=2)
@click.option("--budget-s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Timing budget per backend and shape.")
# bench.cases.DEFAULT_MEMORY_SHAPES (not imported: the bench package loads torch).
@click.option("--memory-shapes", default="1x1024", show_default=True,
              help="Shapes at which peak RSS of each ORT path is measured (in fresh processes, a few seconds each); "
                   "'' to skip.")
@click.option("--gemm-sizes", default="512,1024,2048,4096", show_default=True,
              help="Square MatMul sizes tried for the efficiency yardstick (ORT's best rate over them; for "
                   "int8-dynamic rows its int8 MatMulInteger rate).")
@click.option("--quiet-wait-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Before each timed block, wait up to this long for other processes to leave the CPUs "
                   "(0: do not wait).")
@click.option("--openvino/--no-openvino", default=None,
              help="Add OpenVINO (CPU plugin, fp32) on the unfused graph; default: when the 'openvino' extra is "
                   "installed.")
@click.option("--module", "module_spec", metavar="FILE.py:FACTORY",
              help="With MODEL exported from your own model (export --module): the same module in torch eager, "
                   "the baseline and reference of the rows (--checkpoint loads its state dict).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a plot of time per token, one panel per mask mode (PNG).")
def bench(model, checkpoint, prefix, d_model, heads, masks, shapes, provider, threads, budget_s, memory_shapes,
          gemm_sizes, quiet_wait_s, openvino, module_spec, as_json, plot):
    """Compare torch eager, torch SDPA, ORT unfused, ORT fused per target and int8-dynamic, and OpenVINO, per mask mode,
    in one run.

    Reports median and p90 latency, GFLOP/s, the ratio to torch eager,
    efficiency against ORT's own MatMul rate measured in the same run (int8-dynamic
    rows: its int8 MatMulInteger rate), and each
    row's error against the torch eager reference on the same inputs (max abs
    err, relative err). MODEL, an exported self-attention .onnx file, is added
    as one more row in the mask modes it matches; its d_model, heads and mask
    mode are read from it, and its error is against the --checkpoint (or the
    seed-0 random model) of that size. With --provider cuda, torch and ORT both
    run on the GPU in fp16, what one deploys there.

    \b
    Example:
      mha-deploy bench --mask none --mask padding-25% --shapes 8x128,1x1024 --threads 2 --plot bench.png
    """
    from mha_deploy.bench import (
        DEFAULT_MASK_MODES,
        QuietGate,
        parse_mask_modes,
        parse_shapes,
        parse_sizes,
        resolve_target,
        run_bench,
        settings_from_file,
    )
    from mha_deploy.errors import OptionError

    if model is not None and _is_own_model(model):
        _bench_own_model(model, module_spec, checkpoint, masks, shapes, provider, threads, budget_s, gemm_sizes,
                         quiet_wait_s, as_json)
        return
    if module_spec is not None:
        raise click.UsageError("--module benches a MODEL exported from your own model (export --module)")
    try:
        modes = parse_mask_modes(masks) if masks else None
        if model is not None:
            d_model, heads, modes = settings_from_file(model, d_model, heads, modes)
        modes = modes or parse_mask_modes(DEFAULT_MASK_MODES)
        shape_list = parse_shapes(shapes)
        memory_list = parse_shapes(memory_shapes) if memory_shapes else ()
        gemm_list = parse_sizes(gemm_sizes)
    except OptionError as exc:
        raise click.UsageError(str(exc)) from None
    target = resolve_target(provider)  # before any export: --provider cuda fails here if it cannot run
    if target.note:
        click.echo(f"note: {target.note}", err=True)
    mha = load_model(checkpoint, d_model, heads, seed=0, prefix=prefix)
    click.echo(f"exporting the compared models for mask modes {', '.join(m.label for m in modes)}...", err=True)
    report = run_bench(
        mha, modes, shape_list, target=target, threads=threads, budget_s=budget_s,
        models=[model] if model is not None else (), memory_shapes=memory_list, gemm_sizes=gemm_list,
        openvino=openvino, gate=QuietGate(wait_s=quiet_wait_s) if quiet_wait_s > 0 else None,
        on_row=lambda r: click.echo(
            f"  {r.mask} {r.batch}x{r.seq} {r.backend}: {r.median_ms:.2f} ms, max abs err "
            + (f"{r.max_abs_err:.1e}" if r.max_abs_err is not None else "-"),
            err=True,
        ),
    )
    if plot:
        from mha_deploy.bench.plot import plot_latency

        plot_latency(report, plot)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.table())


def _is_own_model(path: Path) -> bool:
    from mha_deploy.model_report import read_metadata

    return path.is_file() and read_metadata(path).signature.model == "custom"


def _bench_own_model(model, module_spec, checkpoint, masks, shapes, provider, threads, budget_s, gemm_sizes,
                     quiet_wait_s, as_json):
    """``bench MODEL`` for a file exported from the user's own model: the file, and the module when given."""
    from mha_deploy.bench import QuietGate, parse_mask_modes, parse_shapes, parse_sizes, resolve_target, run_model_bench
    from mha_deploy.errors import OptionError

    try:
        modes = parse_mask_modes(masks) if masks else ()
        if len(modes) > 1:
            raise OptionError("your own model has one mask mode: give one --mask (e.g. padding-25%) or none")
        shape_list, gemm_list = parse_shapes(shapes), parse_sizes(gemm_sizes)
    except OptionError as exc:
        raise click.UsageError(str(exc)) from None
    module = None
    if module_spec is not None:
        from mha_deploy.exporters import load_factory
        from mha_deploy.exporters.own_model import load_checkpoint

        module = load_factory(module_spec)
        if checkpoint is not None:
            load_checkpoint(module, checkpoint)
    target = resolve_target(provider)
    report = run_model_bench(
        model, shape_list, padded_pct=modes[0].padded_pct if modes else 0.0, module=module, target=target,
        threads=threads, budget_s=budget_s, gemm_sizes=gemm_list,
        gate=QuietGate(wait_s=quiet_wait_s) if quiet_wait_s > 0 else None,
    )
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.table())
