"""``mha-deploy``: a thin Click layer over the library.

Heavy modules (torch, onnxruntime) are imported inside the commands that need
them, so ``--help`` is instant and serving commands never load torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click

from mha_deploy import __version__
from mha_deploy.batching import BatchingConfig, RunnerOptions
from mha_deploy.cli_options import DEFAULT_D_MODEL, DEFAULT_HEADS, RenamedOption, model_options, session_options
from mha_deploy.errors import MHADeployError, ModelConfigError
from mha_deploy.metadata import (
    ATTENTION_KINDS,
    DTYPE_CHOICES,
    FUSE_CHOICES,
    MASK_MODES,
    MAX_OPSET,
    MIN_OPSET,
    MODEL_KINDS,
    ON_ERROR_CHOICES,
    QUANTIZE_CHOICES,
    TRITON_KINDS,
    Signature,
)

# ServeConfig.graceful_timeout_s (not imported: the serving package loads onnxruntime).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class _Group(click.Group):
    """Turns errors into one line on stderr (a traceback only with ``--debug``).

    Usage mistakes are ``click.UsageError`` (exit 2, Click's format); an
    ``MHADeployError`` exits 1 with its message; anything else exits 1 as unexpected.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`mha-deploy inspect m.onnx | head`): stop quietly, as SIGPIPE would stop a
            # C tool, and keep Python from failing again when it flushes stdout at exit.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(141)
        except Exception as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if isinstance(exc, MHADeployError):
                click.echo(f"error: {_one_line(exc)}", err=True)
            else:
                click.echo(f"error: unexpected {type(exc).__name__}: {_one_line(exc)} (rerun with --debug for details)",
                           err=True)
            ctx.exit(1)


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


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


# export and optimize: token packing (exporters.token_packing)
_pack_tokens_option = click.option(
    "--pack-tokens/--no-pack-tokens", default=True, show_default=True,
    help="Run the per-token layers (projections, feed-forwards, norms) on the real tokens only, gathered where "
         "such a run starts and put back where an attention, a pooling or an output reads them: a quarter "
         "padded, 1.16-1.28x faster at d_model 512 (an unpadded batch 1-2% slower). Only along an axis with a "
         "padding mask that the model may be padded on, only where the MatMul work outweighs the copies "
         "(a stack or your own model from d_model 256, a lone block from 1024), not for fp16 or --kv-cache, and "
         "dropped with a warning if parity fails with it.")


@main.command()
@model_options
@click.option("--model", "model_kind", type=click.Choice(MODEL_KINDS), default="mha",
              show_default=True, help="A lone MHA, or a post-norm Transformer stack of --layers layers built from it "
                                      "(random init; decoder inputs: x, memory).")
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True, help="Layers of a stack.")
@click.option("--d-ff", type=click.IntRange(min=1), help="Feed-forward width of a stack (default 4 x d_model).")
@click.option("--attention", type=click.Choice(ATTENTION_KINDS), default="self", show_default=True,
              help="For --model mha.")
@click.option("--mask", type=click.Choice(MASK_MODES), default="none", show_default=True,
              help="padding adds input key_padding_mask (bool, True = real token); causal is built into the graph.")
@click.option("--return-weights", is_flag=True, help="Also output attn_weights [batch, heads, q_seq, kv_seq].")
@click.option("--kv-cache", is_flag=True,
              help="Incremental decoding (--mask causal or padding-causal, or --model decoder): inputs "
                   "past_key/past_value [batch, heads, past_seq, d_k] (past_seq 0 for the prefill), outputs "
                   "present_key/present_value [batch, heads, past_seq + seq, d_k]; key_padding_mask covers "
                   "past_seq + seq. A decoder has past_key_values.{i}.key/.value/.encoder_key/.encoder_value and "
                   "present.{i}.* per layer (see inspect). With --module (a causal LM: --input IDS:tokens "
                   "--input MASK:padding-mask, logits out): input_ids, attention_mask (int64 over past_seq + seq), "
                   "past_key_values.{i}.key/.value per attention in, logits and present.{i}.* out, checked call by "
                   "call against the module's forward.")
