"""``mha-deploy infer``: a model over a dataset, batched by length, streamed and resumable."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mha_deploy.batching import RunnerOptions
from mha_deploy.cli.group import main
from mha_deploy.cli.options import RenamedOption, ray_options, session_options
from mha_deploy.cli.progress import echo_run_notes, run_with_progress
from mha_deploy.metadata import ON_ERROR_CHOICES


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input", "input_path", type=click.Path(path_type=Path), required=True,
              help="Items keyed by id: a .npz, .safetensors, .parquet or .jsonl file, or a directory of such "
                   "shards. npz/safetensors: <id> -> [seq, d_model] float32 (<id>.query/.key/.value for "
                   "cross-attention); Parquet: columns id (string) and x (list<list<float32>>; query/key/value "
                   "for cross); JSONL: one object per line, {\"id\": ..., \"x\": [[...], ...]}, "
                   "its fields Parquet's columns.")
@click.option("--output", "output_path", type=click.Path(path_type=Path), required=True,
              help="Outputs keyed by the same ids, unpadded [seq, d_model]: a .npz, .safetensors or .parquet file "
                   "for a file input, a directory with the same shard names and formats for a directory (a JSONL "
                   "shard's outputs: <stem>.npz).")
@click.option("--batch-size", type=click.IntRange(min=1),
              help=f"At most this many items per batch (default {RunnerOptions.batch_size} unless --max-batch-tokens "
                   "is given).")
@click.option("--max-batch-tokens", cls=RenamedOption, old_names=("--max-tokens",), type=click.IntRange(min=1),
              help="At most this many padded positions (items × longest sequence) per batch.")
@click.option("--bucket-window", type=click.IntRange(min=0), default=RunnerOptions.bucket_window, show_default=True,
              help="Items read ahead and sorted by length before batching (bounds memory); 0 keeps input order.")
@click.option("--on-error", type=click.Choice(ON_ERROR_CHOICES), default="stop", show_default=True,
              help="At a bad item (wrong shape or dtype, NaN, empty): stop with an error, or skip it and list it.")
@click.option("--overwrite", is_flag=True, help="Redo every shard, even those a previous run finished.")
@ray_options("ray: shards spread over Ray Data actors (needs mha-deploy[ray] and a filesystem all nodes see).",
             "one session")
@session_options()
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def infer(model, input_path, output_path, batch_size, max_batch_tokens, bucket_window, on_error, overwrite, engine,
          ray_address, concurrency, num_gpus, provider, threads, progress, as_json):
    """Run a model over items (a file or a directory of shards), batched by length and streamed.

    Rerunning the same command resumes: finished shards are skipped once their
    outputs are verified against the manifest beside or inside the output (a
    damaged one is redone); --overwrite redoes them. The output is locked while
    a run writes it: a second run on it fails at once, naming the first one's pid.

    \b
    Examples:
      mha-deploy infer mha.onnx --input items.npz --output out.npz --batch-size 32
      mha-deploy infer mha.onnx --input shards/ --output out/ --max-batch-tokens 8192 --on-error skip
      mha-deploy infer mha.onnx --input data.parquet --output out.parquet --json
      mha-deploy infer classifier.onnx --input texts.jsonl --output logits.npz
      mha-deploy infer mha.onnx --input shards/ --output out/ --engine ray --concurrency 4
    """
    from mha_deploy.batch import BatchRunner
    from mha_deploy.batch.job import DatasetJob, run_dataset
    from mha_deploy.runtime import MHASession

    if output_path.resolve() == input_path.resolve():
        raise click.UsageError("--output must differ from --input (the input would be overwritten)")
    if batch_size is None and max_batch_tokens is None:
        batch_size = RunnerOptions.batch_size
    options = RunnerOptions(batch_size, max_batch_tokens, bucket_window, on_error)
    job = DatasetJob(input_path, output_path, model, overwrite=overwrite, options=options)
    with job:  # the output is locked from here to the end: a second run on it fails at once, naming this pid
        if engine == "ray":
            from mha_deploy.batch.ray_engine import RayOptions, run_dataset_on_ray

            ray_options = RayOptions(address=ray_address, concurrency=concurrency, num_gpus=num_gpus)
            stats = run_with_progress(
                lambda on_start, on_batch: run_dataset_on_ray(
                    job, model, provider=provider, threads=threads, ray=ray_options, on_start=on_start,
                    on_batch=on_batch, options=options),
                progress)
        else:
            session = MHASession(model, provider=provider, threads=threads)
            if session.provider_note:
                click.echo(session.provider_note, err=True)
            runner = BatchRunner(session, options)
            stats = run_with_progress(
                lambda on_start, on_batch: run_dataset(job, runner, on_start, on_batch), progress)
    echo_run_notes(job, stats.errors, "bad items")
    if job.left_out:
        click.echo(f"note: {job.left_out}", err=True)
    if as_json:
        click.echo(json.dumps({**stats.to_dict(), "output": str(output_path), "manifest": str(job.manifest_path)}))
        return
    click.echo(stats.summary())
    if stats.shards_written:
        click.echo(f"wrote {output_path}")
    else:
        click.echo(f"nothing to do: {output_path} was already done by an earlier run (--overwrite redoes it)")
