"""``mha-deploy export``: the reference MHA, a stack of it, your own module or a Hugging Face folder, to ONNX.

Three sources: the built-in block (its flags build it), ``--module FILE.py:FACTORY`` (your code, its inputs
declared with ``--input``) and ``--hf DIR`` (a folder ``save_pretrained`` wrote, read whole). ``FLAG_SOURCES`` says
which flags are whose: ``--help`` lists them in a section per source, and a flag of another source is refused
naming the source it is for."""

from __future__ import annotations

from pathlib import Path

import click

from mha_deploy.cli.builtin import build_stack, load_model
from mha_deploy.cli.group import main
from mha_deploy.cli.options import (
    SectionedCommand,
    model_options,
    pack_tokens_option,
    quantization,
    quantize_options,
)
from mha_deploy.metadata import (
    ATTENTION_KINDS,
    CACHE_LAYOUT_CHOICES,
    DTYPE_CHOICES,
    FUSE_CHOICES,
    MASK_MODES,
    MAX_OPSET,
    MIN_OPSET,
    MODEL_KINDS,
    GenerationIds,
    Signature,
)

BUILTIN, MODULE, HF = "built-in", "--module", "--hf"
# The one place that says which flags are whose (by parameter name); a flag not here is every source's.
FLAG_SOURCES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("prefix", "d_model", "heads", "model_kind", "layers", "d_ff", "attention", "mask",
                     "return_weights", "seed"), (BUILTIN,)),
    "checkpoint": (BUILTIN, MODULE),
    **dict.fromkeys(("module_spec", "inputs", "output_names"), (MODULE,)),
    "hf": (HF,),
    **dict.fromkeys(("max_length", "eos_ids", "pad_id", "start_id", "position_ids", "cache_layout", "genai",
                     "logits"), (MODULE, HF)),
    # Token prompts: a model over token ids (the built-in block takes float inputs).
    **dict.fromkeys(("calibration", "eval_data", "eval_tokens"), (MODULE, HF)),
}
# --help's sections, in order, by the sources a flag is for (the last: every source's).
SECTIONS: dict[tuple[str, ...], str] = {
    (BUILTIN,): "The built-in block (without --module or --hf)",
    (BUILTIN, MODULE): "The built-in block or --module",
    (MODULE,): "Your own module (--module)",
    (HF,): "A Hugging Face folder (--hf)",
    (MODULE, HF): "Your own module or a Hugging Face folder (--module, --hf)",
    (): "Every source",
}
# What each source takes instead of another's flags, and how a flag's owners are named, for the refusal.
SOURCE_TAKES = {
    BUILTIN: "without --module or --hf, export builds the reference block from its own flags",
    MODULE: "--module exports your model as it is",
    HF: "--hf exports the folder's model as it is: its inputs read from the model's forward, its outputs named "
        "after its output fields, its weights the folder's",
}
OWNERS = {
    (BUILTIN,): "describe the built-in ones",
    (BUILTIN, MODULE): "for the built-in block or --module",
    (MODULE,): "for --module (your own code)",
    (HF,): "for --hf",
    (MODULE, HF): "for --module or --hf (a model of your own)",
}


def _section(name: str) -> str:
    return SECTIONS[FLAG_SOURCES.get(name, ())]


def refuse_other_sources(ctx: click.Context, source: str) -> None:
    """A ``UsageError`` naming the flags given that are for another source than ``source``, and whose they are."""
    given = [name for name, owners in FLAG_SOURCES.items() if source not in owners and _given(ctx, name)]
    if not given:
        return
    owners = FLAG_SOURCES[given[0]]
    names = [name for name in given if FLAG_SOURCES[name] == owners]
    owned = OWNERS[owners]
    if not owned.startswith("describe"):
        owned = ("is " if len(names) == 1 else "are ") + owned
    raise click.UsageError(f"{_flags(names)} {owned}; {SOURCE_TAKES[source]}")


@main.command(cls=SectionedCommand, sections=tuple(SECTIONS.values()), section_of=_section)
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
@quantize_options
@click.option("--quantize-embeddings", is_flag=True,
              help="With --quantize int4: the token embedding tables too, as ORT's GatherBlockQuantized (4-bit "
                   "blocks of --block-size along the hidden axis; a tied LM head keeps its own MatMulNBits copy).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --quant-method gptq: prompts (as generate reads them: JSONL input_ids or prompt text, "
                   "Parquet, npz) whose activations GPTQ corrects each layer's rounding against.")