@click.option("--fuse", type=click.Choice(FUSE_CHOICES), default="auto", show_default=True,
              help="Fuse each attention into one op. mha: ORT contrib MultiHeadAttention; it takes the padding "
                   "mask and causal flag as they are, so no [batch, q_len, kv_len] mask is built in the graph "
                   "(onnx builds one for a padding mask, which costs memory). onnx: standard Attention (opset 23), "
                   "the only op that can also output the probabilities. none: the plain graph. auto picks mha for "
                   "that memory saving, or onnx when --return-weights asks for the probabilities; it falls back to "
                   "none with a warning if fusion or parity fails.")
@click.option("--quantize", type=click.Choice(QUANTIZE_CHOICES), default="none", show_default=True,
              help="int8: dynamic int8 projections for ORT's CPU provider, attention kept fused; parity then "
                   "means a relative error within 5%.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random-init model.")
@click.option("--opset", type=click.IntRange(MIN_OPSET, MAX_OPSET), default=MAX_OPSET, show_default=True,
              help=f"ONNX opset (torch's exporter needs >= {MIN_OPSET}; --fuse onnx, the standard Attention op, "
                   f"needs {MAX_OPSET}).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="fp32", show_default=True,
              help="fp16: half-precision weights and I/O (for CUDA), checked against the fp32 torch reference.")
@click.option("--atol", type=click.FloatRange(min=0),
              help="Parity tolerance, absolute (default 1e-5 for fp32, 5e-3 for fp16).")
@click.option("--rtol", type=click.FloatRange(min=0),
              help="Parity tolerance, relative (default 1e-4 for fp32, 5e-3 for fp16).")
@click.option("--module", "module_spec", metavar="FILE.py:FACTORY",
              help="Your own model: FACTORY() in FILE.py returns the nn.Module (--checkpoint then loads its state "
                   "dict strictly). Declare its forward's inputs with --input.")
@click.option("--input", "inputs", multiple=True, metavar="NAME:ROLE[:AXIS][:FEATURES]",
              help="With --module, one per forward parameter to feed, bound by NAME (any order; parameters not "
                   "declared keep their defaults); the file takes its inputs in this order. ROLE: tokens (int64 "
                   "ids [batch, seq]), "
                   "sequence (float [batch, seq, FEATURES]; FEATURES read off the module when omitted) or "
                   "padding-mask ([batch, seq], True/1 = real token; it marks the input on the same AXIS). AXIS "
                   "(default seq) names a length axis: an encoder-decoder's target is e.g. tgt:tokens:tgt_seq.")
@click.option("--output-name", "output_names", multiple=True, metavar="NAME",
              help="With --module, names of the forward's outputs in order (default: where each was returned: "
                   "output for a lone tensor, a dict's key, output_<i> for a tuple's items, <name>.<i> inside "
                   "them, None values skipped).")
@click.option("--max-length", type=click.IntRange(min=1),
              help="With --module, the longest sequence the module takes (e.g. its position table): parity "
                   "checks no longer one.")
