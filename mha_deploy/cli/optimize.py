"""``mha-deploy optimize``: fuse the attentions of a graph exported elsewhere."""

from __future__ import annotations

from pathlib import Path

import click

from mha_deploy.cli.export import echo_export
from mha_deploy.cli.group import main
from mha_deploy.cli.options import pack_tokens_option, quantization, quantize_options
from mha_deploy.metadata import FUSE_CHOICES


@main.command()
@click.argument("source", metavar="IN.onnx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input", "inputs", multiple=True, required=True, metavar="NAME:ROLE[:AXIS][:FEATURES]",
              help="One per input of the graph, as for export --module. ROLE: tokens (int64 or int32 ids), segments "
                   "(segment ids on a tokens input's AXIS, e.g. token_type_ids; their own table), sequence "
                   "(float32 [batch, seq, FEATURES]; FEATURES read off the graph when it fixes them), "
                   "padding-mask (bool or integer, True/1 = real token; the written model takes bool), image "
                   "(float32 [batch, C, H, W]) or audio (float32 [batch, MEL, FRAMES]); an image's or audio's "
                   "sizes are the graph's, or declared as NAME:image:CxHxW / NAME:audio:MELxFRAMES where it does "
                   "not fix them. AXIS (default seq) names a length axis, e.g. tgt:tokens:tgt_seq.")
@click.option("--output-name", "output_names", multiple=True, metavar="NAME",
              help="Rename the graph's outputs, in order (default: the graph's names).")
@click.option("--fuse", type=click.Choice(FUSE_CHOICES), default="auto", show_default=True,
              help="As for export: mha, onnx (opset 23 graphs) or none; auto picks mha and falls back to none with "
                   "a warning if fusion or parity fails, mha and onnx fail instead.")
@click.option("--max-length", type=click.IntRange(min=1),
              help="The longest sequence the graph takes (e.g. its position table): parity checks no longer one, "
                   "and it is recorded in the file so that a longer sequence is refused.")
@click.option("--atol", type=click.FloatRange(min=0),
              help="Parity tolerance, absolute, in units of each output row's magnitude (its largest |value|, at "
                   "least 1; default 1e-5).")
@click.option("--rtol", type=click.FloatRange(min=0), help="Parity tolerance, relative (default 1e-4).")
@quantize_options
@pack_tokens_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write the .onnx file (written only if parity passes).")
def optimize(source, inputs, output_names, fuse, max_length, atol, rtol, quantize, block_size, symmetric,
             keep_head_fp32, quant_method, pack_tokens, output):
    """Fuse the attentions of an ONNX graph exported elsewhere (e.g. torch.onnx.export of your model), checked
    against that graph in ONNX Runtime at unseen shapes, left and right padding.

    \b
    Example:
      mha-deploy optimize model.onnx --input input_ids:tokens --input attention_mask:padding-mask -o fused.onnx
      mha-deploy optimize model.onnx --input input_ids:tokens --input attention_mask:padding-mask \
          --quantize int4 -o fused-int4.onnx
    """
    from mha_deploy.exporters.optimize import optimize_model

    click.echo(f"optimizing {source}, inputs {', '.join(inputs)}", err=True)
    result = optimize_model(source, output, inputs, output_names=output_names or None, fuse=fuse, atol=atol,
                            rtol=rtol, max_length=max_length, pack_tokens=pack_tokens,
                            quantize=quantization(quantize, block_size, symmetric, keep_head_fp32, quant_method))
    echo_export(result)