@click.option("--eval-data", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --quantize int4/int8 and --kv-cache: prompts (as generate reads them) on which the written "
                   "file's perplexity and greedy tokens are compared with the fp32 module's; printed, recorded in "
                   "the file (inspect), refused past 1.5x the fp32 perplexity. Texts use the tokenizer.json of the "
                   "--hf folder or beside -o.")
@click.option("--eval-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="With --eval-data: greedy tokens generated from each prompt by both.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random-init model.")
@click.option("--opset", type=click.IntRange(MIN_OPSET, MAX_OPSET), default=MAX_OPSET, show_default=True,
              help=f"ONNX opset (torch's exporter needs >= {MIN_OPSET}; --fuse onnx, the standard Attention op, "
                   f"needs {MAX_OPSET}).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="fp32", show_default=True,
              help="fp16: half-precision weights and I/O (for CUDA), checked against the fp32 torch reference.")
@click.option("--atol", type=click.FloatRange(min=0),
              help="Parity tolerance, absolute, in units of each output row's magnitude (its largest |value|, at "
                   "least 1; default 1e-5 for fp32, 5e-3 for fp16).")
@click.option("--rtol", type=click.FloatRange(min=0),
              help="Parity tolerance, relative (default 1e-4 for fp32, 5e-3 for fp16).")
@click.option("--module", "module_spec", metavar="FILE.py:FACTORY",
              help="Your own model: FACTORY() in FILE.py returns the nn.Module (--checkpoint then loads its state "
                   "dict strictly). Declare its forward's inputs with --input.")
@click.option("--input", "inputs", multiple=True, metavar="NAME:ROLE[:AXIS][:FEATURES]",
              help="With --module, one per forward parameter to feed, bound by NAME (any order; parameters not "
                   "declared keep their defaults); the file takes its inputs in this order. ROLE: tokens (int64 "
                   "ids [batch, seq]), segments (int64 segment ids on a tokens input's AXIS, e.g. BERT's "
                   "token_type_ids: their own table, ids past it refused), sequence (float [batch, seq, FEATURES]; "
                   "FEATURES read off the module when omitted), padding-mask ([batch, seq], True/1 = real token; it "
                   "marks the input on the same AXIS), image (float [batch, C, H, W], e.g. "
                   "pixel_values:image:3x224x224) or audio (float [batch, MEL, FRAMES], e.g. "
                   "input_features:audio:80x3000); an image's or audio's sizes are read off the module's Hugging "
                   "Face config when omitted (num_channels and image_size; num_mel_bins and 2 x "
                   "max_source_positions), only its batch dynamic. AXIS (default seq) names a length axis: an "
                   "encoder-decoder's target is e.g. tgt:tokens:tgt_seq.")
@click.option("--output-name", "output_names", multiple=True, metavar="NAME",
              help="With --module, names of the forward's outputs in order (default: where each was returned: "
                   "output for a lone tensor, a dict's key, output_<i> for a tuple's items, <name>.<i> inside "
                   "them, None values skipped).")
@click.option("--max-length", type=click.IntRange(min=1),
              help="With --module or --hf, the longest sequence the module takes (default: read off its position "
                   "table, an nn.Embedding indexed by position, if any): parity checks no longer one, and it is "
                   "recorded in the file so that a longer sequence is refused.")
@click.option("--eos-id", "eos_ids", type=click.IntRange(min=0), multiple=True,
              help="With --kv-cache, a token id that ends generation (repeatable), recorded in the file: generate's "
                   "default --eos-id, and onnxruntime-genai's eos_token_id with --genai.")
@click.option("--pad-id", type=click.IntRange(min=0),
              help="With --kv-cache, the id that pads prompts and finished rows, recorded in the file "
                   "(onnxruntime-genai finds a prompt's padding by it: take one no prompt ends with).")
@click.option("--start-id", type=click.IntRange(min=0),
              help="With --kv-cache, an encoder-decoder's decoder start id, recorded in the file (generate starts "
                   "every target from it). A causal LM starts from its prompt: generate does not use it, and "
                   "--genai writes it as bos_token_id.")
@click.option("--position-ids/--no-position-ids", default=None,
              help="With --module or --hf and --kv-cache (a causal LM: on unless --no-position-ids): the file takes "
                   "position_ids int64 [batch, seq] (each row's own positions, as onnxruntime-genai and generate "
                   "feed them) where the module's positions are an arange indexing a table or computed from it "
                   "(rotary cos/sin), so that rows of "
                   "different lengths share a batch exactly (and the cache can be ragged).")
@click.option("--cache-layout", type=click.Choice(CACHE_LAYOUT_CHOICES), default="auto", show_default=True,
              help="With --module or --hf and --kv-cache (a causal LM): ragged = each attention is "
                   "GroupQueryAttention "
                   "updating the cache in place (prompts right-padded, each row's cache from position 0); holes = "
                   "each step returns past ++ new (padding on either side); auto = ragged where the module's "
                   "positions and mask allow it (checked call by call), else holes with a warning saying why.")
@click.option("--logits", type=click.Choice(("auto", "last", "all")), default="auto", show_default=True,
              help="With --module or --hf and --kv-cache: last = the LM head runs on each row's last real token "
                   "of the call only (logits [batch, 1, vocab]: what generation reads; a prompt's first token "
                   "sooner, its logits memory gone); all = on every position ([batch, seq, vocab]: what scoring a "
                   "prompt's own tokens, e.g. serve's echo with logprobs, needs); auto = last for a causal LM, all "
                   "for an encoder-decoder's decoder.")
@click.option("--genai", is_flag=True,
              help="With --module or --hf and --kv-cache (a causal LM), also write genai_config.json beside the "
                   "file so that "
                   "onnxruntime-genai generates from it unchanged (context_length from the max length; needs one "
                   "recorded). The same as `mha-deploy genai-config` afterwards.")
@click.option("--hf", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="A Hugging Face model folder as save_pretrained writes it (config.json, the weights, tokenizer "
                   "files, generation_config.json), read locally, nothing downloaded. The config's architectures "
                   "picks the transformers class; the file takes the forward's inputs under Hugging Face's names "
                   "(input_ids, attention_mask; decoder_input_ids, decoder_attention_mask for an encoder-decoder) "
                   "and gives its outputs under the output's field names (logits, last_hidden_state, ...). With "
                   "--kv-cache (a causal LM or an encoder-decoder) the eos, pad and decoder start ids are read from "
                   "generation_config.json or config.json. The tokenizer files, chat template and generation / "
                   "preprocessor configs are copied beside the file, where generate and serve find them. A "
                   "sentence-transformers folder (modules.json) gives its pooled, optionally normalised vector as "
                   "one output, sentence_embedding, which serve's /v1/embeddings takes.")
@pack_tokens_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the .onnx file (written only if parity passes).")
@click.pass_context
def export(ctx, checkpoint, prefix, d_model, heads, model_kind, layers, d_ff, attention, mask, return_weights, kv_cache,
           fuse, quantize, block_size, symmetric, keep_head_fp32, quant_method, quantize_embeddings, calibration,
           eval_data, eval_tokens, seed, opset, dtype, atol, rtol,
           module_spec, inputs, output_names, max_length, eos_ids, pad_id, start_id, position_ids, cache_layout,
           hf, genai, pack_tokens, output, logits="auto"):
    """Export a model to ONNX with dynamic batch and sequence axes, checked against torch: the reference MHA or a
    stack of it (built from the flags), your own module (--module), or a Hugging Face folder (--hf).

    \b
    Examples:
      mha-deploy export -o mha.onnx
      mha-deploy export --attention cross --mask padding -o cross.onnx
      mha-deploy export --fuse onnx --mask padding-causal -o mha.onnx
      mha-deploy export --mask padding-causal --kv-cache -o decode.onnx
      mha-deploy export --quantize int8-dynamic -o mha-int8.onnx
      mha-deploy export --dtype fp16 --fuse mha --mask padding -o mha-fp16.onnx
      mha-deploy export --model decoder --layers 6 --mask padding -o decoder.onnx
      mha-deploy export --checkpoint attn.safetensors --heads 8 --mask padding-causal -o mha.onnx
      mha-deploy export --module model.py:build --input ids:tokens --input mask:padding-mask -o model.onnx
      mha-deploy export --module gpt.py:build --input ids:tokens --input mask:padding-mask --kv-cache \
          --eos-id 2 --pad-id 0 --genai -o lm/model.onnx
      mha-deploy export --module gpt.py:build --input ids:tokens --input mask:padding-mask --kv-cache \
          --quantize int4 -o lm-int4.onnx
      mha-deploy export --module mt.py:build --input src:tokens:src_seq --input src_mask:padding-mask:src_seq \
          --input tgt:tokens:tgt_seq --input tgt_mask:padding-mask:tgt_seq --kv-cache --start-id 1 -o mt.onnx
      mha-deploy export --hf ./bert-classifier -o classifier/model.onnx
      mha-deploy export --hf ./llama --kv-cache --quantize int4 -o llama/model.onnx
      mha-deploy export --hf ./bart --kv-cache -o bart/model.onnx
    """
    from mha_deploy.exporters import export_builtin, export_model, load_factory

    quantize_as = quantization(quantize, block_size, symmetric, keep_head_fp32, quant_method)
    if quantize_embeddings or calibration is not None or eval_data is not None:
        quantize_as = _with_text(quantize_as, quantize_embeddings, calibration, eval_data, eval_tokens, hf, output)
    options = {"opset": opset, "atol": atol, "rtol": rtol, "fuse": fuse, "dtype": dtype, "pack_tokens": pack_tokens,
               "quantize": quantize_as}
    if module_spec is not None and hf is not None:
        raise click.UsageError("--module and --hf are two sources of a model: give one")
    source = HF if hf is not None else MODULE if module_spec is not None else BUILTIN
    refuse_other_sources(ctx, source)
    generation = None
    if eos_ids or pad_id is not None or start_id is not None:
        if not kv_cache:
            raise click.UsageError("--eos-id, --pad-id and --start-id are recorded for generation: give --kv-cache")
        generation = GenerationIds(list(eos_ids), pad_id, start_id)
    if position_ids and not kv_cache:
        raise click.UsageError("--position-ids is an input of a KV-cache decoder: give --kv-cache")
    if _given(ctx, "cache_layout") and not kv_cache:
        raise click.UsageError("--cache-layout is how a KV-cache decoder keeps its cache: give --kv-cache")
    if _given(ctx, "logits") and not kv_cache:
        raise click.UsageError("--logits is which positions a KV-cache decoder computes logits at: give --kv-cache")
    if source != BUILTIN:
        options["logits"] = logits
    if genai and not kv_cache:
        raise click.UsageError("--genai writes onnxruntime-genai's config for a KV-cache decoder: give --kv-cache")
    if hf is not None:
        from mha_deploy.exporters.hf_folder import export_hf_folder, read_config

        if genai and read_config(hf).get("is_encoder_decoder"):
            raise click.UsageError("--genai describes a decoder-only model to onnxruntime-genai; this folder holds "
                                   "an encoder-decoder")
        click.echo(f"exporting the model of {hf}", err=True)
        done = export_hf_folder(hf, output, kv_cache=kv_cache, generation=generation, max_length=max_length,
                                position_ids=position_ids, cache_layout=cache_layout, **options)
        click.echo(f"{done.architecture}: inputs {', '.join(done.inputs)}", err=True)
        if done.generation is not None:
            click.echo(f"{done.generation.describe()} recorded (the folder's generation config and config; --eos-id, "
                       "--pad-id, --start-id to record others)", err=True)
        result = done.result
    elif module_spec is not None:
        if not inputs:
            raise click.UsageError("--module needs its forward's inputs: --input NAME:ROLE for each")
        if genai and sum(spec.split(":")[1:2] == ["tokens"] for spec in inputs) > 1:
            raise click.UsageError("--genai describes a decoder-only model to onnxruntime-genai; an encoder-decoder "
                                   "(two token inputs) is exported as an encoder and a decoder it does not run")
        module = load_factory(module_spec)
        click.echo(f"exporting {type(module).__name__} from {module_spec}, inputs {', '.join(inputs)}", err=True)
        result = export_model(module, output, inputs, output_names=output_names or None, checkpoint=checkpoint,
                              max_length=max_length, kv_cache=kv_cache, position_ids=position_ids,
                              generation=generation, cache_layout=cache_layout, **options)
    elif model_kind == "mha":
        if layers != 1:
            raise click.UsageError("--layers is for --model encoder or decoder")
        signature = Signature(attention, mask, return_weights, kv_cache=kv_cache)
        mha = load_model(checkpoint, d_model, heads, seed, prefix=prefix)
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
        stack = build_stack(model_kind, layers, d_model, heads, d_ff, seed)
        click.echo(f"exporting a {layers}-layer {model_kind}, mask={mask}" + (" kv-cache" if kv_cache else ""),
                   err=True)
        result = export_builtin(stack, output, signature, **options)
    echo_export(result)
    if hf is not None and done.beside:
        click.echo(f"wrote beside it: {', '.join(path.name for path in done.beside)}")
    if genai:
        write_genai_beside(result.path)


def _with_text(quantize_as, embeddings: bool, calibration: Path | None, eval_data: Path | None, eval_tokens: int,
               hf: Path | None, output: Path):
    """``quantize_as`` with the embedding tables, GPTQ's calibration prompts and the evaluation text asked for; texts
    tokenized by the --hf folder's tokenizer.json, else one beside ``output``."""
    from dataclasses import replace

    from mha_deploy.exporters.quantize import read_text_data
    from mha_deploy.runtime.beside_model import TOKENIZER_FILE, BesideModel

    tokenizer = Path(hf) / TOKENIZER_FILE if hf is not None else BesideModel.of(output).tokenizer
    tokenizer = tokenizer if tokenizer is not None and tokenizer.is_file() else None
    return replace(
        quantize_as, embeddings=embeddings,
        calibration=read_text_data(calibration, tokenizer) if calibration is not None else None,
        evaluation=read_text_data(eval_data, tokenizer, eval_tokens) if eval_data is not None else None)


def write_genai_beside(model: Path) -> None:
    """``genai_config.json`` beside the model just written; the model is removed again when the config cannot be
    written, so that a failed ``export --genai`` leaves nothing."""
    from mha_deploy.runtime.genai_config import write_genai_config

    try:
        path, warnings = write_genai_config(model)
    except BaseException:
        model.unlink(missing_ok=True)
        click.echo(f"removed {model}: --genai could not describe it to onnxruntime-genai", err=True)
        raise
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {path} (onnxruntime-genai)")


def echo_export(result) -> None:
    """What export and optimize print: warnings, the fusion, token packing, parity, the file."""
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    # An encoder-decoder pair's fusion (own_seq2seq_cache.PairFusion) is checked whole: it has no such warning.
    if getattr(result.fusion, "warning", None):
        click.echo(f"warning: {result.fusion.warning}", err=True)
    click.echo(result.fusion.summary())
    if result.packing is not None:
        click.echo(result.packing.describe())
    # a file's metadata, or an encoder-decoder pair's result (own_seq2seq_cache), which has no ModelMetadata
    quantized = getattr(result, "metadata", result)
    if getattr(quantized, "weight_only", None) is not None:
        click.echo(f"quantized {quantized.quantization}: {quantized.weight_only.describe()}")
        if quantized.weight_only.evaluation is not None:
            click.echo(f"quality {quantized.weight_only.evaluation.describe()}")
    click.echo(result.parity.summary())
    max_length = result.metadata.max_length if hasattr(result, "metadata") else result.max_length
    if max_length is not None:
        click.echo(f"max length {max_length} recorded: longer sequences are refused")
    layout = getattr(getattr(result, "metadata", None), "cache_layout", None)
    if layout is not None:
        click.echo(f"cache layout {layout}")
    if getattr(result, "encoder_path", None) is not None:  # an encoder-decoder's pair (own_seq2seq_cache)
        click.echo(f"wrote {result.encoder_path} (the encoder, run once per request)")
        click.echo(f"wrote {result.path} (the decoder with its cache; generate takes it and finds its encoder)")
        return
    click.echo(f"wrote {result.path}")


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


def _flags(names: list[str]) -> str:
    flags = {"model_kind": "--model", "inputs": "--input", "output_names": "--output-name", "eos_ids": "--eos-id",
             "module_spec": "--module"}
    return ", ".join(flags.get(name, "--" + name.replace("_", "-")) for name in names)