@_pack_tokens_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the .onnx file (written only if parity passes).")
@click.pass_context
def export(ctx, checkpoint, prefix, d_model, heads, model_kind, layers, d_ff, attention, mask, return_weights, kv_cache,
           fuse, quantize, seed, opset, dtype, atol, rtol, module_spec, inputs, output_names, max_length, pack_tokens,
           output):
    """Export a reference MHA to ONNX with dynamic batch and sequence axes, checked against torch.

    \b
    Examples:
      mha-deploy export -o mha.onnx
      mha-deploy export --attention cross --mask padding -o cross.onnx
      mha-deploy export --fuse onnx --mask padding-causal -o mha.onnx
      mha-deploy export --mask padding-causal --kv-cache -o decode.onnx
      mha-deploy export --quantize int8 -o mha-int8.onnx
      mha-deploy export --dtype fp16 --fuse mha --mask padding -o mha-fp16.onnx
      mha-deploy export --model decoder --layers 6 --mask padding -o decoder.onnx
      mha-deploy export --checkpoint attn.safetensors --heads 8 --mask padding-causal -o mha.onnx
      mha-deploy export --module model.py:build --input ids:tokens --input mask:padding-mask -o model.onnx
    """
    from mha_deploy.exporters import export_builtin, export_model, load_factory

    options = {"opset": opset, "atol": atol, "rtol": rtol, "fuse": fuse, "quantize": quantize, "dtype": dtype,
               "pack_tokens": pack_tokens}
    lone_block = ("prefix", "d_model", "heads", "model_kind", "layers", "d_ff", "attention", "mask",
                  "return_weights", "seed")
    own_model = ("inputs", "output_names", "max_length")
    if module_spec is not None:
        given = [name for name in lone_block if _given(ctx, name)]
        if given:
            raise click.UsageError(f"--module exports your model as it is: {_flags(given)} describe the built-in ones")
        if not inputs:
            raise click.UsageError("--module needs its forward's inputs: --input NAME:ROLE for each")
        module = load_factory(module_spec)
        click.echo(f"exporting {type(module).__name__} from {module_spec}, inputs {', '.join(inputs)}", err=True)
        result = export_model(module, output, inputs, output_names=output_names or None, checkpoint=checkpoint,
                              max_length=max_length, kv_cache=kv_cache, **options)
    elif given := [name for name in own_model if _given(ctx, name)]:
        raise click.UsageError(f"{_flags(given)} describe your own model: give it with --module FILE.py:FACTORY")
    elif model_kind == "mha":
        if layers != 1:
            raise click.UsageError("--layers is for --model encoder or decoder")
        signature = Signature(attention, mask, return_weights, kv_cache=kv_cache)
        mha = _load_model(checkpoint, d_model, heads, seed, prefix=prefix)
        click.echo(f"exporting d_model={mha.d_model} heads={mha.num_heads} attention={attention} mask={mask}"
                   + (" kv-cache" if kv_cache else ""), err=True)
        result = export_builtin(mha, output, signature, **options)
    else:
        if checkpoint is not None or prefix is not None or return_weights:
            raise click.UsageError(
                f"--model {model_kind} exports a seeded random stack: no --checkpoint, --prefix or --return-weights"
            )
        # The flags' I/O contract, checked before a stack is built for it.
        signature = Signature("self" if model_kind == "encoder" else "cross", mask, model=model_kind,
                              kv_cache=kv_cache, layers=layers if kv_cache else 1)
        stack = _build_stack(model_kind, layers, d_model, heads, d_ff, seed)
        click.echo(f"exporting a {layers}-layer {model_kind}, mask={mask}" + (" kv-cache" if kv_cache else ""),
                   err=True)
        result = export_builtin(stack, output, signature, **options)
    _echo_export(result)


def _echo_export(result) -> None:
    """What export and optimize print: warnings, the fusion, token packing, parity, the file."""
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(result.fusion.summary())
    if result.packing is not None:
        click.echo(result.packing.describe())
    click.echo(result.parity.summary())
    click.echo(f"wrote {result.path}")


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


def _flags(names: list[str]) -> str:
    flags = {"model_kind": "--model", "inputs": "--input", "output_names": "--output-name"}
    return ", ".join(flags.get(name, "--" + name.replace("_", "-")) for name in names)


def _build_stack(kind: str, layers: int, d_model: int | None, heads: int | None, d_ff: int | None, seed: int):
    from mha_deploy.models.build import random_stack

    with _sizes_from_flags():
        return random_stack(kind, layers, DEFAULT_D_MODEL if d_model is None else d_model,
                            DEFAULT_HEADS if heads is None else heads, d_ff, seed)


def _load_model(checkpoint, d_model: int | None, heads: int | None, seed: int, prefix: str | None = None):
    from mha_deploy.models import load_checkpoint
    from mha_deploy.models.build import random_mha

    if checkpoint is None:
        if prefix is not None:
            raise click.UsageError("--prefix picks the attention out of a --checkpoint; give one")
        with _sizes_from_flags():
            return random_mha(
                DEFAULT_D_MODEL if d_model is None else d_model, DEFAULT_HEADS if heads is None else heads, seed
            )
    mha = load_checkpoint(checkpoint, num_heads=heads, prefix=prefix)
    if d_model is not None and d_model != mha.d_model:
        raise click.UsageError(f"--d-model {d_model} disagrees with the checkpoint's d_model {mha.d_model}")
    return mha


