"""``mha-deploy genai-config``: onnxruntime-genai's config beside a decoder-only KV-cache file."""

from __future__ import annotations

from pathlib import Path

import click

from mha_deploy.cli.group import main


@main.command("genai-config")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--max-length", type=click.IntRange(min=1),
              help="The longest sequence (prompt and new tokens) onnxruntime-genai may run: its context_length. "
                   "Default: the max length recorded at export.")
@click.option("--threads", type=click.IntRange(min=1), show_default="one per core",
              help="Intra-op threads of the ONNX Runtime session onnxruntime-genai creates.")
def genai_config(model, max_length, threads):
    """Write genai_config.json beside MODEL (export --module ... --kv-cache) so that onnxruntime-genai generates
    from the file unchanged: its names, the recorded eos/pad/start ids, greedy search defaults.

    onnxruntime-genai reads one genai_config.json per directory: keep one model per directory.

    \b
    Example:
      mha-deploy genai-config lm/model.onnx
      python -c "import onnxruntime_genai as og; og.Model('lm')"
    """
    from mha_deploy.runtime.genai_config import write_genai_config

    path, warnings = write_genai_config(model, max_length, threads)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {path} (onnxruntime-genai)")
