"""The built-in models a command builds from its flags: a reference MHA (a checkpoint or seeded random
weights) or a seeded random stack. torch is imported only when one is built."""

from __future__ import annotations

import contextlib

import click

from mha_deploy.cli.options import DEFAULT_D_MODEL, DEFAULT_HEADS
from mha_deploy.errors import ModelConfigError


def build_stack(kind: str, layers: int, d_model: int | None, heads: int | None, d_ff: int | None, seed: int):
    from mha_deploy.models.build import random_stack

    with sizes_from_flags():
        return random_stack(kind, layers, DEFAULT_D_MODEL if d_model is None else d_model,
                            DEFAULT_HEADS if heads is None else heads, d_ff, seed)


def load_model(checkpoint, d_model: int | None, heads: int | None, seed: int, prefix: str | None = None):
    from mha_deploy.models import load_checkpoint
    from mha_deploy.models.build import random_mha

    if checkpoint is None:
        if prefix is not None:
            raise click.UsageError("--prefix picks the attention out of a --checkpoint; give one")
        with sizes_from_flags():
            return random_mha(
                DEFAULT_D_MODEL if d_model is None else d_model, DEFAULT_HEADS if heads is None else heads, seed
            )
    mha = load_checkpoint(checkpoint, num_heads=heads, prefix=prefix)
    if d_model is not None and d_model != mha.d_model:
        raise click.UsageError(f"--d-model {d_model} disagrees with the checkpoint's d_model {mha.d_model}")
    return mha


@contextlib.contextmanager
def sizes_from_flags():
    """Sizes the model refuses (e.g. heads not dividing d_model) came from the flags: a usage error (exit 2)."""
    try:
        yield
    except ModelConfigError as exc:
        raise click.UsageError(str(exc)) from None