@contextlib.contextmanager
def _sizes_from_flags():
    """Sizes the model refuses (e.g. heads not dividing d_model) came from the flags: a usage error (exit 2)."""
    try:
        yield
    except ModelConfigError as exc:
        raise click.UsageError(str(exc)) from None


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input", "input_path", type=click.Path(path_type=Path), required=True,
              help="Items keyed by id: a .npz, .safetensors or .parquet file, or a directory of such shards. "
                   "npz/safetensors: <id> -> [seq, d_model] float32 (<id>.query/.key/.value for cross-attention); "
                   "Parquet: columns id (string) and x (list<list<float32>>; query/key/value for cross).")
@click.option("--output", "output_path", type=click.Path(path_type=Path), required=True,
              help="Outputs keyed by the same ids, unpadded [seq, d_model]: a file (format from its suffix) "
                   "for a file input, a directory with the same shard names and formats for a directory.")
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
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: shards spread over Ray Data actors (needs mha-deploy[ray] and a filesystem all nodes see).")
@click.option("--ray-address", help="Ray cluster to join (default: start a local one).")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ray actors, each holding one session.")
@click.option("--num-gpus", type=click.FloatRange(min=0), default=0, show_default=True,
              help="GPUs per Ray actor (use with --provider cuda).")
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
            stats = _run_with_progress(
                lambda on_start, on_batch: run_dataset_on_ray(
                    job, model, provider=provider, threads=threads, ray=ray_options, on_start=on_start,
                    on_batch=on_batch, options=options),
                progress)
        else:
            session = MHASession(model, provider=provider, threads=threads)
            if session.provider_note:
                click.echo(session.provider_note, err=True)
            runner = BatchRunner(session, options)
            stats = _run_with_progress(
                lambda on_start, on_batch: run_dataset(job, runner, on_start, on_batch), progress)
    for name, reason in job.redo_reasons.items():
        click.echo(f"redid {name}: {reason}", err=True)
    for name in job.unrecorded:
        click.echo(f"warning: {name} changed while it ran; not recorded as done, the next run redoes it", err=True)
    for error in stats.errors[:20]:
        click.echo(f"skipped {error}", err=True)
    if len(stats.errors) > 20:
        click.echo(f"... and {len(stats.errors) - 20} more bad items (all listed in {job.manifest_path})", err=True)
    if as_json:
        click.echo(json.dumps({**stats.to_dict(), "output": str(output_path), "manifest": str(job.manifest_path)}))
        return
    click.echo(stats.summary())
    if stats.shards_written:
        click.echo(f"wrote {output_path}")
    else:
        click.echo(f"nothing to do: {output_path} was already done by an earlier run (--overwrite redoes it)")


def _run_with_progress(run, show: bool):
    """``run(on_start, on_batch)`` with a rich progress bar on stderr: items, items/s and tokens/s."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("infer"), BarColumn(), MofNCompleteColumn(), TextColumn("items"),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not show, transient=False) as bar:
        task = bar.add_task("infer", total=None, rate="")
        counts = {"items": 0, "tokens": 0, "start": time.perf_counter()}

        def on_batch(items: int, tokens: int) -> None:
            counts["items"] += items
            counts["tokens"] += tokens
            elapsed = max(time.perf_counter() - counts["start"], 1e-9)
            rate = f"{counts['items'] / elapsed:.1f} items/s {counts['tokens'] / elapsed:,.0f} tokens/s"
            bar.update(task, advance=items, rate=rate)

        return run(lambda total: bar.update(task, total=total), on_batch)


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model, as_json):
    """Show a model's inputs and outputs (with dynamic dims), opsets, ops, the kernel each attention runs on
    ORT's CPU provider, and recorded metadata.

    \b
    Example:
      mha-deploy inspect mha.onnx --json
    """
    from mha_deploy.model_report import describe_model

    report = describe_model(model)
    problem = _metadata_problem(model) if report.metadata is not None else None
    if problem:
        click.echo(f"warning: its metadata does not describe its graph, which infer and serve refuse: {problem}",
                   err=True)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "metadata_problem": problem}, indent=2, default=_json_default))
        return
    click.echo(report.text())


def _metadata_problem(model: Path) -> str | None:
    """What the check every session makes on load finds wrong with ``model``'s metadata, or None."""
    from mha_deploy.runtime.session import check_model_file

    try:
        check_model_file(model)
    except MHADeployError as exc:
        return _one_line(exc)
    return None


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=BatchingConfig.max_batch, show_default=True,
              help="Most requests run together in one padded batch; 1 turns micro-batching off.")
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=BatchingConfig.max_wait_ms, show_default=True,
              help="Longest a request waits for others to join its batch.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=BatchingConfig.max_batch_tokens,
              show_default=True,
              help="Most padded positions (requests x longest sequence) in one run; bounds its memory.")
