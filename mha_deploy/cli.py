"""``mha-deploy``: a thin Click layer over the library.

Heavy modules (torch, onnxruntime) are imported inside the commands that need
them, so ``--help`` is instant and serving commands never load torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mha_deploy import __version__
from mha_deploy.errors import MHADeployError
from mha_deploy.metadata import ATTENTION_KINDS, MASK_MODES

PROVIDERS = ("auto", "cpu", "cuda")
DEFAULT_D_MODEL, DEFAULT_HEADS = 512, 8


class _Group(click.Group):
    """Turns errors into one line on stderr (a traceback only with ``--debug``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if isinstance(exc, MHADeployError):
                click.echo(f"error: {exc}", err=True)
            else:
                click.echo(f"error: unexpected {type(exc).__name__}: {exc} (rerun with --debug for details)", err=True)
            ctx.exit(1)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(__version__, prog_name="mha-deploy")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export the reference multi-head attention to ONNX and run it with ONNX Runtime.

    \b
    mha-deploy export -o mha.onnx
    mha-deploy infer mha.onnx --input items.npz --output out.npz
    mha-deploy inspect mha.onnx
    """
    ctx.ensure_object(dict)["debug"] = debug


@main.command()
@click.option("--checkpoint", type=click.Path(dir_okay=False, path_type=Path),
              help="State dict (.safetensors, .pt, .pth) in any common naming; omit for a seeded random model.")
@click.option("--d-model", type=int, help=f"Model width (default {DEFAULT_D_MODEL}; read from the checkpoint).")
@click.option("--heads", type=int, help=f"Number of heads (default {DEFAULT_HEADS}, or the checkpoint's metadata).")
@click.option("--attention", type=click.Choice(ATTENTION_KINDS), default="self", show_default=True)
@click.option("--mask", type=click.Choice(MASK_MODES), default="none", show_default=True,
              help="padding adds input key_padding_mask (bool, True = real token); causal is built into the graph.")
@click.option("--return-weights", is_flag=True, help="Also output attn_weights [batch, heads, q_seq, kv_seq].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random-init model.")
@click.option("--opset", type=int, default=23, show_default=True)
@click.option("--atol", type=float, default=1e-5, show_default=True, help="Parity tolerance (absolute).")
@click.option("--rtol", type=float, default=1e-4, show_default=True, help="Parity tolerance (relative).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the .onnx file (written only if parity passes).")
def export(checkpoint, d_model, heads, attention, mask, return_weights, seed, opset, atol, rtol, output):
    """Export a reference MHA to ONNX with dynamic batch and sequence axes, checked against torch.

    \b
    Examples:
      mha-deploy export -o mha.onnx
      mha-deploy export --attention cross --mask padding -o cross.onnx
      mha-deploy export --checkpoint attn.safetensors --heads 8 --mask padding-causal -o mha.onnx
    """
    from mha_deploy.exporters import export_mha
    from mha_deploy.metadata import Signature

    signature = Signature(attention, mask, return_weights)
    mha = _load_model(checkpoint, d_model, heads, seed)
    click.echo(f"exporting d_model={mha.d_model} heads={mha.num_heads} attention={attention} mask={mask}", err=True)
    result = export_mha(mha, output, signature, opset=opset, atol=atol, rtol=rtol)
    click.echo(result.parity.summary())
    click.echo(f"wrote {result.path}")


def _load_model(checkpoint, d_model, heads, seed):
    import torch

    from mha_deploy.models import MultiHeadAttention, load_checkpoint

    if checkpoint is None:
        torch.manual_seed(seed)
        return MultiHeadAttention(d_model or DEFAULT_D_MODEL, heads or DEFAULT_HEADS).eval()
    mha = load_checkpoint(checkpoint, num_heads=heads)
    if d_model is not None and d_model != mha.d_model:
        raise click.UsageError(f"--d-model {d_model} disagrees with the checkpoint's d_model {mha.d_model}")
    return mha


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input", "input_path", type=click.Path(path_type=Path), required=True,
              help="Items keyed by id (.npz or .safetensors): <id> -> [seq, d_model] float32, or "
                   "<id>.query/.key/.value for cross-attention.")
@click.option("--output", "output_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Outputs keyed by the same ids, unpadded [seq, d_model] (.npz or .safetensors).")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--provider", type=click.Choice(PROVIDERS), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="ORT intra-op threads (default: all cores).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def infer(model, input_path, output_path, batch_size, provider, threads, progress):
    """Run a model over a file of variable-length items, batched and padded.

    \b
    Example:
      mha-deploy infer mha.onnx --input items.npz --output out.npz --batch-size 32
    """
    from mha_deploy.serving import BatchRunner, MHASession
    from mha_deploy.serving.items import read_items, write_arrays
    from mha_deploy.serving.runner import output_arrays

    if output_path.resolve() == input_path.resolve():
        raise click.UsageError("--output must differ from --input (the input would be overwritten)")
    session = MHASession(model, provider=provider, threads=threads)
    if session.provider_note:
        click.echo(session.provider_note, err=True)
    items = read_items(input_path, session.signature)
    runner = BatchRunner(session, batch_size=batch_size)
    results, stats = _run_with_progress(runner, items, progress)
    write_arrays(output_path, output_arrays(results))
    click.echo(stats.summary())
    click.echo(f"wrote {output_path}")


def _run_with_progress(runner, items, show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("infer"), BarColumn(), MofNCompleteColumn(), TextColumn("items"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not show, transient=False) as bar:
        task = bar.add_task("infer", total=len(items))
        return runner.run(items, on_batch=lambda n, _tokens: bar.advance(task, n))


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model, as_json):
    """Show a model's inputs and outputs (with dynamic dims), opsets, ops and recorded metadata.

    \b
    Example:
      mha-deploy inspect mha.onnx --json
    """
    from mha_deploy.model_report import describe_model

    report = describe_model(model)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=_json_default))
        return
    click.echo(f"{report.path}  ({report.size_bytes / 1e6:.2f} MB, IR {report.ir_version}, "
               f"opsets {', '.join(f'{d} {v}' for d, v in report.opsets.items())})")
    for role, tensors in (("input", report.inputs), ("output", report.outputs)):
        for t in tensors:
            click.echo(f"  {role:6} {t.name:18} {t.dtype:8} [{', '.join(str(d) for d in t.dims)}]")
    click.echo("  ops    " + ", ".join(f"{op} x{n}" for op, n in report.op_counts.items()))
    for op in report.attention_ops:
        attrs = ", ".join(f"{k}={_json_default(v) if isinstance(v, bytes) else v}" for k, v in op.attributes.items())
        click.echo(f"  fused  {op.op}({', '.join(i or '-' for i in op.inputs)}) {attrs}")
    meta = report.metadata
    if meta is None:
        click.echo("  metadata: none (not exported by mha-deploy)")
        return
    sig = meta["signature"]
    click.echo(f"  model  d_model={meta['d_model']} heads={meta['num_heads']} attention={sig['attention']} "
               f"mask={sig['mask']} dtype={meta['dtype']} fusion={meta['fusion']}")
    parity = meta.get("parity")
    if parity:
        click.echo(f"  parity {'PASSED' if parity['passed'] else 'FAILED'}: max abs err {parity['max_abs_err']:.3g} "
                   f"at atol={parity['atol']:g} rtol={parity['rtol']:g} over {', '.join(parity['shapes'])}")
    click.echo("  versions " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))


def _json_default(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
