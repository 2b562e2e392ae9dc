"""``mha-deploy triton``: a Triton Inference Server model repository entry."""

from __future__ import annotations

from pathlib import Path

import click

from mha_deploy.cli.group import main
from mha_deploy.metadata import TRITON_KINDS


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--repo", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Triton model repository directory (created if missing).")
@click.option("--name", help="Model name in the repository (default: the file's stem).")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Model instances Triton runs at once.")
@click.option("--kind", type=click.Choice(tuple(TRITON_KINDS)), default="cpu", show_default=True)
@click.option("--max-batch-size", type=click.IntRange(min=0), default=32, show_default=True,
              help="Largest batch Triton's dynamic batcher forms; 0 disables batching.")
@click.option("--max-queue-delay-us", type=click.IntRange(min=0), default=500, show_default=True,
              help="Longest a request waits in Triton's dynamic batcher for others.")
@click.option("--version", "version", type=click.IntRange(min=1), default=1, show_default=True,
              help="Version directory to write (REPO/NAME/VERSION/model.onnx).")
@click.option("--overwrite", is_flag=True,
              help="Replace the config and this version of an existing model; its other versions and files stay.")
def triton(model, repo, name, instances, kind, max_batch_size, max_queue_delay_us, version, overwrite):
    """Write a Triton Inference Server model repository entry for a model (onnxruntime backend).

    Writes REPO/NAME/config.pbtxt and REPO/NAME/1/model.onnx, all or nothing. Triton's
    dynamic batcher only batches requests of equal sequence length (see the config's
    comment); the mha-deploy HTTP server pads across lengths instead. A --kv-cache model gets
    sequence batching with implicit state (past_key/past_value <- present_key/present_value, empty at the
    start of a sequence), one sequence per run (max_batch_size 1).

    \b
    Example:
      mha-deploy triton mha.onnx --repo models --name mha --instances 2 --kind cpu
      tritonserver --model-repository models
    """
    from mha_deploy.serving.triton import TritonConfig, other_versions, write_triton_model

    config = TritonConfig(name=name, instances=instances, kind=kind, max_batch_size=max_batch_size,
                          max_queue_delay_us=max_queue_delay_us, version=version)
    path = write_triton_model(model, repo, config, overwrite=overwrite)
    others = other_versions(path, version)
    if others and int(others[-1]) > version:
        click.echo(f"note: {path} also holds version(s) {', '.join(others)}; Triton serves the latest by default "
                   f"(version {others[-1]}), not the {version} just written", err=True)
    click.echo(f"wrote {path}")
