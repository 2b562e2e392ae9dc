"""Inputs generated from a model's Signature: seeded, with padding on either side. numpy only.

The one data loader: export-time parity, the bench, the precision budgets, the
session's warm-up and the tests all draw their inputs here, so a new input kind
is generated once, from its ``TensorSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_deploy.errors import OptionError
from mha_deploy.signature import ID_ROLES, PADDING_MASK, Signature, TensorSpec

PADDING_SIDES = ("none", "right", "left", "mixed")


@dataclass(frozen=True)
class InputCase:
    """One shape to generate: batch, query length, key length, and where padding goes (if the model has a mask)."""

    batch: int
    q_len: int
    kv_len: int
    padding: str = "right"

    def label(self, signature: Signature) -> str:
        if not signature.sequence_axes:  # images, audio: only the batch varies
            return f"batch {self.batch}"
        one_sequence = len(signature.sequence_axes) == 1
        shape = f"{self.batch}x{self.q_len}" if one_sequence else f"{self.batch}x{self.q_len}x{self.kv_len}"
        return f"{shape}/{self.padding}" if signature.has_padding_mask and self.padding != "none" else shape


def right_padding_mask(lengths, width: int) -> np.ndarray:
    """bool [rows, width], True = real token: row r's first ``lengths[r]`` positions, the mask of a right-padded
    batch (``lengths`` [rows], each <= width to fill no more than the row)."""
    return np.arange(width)[None, :] < np.asarray(lengths)[:, None]


def padding_mask(batch: int, length: int, padding: str, rng: np.random.Generator) -> np.ndarray:
    """bool [batch, length], True = real token, random lengths >= 1; row 0 is always full length."""
    if padding not in PADDING_SIDES:
        raise OptionError(f"padding must be one of {', '.join(PADDING_SIDES)}, got {padding!r}")
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0] = length
    right = right_padding_mask(lengths, length)
    left = np.arange(length)[None, :] >= (length - lengths)[:, None]
    if padding == "none":
        return np.ones((batch, length), dtype=bool)
    if padding == "right":
        return right
    if padding == "left":
        return left
    return np.where((np.arange(batch) % 2 == 0)[:, None], left, right)


def random_values(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator, dtype: str) -> np.ndarray:
    """Values for a tokens, segments, sequence, image, audio or cache input: ids uniform over their own table,
    else standard normal."""
    if spec.role in ID_ROLES:
        return rng.integers(0, spec.vocab or 2, size=shape, dtype=np.int64)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)


def random_item(
    signature: Signature, fixed: dict[str, int], lengths: dict[str, int], rng: np.random.Generator, dtype: str
) -> dict[str, np.ndarray]:
    """One unbatched item: each input an item carries (``Signature.item_inputs``), a length input at its axis's
    length in ``lengths``."""
    specs = signature.tensors
    return {
        name: random_values(specs[name], specs[name].item_shape(lengths.get(specs[name].sequence_axis, 0), fixed),
                            rng, dtype)
        for name in signature.item_inputs
    }


def make_inputs(
    signature: Signature, d_model: int, case: InputCase, seed: int = 0, dtype: str = "float32", heads: int = 1
) -> dict[str, np.ndarray]:
    """Standard-normal sequences (and KV caches: ``case.kv_len`` cached tokens), token ids and padding masks
    for every input of ``signature`` at ``case``'s shape."""
    rng = np.random.default_rng(seed)
    sizes = signature.axis_sizes(case.batch, case.q_len, case.kv_len, d_model=d_model, heads=heads)
    feeds: dict[str, np.ndarray] = {}
    for spec in signature.inputs:
        if spec.role == PADDING_MASK:
            feeds[spec.name] = padding_mask(case.batch, sizes[spec.axes[1]], case.padding, rng)
        else:
            feeds[spec.name] = random_values(spec, spec.shape(sizes), rng, dtype)
    return feeds


def placeholder_inputs(
    signature: Signature,
    d_model: int,
    dtype: str,
    batch: int = 1,
    q_len: int = 1,
    kv_len: int | None = None,
    heads: int = 1,
) -> dict[str, np.ndarray]:
    """Zeros of the given shape with masks that hide nothing (in each mask's dtype: bool, or int64 1/0): for warm-up
    runs and device buffers, which ORT is handed as they are."""
    sizes = signature.axis_sizes(batch, q_len, kv_len, d_model=d_model, heads=heads)
    return {
        spec.name: np.ones(spec.shape(sizes), spec.dtype)
        if spec.role == PADDING_MASK
        else np.zeros(spec.shape(sizes), np.dtype(spec.numpy_dtype(dtype)))
        for spec in signature.inputs
    }


def cast_floats(feeds: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """``feeds`` with float arrays in ``dtype`` (a model's dtype); bool masks unchanged."""
    return {name: a.astype(dtype) if a.dtype.kind == "f" else a for name, a in feeds.items()}


def real_rows(signature: Signature, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each length axis of the sequence inputs -> bool [batch, length]: its positions that any mask of a
    sequence on that axis calls real (a padded position is one every such mask calls padding; an axis no mask
    marks is real throughout). The rows users read of an output along that axis (``split_outputs`` cuts each
    item's outputs to its real lengths on every axis)."""
    masks: dict[str, list[np.ndarray]] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for name in signature.sequence_inputs:
        axis = signature.axis_of(name)
        shapes[axis] = feeds[name].shape[:2]
        length = shapes[axis][1]
        # A KV cache's mask covers the cached tokens first: the sequence is its last positions.
        masks.setdefault(axis, []).extend(
            feeds[mask][:, feeds[mask].shape[1] - length:].astype(bool, copy=False)  # int64 1/0 masks too
            for mask, marks in signature.padding_masks.items() if marks == name)
    return {axis: np.logical_or.reduce(masks[axis]) if masks[axis] else np.ones(shape, dtype=bool)
            for axis, shape in shapes.items()}


def real_query_rows(signature: Signature, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """bool [batch, q_len]: the query positions whose outputs users read (``real_rows`` of the query axis)."""
    return real_rows(signature, feeds)[signature.query_axis]
