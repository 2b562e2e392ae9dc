"""Option groups shared by several ``mha-deploy`` commands.

Each flag is declared once here, so ``--provider`` or ``--heads`` means the same
in every command that takes it. Only torch-free, onnxruntime-free modules are
imported, so that ``mha-deploy --help`` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from mha_deploy.checkpoint_names import names_text
from mha_deploy.metadata import PROVIDER_CHOICES, QUANT_METHODS, QUANTIZE_CHOICES

DEFAULT_D_MODEL, DEFAULT_HEADS = 512, 8

Decorator = Callable[[Callable], Callable]


def option_group(*options: Decorator) -> Decorator:
    """One decorator applying ``options``, listed in ``--help`` in the order given."""

    def apply(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


# The reference MHA a command builds (see ``cli.builtin.load_model``): from a checkpoint, or seeded random weights.
model_options = option_group(
    click.option("--checkpoint", type=click.Path(dir_okay=False, path_type=Path),
                 help="State dict (.safetensors, .pt, .pth) of one attention block, or of a bigger model with "
                      "--prefix; omit for a seeded random model. Projections are read by these names: "
                      f"{names_text()}."),
    click.option("--prefix",
                 help="Take the attention block under this key prefix out of a bigger --checkpoint, e.g. "
                      "encoder.layers.0.self_attn. (keys outside it are ignored); without it, a checkpoint holding "
                      "other keys is refused with the prefixes it holds listed."),
    click.option("--d-model", type=click.IntRange(min=1),
                 help=f"Model width (default {DEFAULT_D_MODEL}; with --checkpoint, read from it)."),
    click.option("--heads", type=click.IntRange(min=1),
                 help=f"Number of heads, dividing the model width: default {DEFAULT_HEADS} for a random model; "
                      "with --checkpoint, required unless the file records num_heads (safetensors metadata)."),
)


class RenamedOption(click.Option):
    """An option that still takes its old spelling(s), kept for one release and left out of ``--help``."""

    def __init__(self, param_decls, old_names: tuple[str, ...] = (), **attrs):
        super().__init__([*param_decls, *old_names], **attrs)
        self.old_names = tuple(old_names)

    def get_help_record(self, ctx: click.Context):
        every, self.opts = self.opts, [name for name in self.opts if name not in self.old_names]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = every


def ray_options(engine_help: str, actor_holds: str) -> Decorator:
    """--engine, --ray-address, --concurrency and --num-gpus: where a dataset job runs (``batch.ray_engine``), as
    ``infer`` and ``generate`` take them; what an actor holds is the command's own."""
    return option_group(
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help=engine_help),
        click.option("--ray-address", help="Ray cluster to join (default: $RAY_ADDRESS or the one last started on "
                                           "this machine, else a local one for this run)."),
        click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
                     help=f"Ray actors, each holding {actor_holds}."),
        click.option("--num-gpus", type=click.FloatRange(min=0), default=0, show_default=True,
                     help="GPUs per Ray actor (use with --provider cuda)."),
    )


def session_options(provider: str = "auto", threads: int | None = None) -> Decorator:
    """--provider and --threads: where ONNX Runtime runs and how wide; the defaults may differ per command."""
    return option_group(
        click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default=provider, show_default=True,
                     help="Execution provider. auto: CUDA if it can load here, else CPU with a note saying why; "
                          "cuda: CUDA or an error saying what is missing."),
        click.option("--threads", type=click.IntRange(min=1), default=threads,
                     show_default=True if threads is not None else "one per core",
                     help="Intra-op threads of ONNX Runtime (and of torch where it runs)."),
    )


# export and optimize: token packing (exporters.token_packing)
pack_tokens_option = click.option(
    "--pack-tokens/--no-pack-tokens", default=True, show_default=True,
    help="Run the per-token layers (projections, feed-forwards, norms) on the real tokens only, gathered where "
         "such a run starts and put back where an attention, a pooling or an output reads them: a quarter "
         "padded, 1.16-1.28x faster at d_model 512 (an unpadded batch 1-2% slower). Only along an axis with a "
         "padding mask that the model may be padded on, only where the MatMul work outweighs the copies "
         "(a stack or your own model from d_model 256, a lone block from 1024), not for fp16 or --kv-cache, and "
         "dropped with a warning if parity fails with it.")


# export and optimize: --quantize and the weight-only knobs (exporters.quantize.Quantization; docs/precision.md).
quantize_options = option_group(
    click.option("--quantize", type=click.Choice(QUANTIZE_CHOICES), default="none", show_default=True,
                 help="int4 / int8: weight-only, every MatMul with a constant weight as ORT's MatMulNBits (blocks "
                      "of --block-size, accuracy_level 4), attentions and I/O unchanged: the decoder's choice "
                      "(about a sixth / a third of the fp32 weight bytes per token). int8-dynamic: dynamic int8 "
                      "projections (an encoder's large batches). Parity then means a relative error within a "
                      "budget (int4 25%, int8 and int8-dynamic 5%), recorded with the logits' top-1 agreement."),
    click.option("--block-size", type=click.IntRange(min=16), default=32, show_default=True,
                 help="With --quantize int4/int8: weights per scale along K (a power of two)."),
    click.option("--symmetric", is_flag=True,
                 help="With --quantize int4/int8: scales only, no zero points (as onnxruntime-genai's builder writes): "
                      "slightly smaller and faster (0.83-0.97x the time per decoded token at int4), the same "
                      "perplexity on a trained model, up to 1.3x the logit error on random weights "
                      "(docs/precision.md)."),
    click.option("--keep-head-fp32", is_flag=True,
                 help="With --quantize int4/int8: leave the LM head (the MatMul producing the logits output) in "
                      "fp32; its error reaches the logits undamped."),
    click.option("--quant-method", type=click.Choice(QUANT_METHODS), default="rtn", show_default=True,
                 help="With --quantize int4/int8: rtn rounds each block to nearest; hqq fits scale and zero "
                      "point (int4 only); gptq corrects each layer's rounding against the activations of "
                      "--calibration prompts (int4 only)."),
)


def quantization(quantize: str, block_size: int, symmetric: bool, keep_head_fp32: bool, quant_method: str):
    """What the ``quantize_options`` ask for, as the exporters take it (``exporters.quantize.Quantization``)."""
    from mha_deploy.exporters.quantize import Quantization

    return Quantization(quantize, block_size, symmetric, keep_head_fp32, quant_method)


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options in sections (click has no option groups): ``section_of`` maps a
    parameter's name to its section's title, ``sections`` orders the titles; a parameter it maps to None (or to a
    title not in ``sections``) is listed under the last section."""

    def __init__(self, *args, sections: tuple[str, ...], section_of: Callable[[str], str | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.sections, self.section_of = sections, section_of

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, list[tuple[str, str]]] = {title: [] for title in self.sections}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = self.section_of(param.name or "")
                records[title if title in records else self.sections[-1]].append(record)
        for title, rows in records.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