@click.option("--workers", type=click.IntRange(min=1), default=BatchingConfig.workers, show_default=True,
              help="Batches run at once, each in its own thread.")
@session_options()
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=64, show_default=True,
              help="Larger request bodies get 413.")
@click.option("--max-item-tokens", cls=RenamedOption, old_names=("--max-tokens",), type=click.IntRange(min=1),
              default=1024, show_default=True, help="Longest sequence one request may hold; longer ones get 422.")
@click.option("--optimized-model", type=click.Path(dir_okay=False, path_type=Path),
              help="Cache of ORT's optimized graph: written on the first start, reused for faster later starts.")
@click.option("--spin", is_flag=True,
              help="Let idle ORT threads spin-wait (off by default: it takes CPU from request handling).")
@click.option("--log-level", type=click.Choice(("debug", "info", "warning", "error")), default="info",
              show_default=True)
@click.option("--access-log", is_flag=True, help="Log every request (costs throughput).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=DEFAULT_DRAIN_TIMEOUT_S, show_default=True,
              help="Seconds a SIGTERM waits for accepted requests to finish before the server exits anyway.")
@click.option("--name", help="Model name in the v2 protocol (/v2/models/NAME; default: the file's stem).")
@click.option("--grpc-port", type=click.IntRange(0, 65535),
              help="Also serve the v2 protocol over gRPC (inference.GRPCInferenceService) on this port.")
@click.option("--max-queue", type=click.IntRange(min=1), default=BatchingConfig.max_queue, show_default=True,
              help="Items waiting for a batch; beyond it requests get 503 with Retry-After (gRPC: UNAVAILABLE).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File of API keys, one per line: every route but health then needs 'Authorization: Bearer KEY'.")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False, path_type=Path),
              help="PEM certificate (chain): serve REST and gRPC over TLS (with --ssl-keyfile).")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False, path_type=Path), help="PEM private key for TLS.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a request body may take to arrive; slower ones get 408.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Requests (and gRPC calls) in progress at once, counted once authorised (health checks aside); "
                   "beyond it 503 (RESOURCE_EXHAUSTED). Idle connections take none.")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds a connection with no request in progress stays open (new, or between requests).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a request's headers may take to arrive, from its first byte; then the connection closes.")
@click.option("--max-idle-connections", type=click.IntRange(min=1),
              help="Connections with no request in progress kept at once; beyond, the longest idle is closed "
                   "(default: half the open-file limit).")
