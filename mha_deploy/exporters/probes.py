"""What a user's model does, measured by running it: numpy only, the model a ``run`` function of the feeds.

Two exporters read a Signature off a model they did not write: ``own_model`` runs an ``nn.Module`` in torch,
``optimize`` runs an ONNX graph exported elsewhere in ORT. Both ask the same two questions, answered here
once:

- which axes of an output follow which declared length axis (``output_axes``), from its shapes at two sets
  of sizes that differ in batch and in every length;
- along which length axes right-padding an item leaves every real output unchanged (``paddable_axes``):
  the axes the batch runner and the server may pad.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from mha_deploy.errors import ExportError
from mha_deploy.inputs import random_values
from mha_deploy.runtime.model_check import PROBE_REL_ERR, batching_change
from mha_deploy.runtime.validation import output_shape_problem
from mha_deploy.signature import BATCH_AXIS, PADDING_MASK, Signature, TensorSpec

# A model as these probes see it: feeds by input name (bool masks, int64 ids, float32 sequences) -> outputs by
# output name.
RunFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
# The real length of the probed item on each length axis, in the Signature's axis order: >= 2 and pairwise
# different, so that an output axis of one length cannot be mistaken for another's. Padding adds _PADDED.
_REAL_LENGTHS = (3, 5, 7, 11)
_PADDED = 4
# Right-padding that moves a real output by more than this relative error makes the axis unpaddable.
PADDING_REL_ERR = 1e-4


class ProbeSizes(Protocol):
    """A batch size and a length per declared length axis."""

    batch: int
    lengths: Mapping[str, int]


def output_axes(
    name: str, first_shape: Sequence[int], second_shape: Sequence[int], first: ProbeSizes, second: ProbeSizes
) -> tuple[str | int, ...]:
    """An output's axes from its shapes at two sizes: batch first, then a declared length axis where the size
    follows one from ``first`` to ``second`` (the batch where it follows the batch: an output spanning it,
    ``TensorSpec.spans_batch``), fixed sizes where it does not change."""
    first_shape, second_shape = tuple(map(int, first_shape)), tuple(map(int, second_shape))
    if not first_shape or first_shape[0] != first.batch or second_shape[0] != second.batch:
        raise ExportError(
            f"output {name} has shape {first_shape}: axis 0 must be the batch ({first.batch} here); "
            "return batch-first outputs (e.g. batch_first=True)"
        )
    if len(first_shape) != len(second_shape):
        raise ExportError(f"output {name} has rank {len(first_shape)} at one size and {len(second_shape)} at another")
    axes: list[str | int] = [BATCH_AXIS]
    for position, (size_a, size_b) in enumerate(zip(first_shape[1:], second_shape[1:], strict=True), start=1):
        if size_a == size_b:
            axes.append(size_a)
            continue
        axis = next((ax for ax, n in first.lengths.items() if n == size_a and second.lengths[ax] == size_b), None)
        if axis is None and (size_a, size_b) == (first.batch, second.batch):
            axis = BATCH_AXIS  # every item against every other of the call (CLIP's logits_per_image)
        if axis is None:
            raise ExportError(
                f"output {name}'s axis {position} is {size_a} for lengths {dict(first.lengths)} and {size_b} for "
                f"{dict(second.lengths)}: it follows no declared length axis"
            )
        axes.append(axis)
    return tuple(axes)


def probe_feeds(
    inputs: Sequence[TensorSpec],
    batch: int,
    lengths: Mapping[str, int],
    rng: np.random.Generator,
    real: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Random ids and sequences for ``inputs`` at ``batch`` x ``lengths``; padding masks True up to
    ``real[axis]`` (default: everywhere)."""
    feeds = {}
    for spec in inputs:
        shape = spec.shape({BATCH_AXIS: batch, **lengths})
        if spec.role == PADDING_MASK:
            length = lengths[spec.axes[1]]
            upto = length if real is None else real[spec.axes[1]]
            feeds[spec.name] = np.broadcast_to(np.arange(length) < upto, shape).copy()
        else:
            feeds[spec.name] = random_values(spec, shape, rng, "float32")
    return feeds


def paddable_axes(signature: Signature, run: RunFn, seed: int = 1) -> tuple[str, ...]:
    """The length axes of ``signature`` along which right-padding an item (random ids or values past its end,
    its padding masks False there) leaves each of its real outputs unchanged, measured by ``run``.

    A classifier that pools without its mask, or a model that is not causal and reads unmasked keys, is not
    paddable along that axis.
    """
    if len(signature.sequence_axes) > len(_REAL_LENGTHS):
        raise ExportError(f"{len(signature.sequence_axes)} length axes; at most {len(_REAL_LENGTHS)} are supported")
    rng = np.random.default_rng(seed)
    real = dict(zip(signature.sequence_axes, _REAL_LENGTHS, strict=False))
    paddable = []
    for axis in signature.sequence_axes:
        item = probe_feeds(signature.inputs, 1, real, rng)
        # Garbage past the end: random ids or values, the masks False there.
        extended = probe_feeds(signature.inputs, 1, {**real, axis: real[axis] + _PADDED}, rng, real=real)
        for spec in signature.inputs:
            if spec.role == PADDING_MASK:
                continue
            if spec.axes[1] == axis:
                extended[spec.name][:, : real[axis]] = item[spec.name]
            else:
                extended[spec.name] = item[spec.name]
        expected, got = run(item), run(extended)
        for feeds, outputs in ((item, expected), (extended, got)):
            if problem := output_shape_problem(signature, feeds, outputs):
                raise ExportError(problem)
        if all(_same_rows(spec, expected[spec.name], got[spec.name], axis, real[axis]) for spec in signature.outputs):
            paddable.append(axis)
    check_rows_independent(replace(signature, custom_paddable=tuple(paddable)), run)
    return tuple(paddable)


def check_rows_independent(signature: Signature, run: RunFn) -> None:
    """Refuse a model whose item's outputs move when another item shares its batch (padded where it may be):
    no runtime could batch it, and every session's load check (``model_check.check_batching``, the same probe)
    would refuse its file."""
    change = batching_change(run, signature, {}, "float32", PROBE_REL_ERR["float32"])
    if change is not None:
        raise ExportError(
            f"output {change.output} of an item changes by {change.error:.1%} when a {change.other} item shares "
            f"its batch (padded axes: {change.padded}): the model mixes the rows of a batch (a statistic over the "
            "whole batch, x[mask] or .item() of a batch-wide value); make each item's outputs depend on its own "
            "row only"
        )


def unpadded_mask_warnings(signature: Signature) -> list[str]:
    """A warning for each padding mask whose axis ``paddable_axes`` found unpaddable all the same."""
    return [
        f"right-padding the {axis!r} axis changes real outputs although {mask} masks it (does the model read "
        "its mask everywhere, e.g. in pooling?): items of different lengths will not share a batch"
        for mask, axis in ((mask, signature.axis_of(mask)) for mask in signature.padding_masks)
        if axis not in signature.paddable_axes
    ]


def _same_rows(spec: TensorSpec, expected: np.ndarray, got: np.ndarray, axis: str, real: int) -> bool:
    cut = tuple(slice(0, real) if a == axis else slice(None) for a in spec.axes)
    got = np.asarray(got)[cut]
    if got.shape != np.shape(expected):
        return False
    expected64, got64 = np.asarray(expected, np.float64), got.astype(np.float64)
    if not np.isfinite(got64).all():
        return False
    scale = max(float(np.linalg.norm(expected64)), 1e-30)
    return float(np.linalg.norm(got64 - expected64)) / scale <= PADDING_REL_ERR
