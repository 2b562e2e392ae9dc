"""``mha-deploy generate``: new tokens for a dataset of prompts, batched by length and resumable."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mha_deploy.batching import RunnerOptions
from mha_deploy.cli.group import main
from mha_deploy.cli.options import ray_options, session_options
from mha_deploy.cli.progress import echo_run_notes, run_with_progress
from mha_deploy.metadata import ON_ERROR_CHOICES
from mha_deploy.seeds import SEED_LIMIT


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input", "input_path", type=click.Path(path_type=Path), required=True,
              help="Prompts: a .jsonl file of {\"id\": ..., \"input_ids\": [...]} or {\"id\": ..., \"prompt\": "
                   "\"...\"} (text needs --tokenizer), an .npz of <id> -> int ids [seq], a .parquet with columns "
                   "id and input_ids or prompt; or a directory of such shards. An encoder-decoder's prompts are "
                   "its source.")
@click.option("--output", "output_path", type=click.Path(path_type=Path), required=True,
              help="A .jsonl file of {\"id\", \"output_ids\", \"text\"} per prompt, in input order (the new tokens "
                   "only; text with --tokenizer); for a directory input, a directory of <shard stem>.jsonl.")
@click.option("--tokenizer", type=click.Path(dir_okay=False, path_type=Path),
              help="A Hugging Face tokenizers file (tokenizer.json): encodes text prompts, decodes the outputs. "
                   "Default: the tokenizer.json beside MODEL (export --hf writes it there), if any.")
@click.option("--encoder", type=click.Path(dir_okay=False, path_type=Path),
              help="An encoder-decoder's encoder file (MODEL is then its decoder); needs --start-id. Default: the "
                   "encoder a decoder exported with --kv-cache names (written beside it), with its recorded start id.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=20, show_default=True,
              help="A prompt ends after this many new tokens.")
@click.option("--min-new-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="No end id before this many new tokens.")
@click.option("--eos-id", "eos_ids", type=click.IntRange(min=0), multiple=True,
              help="Token id that ends a prompt's output (kept in it); repeatable. Default: the ids recorded at "
                   "export (export --eos-id); none: every prompt runs to --max-new-tokens.")
@click.option("--start-id", type=click.IntRange(min=0),
              help="The decoder start id of an encoder-decoder (with --encoder); default: the one its decoder file "
                   "recorded at export.")
@click.option("--forced-bos-id", type=click.IntRange(min=0),
              help="An encoder-decoder's first generated token, forced (M2M100's and MBart-50's target language "
                   "id) for every prompt without a \"decoder_prompt\"; default: the one recorded at export from the "
                   "folder's generation config (forced_bos_token_id), if any.")
@click.option("--do-sample", is_flag=True, help="Sample (with --temperature, --top-k, --top-p); default greedy.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k likeliest tokens only.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Sample among the likeliest tokens whose probabilities add up to p.")
@click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="OpenAI's: a token's logit loses this once the prompt's new tokens hold it (the prompt itself "
                   "does not count); greedy and sampling, not --num-beams.")
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0, show_default=True,
              help="OpenAI's: a token's logit loses this per time the prompt's new tokens hold it; greedy and "
                   "sampling, not --num-beams.")
@click.option("--num-beams", type=click.IntRange(min=1), default=1, show_default=True,
              help="Beam search with this many beams (not with --do-sample).")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Beam search: hypotheses scored by their log-probability / length ** this.")
@click.option("--seed", type=click.IntRange(0, SEED_LIMIT - 1), default=0, show_default=True,
              help="Seed of the sampling, an unsigned 64-bit integer (batch b of a shard samples with seed + b, "
                   "so a rerun draws the same).")
@click.option("--max-length", type=click.IntRange(min=1),
              help="The longest sequence the model takes (e.g. its position table): a prompt whose tokens and "
                   "--max-new-tokens exceed it is a bad prompt (an encoder-decoder's source: its tokens alone). "
                   "Default: what the file (the encoder's) records, from export --max-length.")
@click.option("--batch-size", type=click.IntRange(min=1), default=RunnerOptions.batch_size, show_default=True,
              help="At most this many prompts per batch.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1),
              help="At most this many cache positions per batch: prompts x (longest prompt + --max-new-tokens).")
@click.option("--pad-prompts/--no-pad-prompts", default=None,
              help="Let prompts of different lengths share a batch (padded). Default: when that gives each prompt "
                   "the tokens it gets alone, as serve mixes lengths: an encoder-decoder whose encoder takes "
                   "attention_mask, a decoder in the ragged cache layout, one that takes position_ids or whose "
                   "export measured no positions; otherwise a batch holds prompts of one length (a module's own "
                   "positions would see the padding). --pad-prompts for a model whose tokens do not depend on "
                   "positions.")
@click.option("--bucket-window", type=click.IntRange(min=0), default=RunnerOptions.bucket_window, show_default=True,
              help="Prompts read ahead and sorted by length before batching; 0 keeps input order.")
@click.option("--on-error", type=click.Choice(ON_ERROR_CHOICES), default="stop", show_default=True,
              help="At a bad prompt (ids past the vocabulary, empty, too long, unreadable): stop with an error, "
                   "or skip it and list it.")
@click.option("--overwrite", is_flag=True, help="Redo every shard, even those a previous run finished.")
@ray_options("ray: shards spread over Ray Data actors, the same outputs as local (needs mha-deploy[ray], the input, "
             "output and model files on a filesystem every node sees).",
             "one KV-cache stepper (--threads each; default: the cluster's CPUs shared among them)")
@session_options(provider="cpu")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def generate(model, input_path, output_path, tokenizer, encoder, max_new_tokens, min_new_tokens, eos_ids, start_id,
             forced_bos_id, do_sample, temperature, top_k, top_p, repetition_penalty, presence_penalty,
             frequency_penalty, num_beams, length_penalty, seed, max_length, batch_size, max_batch_tokens,
             pad_prompts, bucket_window, on_error, overwrite, engine, ray_address, concurrency, num_gpus, provider,
             threads, progress, as_json):
    """Generate new tokens for every prompt of a dataset with a KV-cache decoder (export --module ... --kv-cache,
    or any decoder in Optimum's cache naming), greedy unless told to sample or search beams.

    Prompts are sorted by length and batched within --batch-size and --max-batch-tokens; a finished
    prompt leaves its batch. Rerunning the same command resumes: finished shards are skipped once
    verified against the manifest, the others are redone from their start, so the output is byte
    for byte that of one uninterrupted run. The output is locked while a run writes it.

    \b
    Examples:
      mha-deploy generate lm.onnx --input prompts.jsonl --output out.jsonl --max-new-tokens 64 --eos-id 2
      mha-deploy generate lm.onnx --input prompts.jsonl --output out.jsonl --tokenizer tokenizer.json --do-sample
      mha-deploy generate lm.onnx --input prompts.jsonl --output out.jsonl --provider cuda
      mha-deploy generate decoder.onnx --encoder encoder.onnx --start-id 0 --input src.jsonl --output out.jsonl
      mha-deploy generate mt.onnx --input src.jsonl --output out.jsonl   # export --kv-cache's pair: mt.encoder.onnx
      mha-deploy generate m2m.onnx --input src.jsonl --output out.jsonl --forced-bos-id 128022

    An encoder-decoder's JSONL line may carry its decoder's prompt: {"id": ..., "input_ids": [...],
    "decoder_prompt": [ids]} (the start id put in front where missing); its output ids follow that prompt.
      mha-deploy generate lm.onnx --input prompts/ --output out/ --engine ray --concurrency 4
    """
    from mha_deploy.batch.generation import (
        PromptGenerator,
        PromptTokenizer,
        generation_job,
        pads_exactly,
        prompt_limits,
        run_generation,
    )
    from mha_deploy.runtime.beside_model import BesideModel
    from mha_deploy.runtime.generation import GenerationConfig, with_recorded_ids
    from mha_deploy.runtime.kv_stepper import KVCacheStepper, encoder_companion

    tokenizer, note = BesideModel.of(model).tokenizer_for(tokenizer)  # export --hf writes it beside the model
    if note:
        click.echo(note, err=True)
    if encoder is None and (found := encoder_companion(model)) is not None:
        # export --kv-cache of an encoder-decoder wrote its encoder beside it and named it, with its start id
        encoder, start_id = Path(found[0]), start_id if start_id is not None else found[1]
        click.echo(f"encoder {encoder} (named by {model.name})", err=True)
    if encoder is not None and start_id is None:
        start_id = _recorded_start_id(model)
    if (encoder is None) != (start_id is None):
        raise click.UsageError("an encoder-decoder needs --encoder and --start-id (or a start id recorded in its "
                               "decoder at export); a decoder-only model neither")
    if forced_bos_id is not None and encoder is None:
        raise click.UsageError("--forced-bos-id forces an encoder-decoder's first generated token: this model is "
                               "decoder-only (its prompt says what comes first)")
    if num_beams > 1 and do_sample:
        raise click.UsageError("--num-beams searches beams and samples nothing: give it or --do-sample, not both")
    if num_beams > 1 and (presence_penalty or frequency_penalty):
        raise click.UsageError("--presence-penalty and --frequency-penalty apply to greedy and sampled generation, "
                               "not to beam search (--num-beams)")
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample, temperature=temperature,
        top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, num_beams=num_beams,
        length_penalty=length_penalty, eos_token_id=list(eos_ids) or None, seed=seed,
        forced_bos_token_id=forced_bos_id,
    )
    options = RunnerOptions(batch_size, max_batch_tokens, bucket_window, on_error)
    # On Ray the driver's stepper only checks the files and resolves the settings; the actors generate, on --provider.
    stepper = KVCacheStepper(model, encoder=encoder, decoder_start_token_id=start_id,
                             threads=1 if engine == "ray" else threads, provider="cpu" if engine == "ray" else provider)
    if stepper.graph.provider_note:
        click.echo(stepper.graph.provider_note, err=True)
    # Resolved here, not only inside the loop, so that the manifest records the ids the run used.
    config = with_recorded_ids(config, stepper)
    if config.eos_token_id is not None and not eos_ids:
        click.echo(f"eos ids {', '.join(map(str, config.end_ids))} (recorded in {model.name})", err=True)
    if config.forced_bos_token_id is not None and forced_bos_id is None:
        click.echo(f"forced first token {config.forced_bos_token_id} (recorded in {model.name}; --forced-bos-id to "
                   "force another)", err=True)
    generator = PromptGenerator(
        stepper, config, options, limits=prompt_limits(stepper, max_length),
        tokenizer=PromptTokenizer(tokenizer) if tokenizer is not None else None,
        pad_prompts=pads_exactly(stepper) if pad_prompts is None else pad_prompts,
    )
    job = generation_job(input_path, output_path, model, generator, encoder=encoder, overwrite=overwrite)
    if engine == "ray":
        from mha_deploy.batch.generation import GenerationShards, run_generation_on_ray
        from mha_deploy.batch.ray_engine import RayOptions

        task, ray = GenerationShards.of(generator, provider), RayOptions(ray_address, concurrency, num_gpus)
        run = lambda on_start, on_batch: run_generation_on_ray(job, task, threads, ray, on_start, on_batch)  # noqa: E731
    else:
        run = lambda on_start, on_batch: run_generation(job, generator, on_start, on_batch)  # noqa: E731
    with job:  # the output is locked from here to the end: a second run on it fails at once, naming this pid
        stats = run_with_progress(run, progress, "generate")
    echo_run_notes(job, stats.errors, "bad prompts")
    if as_json:
        click.echo(json.dumps({**stats.to_dict(), "output": str(output_path), "manifest": str(job.manifest_path)}))
        return
    click.echo(f"{stats.items} prompts, {stats.tokens} new tokens in {stats.seconds:.2f} s: "
               f"{stats.tokens_per_second:.0f} tokens/s, {len(stats.batch_ms)} batches"
               + (f"; {len(stats.errors)} bad prompts skipped" if stats.errors else "")
               + (f"; shards: {stats.shards_written} written, {stats.shards_skipped} already done"
                  if stats.shards_skipped else ""))
    if stats.shards_written:
        click.echo(f"wrote {output_path}")
    else:
        click.echo(f"nothing to do: {output_path} was already done by an earlier run (--overwrite redoes it)")


def _recorded_start_id(model: Path) -> int | None:
    """The decoder start id the decoder file recorded at export, if it is an mha-deploy file that records one."""
    from mha_deploy.errors import ModelFileError
    from mha_deploy.model_report import read_metadata

    try:
        recorded = read_metadata(model).generation
    except ModelFileError:  # not an mha-deploy file: nothing recorded (a file that is no model fails later, named)
        return None
    return recorded.decoder_start_token_id if recorded is not None else None