def serve(model, host, port, max_batch, max_wait_ms, max_batch_tokens, workers, provider, threads, max_body_mb,
          max_item_tokens, optimized_model, spin, log_level, access_log, drain_timeout, name, grpc_port, max_queue,
          api_key_file, ssl_certfile, ssl_keyfile, body_timeout, max_connections, keep_alive_timeout,
          header_timeout, max_idle_connections):
    """Serve a model over HTTP (and gRPC) with dynamic micro-batching (needs the 'serve' extra).

    The Open Inference Protocol (KServe v2, what Triton's and KServe's clients
    speak): GET /v2, /v2/models/NAME, /v2/health/live|ready, POST
    /v2/models/NAME/infer with JSON or binary tensors; over gRPC with --grpc-port.
    POST /v1/infer takes {"x": [[...d_model floats] x seq]} (cross-attention: query, key,
    value) as JSON, an .npy body (application/x-npy) or an .npz body (application/x-npz).
    All share one micro-batcher. GET /healthz, /readyz and /metrics (Prometheus) are
    for orchestration. SIGTERM finishes every accepted request (up to --drain-timeout)
    before exiting.

    \b
    Example:
      mha-deploy serve mha.onnx --port 8000 --grpc-port 8001 --max-batch 32 --max-wait-ms 2
      curl -s localhost:8000/v1/infer -H 'Content-Type: application/json' -d '{"x": [[0.1, ...]]}'
      curl -s localhost:8000/v2/models/mha
    """
    from mha_deploy.serving.http import ServeConfig
    from mha_deploy.serving.http import serve as run_server
    from mha_deploy.serving.http.parsing import RequestLimits

    limits = RequestLimits(
        max_body_bytes=int(max_body_mb * 2**20), max_item_tokens=max_item_tokens, body_timeout_s=body_timeout
    )
    batching = BatchingConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, workers=workers, max_queue=max_queue,
                              max_batch_tokens=max_batch_tokens)
    run_server(ServeConfig(
        model, host=host, port=port, provider=provider, threads=threads, batching=batching, limits=limits,
        optimized_model_path=optimized_model, spin=spin, log_level=log_level, access_log=access_log,
        graceful_timeout_s=drain_timeout, name=name, grpc_port=grpc_port, api_key_file=api_key_file,
        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, max_connections=max_connections,
        keep_alive_timeout_s=keep_alive_timeout, header_timeout_s=header_timeout,
        max_idle_connections=max_idle_connections,
    ))


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
              help="Square MatMul sizes tried for the efficiency yardstick (ORT's best rate over them; for int8 "
                   "rows its int8 MatMulInteger rate).")
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
    """Compare torch eager, torch SDPA, ORT unfused, ORT fused per target and int8, and OpenVINO, per mask mode,
    in one run.

    Reports median and p90 latency, GFLOP/s, the ratio to torch eager,
    efficiency against ORT's own MatMul rate measured in the same run (int8
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
    mha = _load_model(checkpoint, d_model, heads, seed=0, prefix=prefix)
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


@main.command()
@click.argument("source", metavar="IN.onnx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input", "inputs", multiple=True, required=True, metavar="NAME:ROLE[:AXIS][:FEATURES]",
              help="One per input of the graph, as for export --module. ROLE: tokens (int64 or int32 ids), sequence "
                   "(float32 [batch, seq, FEATURES]; FEATURES read off the graph when it fixes them) or "
                   "padding-mask (bool or integer, True/1 = real token; the written model takes bool). AXIS "
                   "(default seq) names a length axis, e.g. tgt:tokens:tgt_seq.")
@click.option("--output-name", "output_names", multiple=True, metavar="NAME",
              help="Rename the graph's outputs, in order (default: the graph's names).")
@click.option("--fuse", type=click.Choice(FUSE_CHOICES), default="auto", show_default=True,
              help="As for export: mha, onnx (opset 23 graphs) or none; auto picks mha and falls back to none with "
                   "a warning if fusion or parity fails, mha and onnx fail instead.")
@click.option("--max-length", type=click.IntRange(min=1),
              help="The longest sequence the graph takes (e.g. its position table): parity checks no longer one.")
@click.option("--atol", type=click.FloatRange(min=0), help="Parity tolerance, absolute (default 1e-5).")
@click.option("--rtol", type=click.FloatRange(min=0), help="Parity tolerance, relative (default 1e-4).")
@_pack_tokens_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the .onnx file (written only if parity passes).")
def optimize(source, inputs, output_names, fuse, max_length, atol, rtol, pack_tokens, output):
    """Fuse the attentions of an ONNX graph exported elsewhere (e.g. torch.onnx.export of your model), checked
    against that graph in ONNX Runtime at unseen shapes, left and right padding.

    \b
    Example:
      mha-deploy optimize model.onnx --input input_ids:tokens --input attention_mask:padding-mask -o fused.onnx
    """
    from mha_deploy.exporters.optimize import optimize_model

    click.echo(f"optimizing {source}, inputs {', '.join(inputs)}", err=True)
    result = optimize_model(source, output, inputs, output_names=output_names or None, fuse=fuse, atol=atol,
                            rtol=rtol, max_length=max_length, pack_tokens=pack_tokens)
    _echo_export(result)


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


def _json_default(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
