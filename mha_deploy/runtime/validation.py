"""Checks inputs against a model's metadata before ONNX Runtime sees them.

ORT's own errors name internal node ids and often come late (or not at all,
e.g. for a mask of the wrong length that still broadcasts); these say what the
caller passed and what the model expects.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.metadata import ModelMetadata


def validate_inputs(metadata: ModelMetadata, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Return the inputs as ORT-ready arrays, or raise ``InputError`` saying what is wrong."""
    signature = metadata.signature
    expected = set(signature.input_names)
    missing = [name for name in signature.input_names if name not in inputs]
    unexpected = sorted(set(inputs) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected)}")
        raise InputError(f"{'; '.join(parts)}: this model takes {', '.join(signature.input_names)}")

    dtype = np.dtype(metadata.dtype)
    arrays = {name: _sequence_array(name, inputs[name], dtype, metadata.d_model) for name in signature.sequence_inputs}
    batch = {name: array.shape[0] for name, array in arrays.items()}
    if len(set(batch.values())) > 1:
        raise InputError(f"batch sizes differ: {_describe(batch)}")
    key_value = signature.model == "mha" and signature.attention == "cross"
    if key_value and arrays["key"].shape[1] != arrays["value"].shape[1]:
        raise InputError(
            f"key and value must have the same length, got {arrays['key'].shape[1]} and {arrays['value'].shape[1]}"
        )
    for mask_name, sequence_name in signature.padding_masks.items():
        arrays[mask_name] = _padding_mask(mask_name, inputs[mask_name], arrays[sequence_name].shape[:2], sequence_name)
    return arrays


def _sequence_array(name: str, value: object, dtype: np.dtype, d_model: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype != dtype:
        hint = f" (cast with .astype(np.{dtype.name}))" if array.dtype.kind in "fiu" else ""
        raise InputError(f"{name} must be {dtype.name}, got {array.dtype}{hint}")
    if array.ndim != 3:
        raise InputError(f"{name} must have rank 3 [batch, seq, {d_model}], got shape {array.shape}")
    if array.shape[2] != d_model:
        raise InputError(f"{name} has d_model {array.shape[2]}, this model expects {d_model} (shape {array.shape})")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError(f"{name} is empty (shape {array.shape}): batch and sequence length must be at least 1")
    return np.ascontiguousarray(array)


def _padding_mask(name: str, value: object, kv_shape: tuple[int, int], kv_name: str) -> np.ndarray:
    mask = np.asarray(value)
    if mask.dtype.kind in "iu":
        # Tokenizers hand out int 0/1 attention masks; the meaning is the same.
        if not np.isin(mask, (0, 1)).all():
            raise InputError(f"{name} of integer type must hold only 0 and 1")
        mask = mask.astype(bool)
    elif mask.dtype != np.bool_:
        raise InputError(f"{name} must be bool (True = real token), got {mask.dtype}")
    if mask.shape != tuple(kv_shape):
        raise InputError(
            f"{name} must have shape [batch, kv_len] = {tuple(kv_shape)} to match {kv_name}, got {mask.shape}"
        )
    empty_rows = np.flatnonzero(~mask.any(axis=1))
    if empty_rows.size:
        raise InputError(f"{name} rows {empty_rows.tolist()[:10]} have no real token: every item needs at least one")
    return np.ascontiguousarray(mask)


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name} {size}" for name, size in sizes.items())
