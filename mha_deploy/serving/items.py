"""Files of items keyed by id: ``.npz`` or ``.safetensors``, read and written without torch.

Self-attention items are stored as ``<id>`` -> [seq, d_model]; cross-attention
items as ``<id>.query``, ``<id>.key``, ``<id>.value``. Outputs use ``<id>``
(and ``<id>.attn_weights`` when the model returns weights).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from mha_deploy.atomic import atomic_path
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature

ITEM_SUFFIXES = (".npz", ".safetensors")
CROSS_PARTS = ("query", "key", "value")


def _check_suffix(path: Path, role: str) -> None:
    if path.suffix not in ITEM_SUFFIXES:
        raise InputError(f"{role} file {path} must end in {' or '.join(ITEM_SUFFIXES)}")


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    path = Path(path)
    _check_suffix(path, "input")
    if not path.is_file():
        raise InputError(f"input file not found: {path}")
    try:
        if path.suffix == ".npz":
            # allow_pickle=False: an .npz of object arrays would otherwise run code on load.
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        from safetensors.numpy import load_file

        return load_file(str(path))
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{path}: cannot read arrays ({exc})") from exc
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise InputError(f"{path}: cannot read arrays ({exc})") from exc


def group_items(arrays: dict[str, np.ndarray], signature: Signature, source: str) -> dict[str, dict[str, np.ndarray]]:
    """Arrays by file key -> items by id, each a dict of the model's sequence inputs."""
    if signature.attention == "self":
        return {item_id: {"x": array} for item_id, array in arrays.items()}
    items: dict[str, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        item_id, _, part = name.rpartition(".")
        if part not in CROSS_PARTS or not item_id:
            raise InputError(
                f"{source}: key {name!r} is not <id>.query, <id>.key or <id>.value, which a cross-attention model needs"
            )
        items.setdefault(item_id, {})[part] = array
    for item_id, parts in items.items():
        missing = [p for p in CROSS_PARTS if p not in parts]
        if missing:
            raise InputError(f"{source}: item {item_id!r} lacks {', '.join(f'{item_id}.{p}' for p in missing)}")
    return items


def read_items(path: str | os.PathLike, signature: Signature) -> dict[str, dict[str, np.ndarray]]:
    arrays = read_arrays(path)
    if not arrays:
        raise InputError(f"{path}: holds no items")
    return group_items(arrays, signature, str(path))


def write_arrays(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically: a temporary file beside ``path``, then a rename."""
    path = Path(path)
    _check_suffix(path, "output")
    with atomic_path(path) as tmp:
        if path.suffix == ".npz":
            np.savez(tmp, **arrays)
        else:
            from safetensors.numpy import save_file

            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
