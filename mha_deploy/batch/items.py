"""Files of arrays keyed by name: ``.npz`` or ``.safetensors``, read and written whole, without torch.

Item files use these keys: for a model with one sequence input, ``<id>`` ->
[seq, d_model]; with several, ``<id>.<input>`` (cross-attention ``<id>.query``,
``<id>.key``, ``<id>.value``; a decoder ``<id>.x``, ``<id>.memory``); outputs
``<id>`` (and ``<id>.attn_weights``). The runner streams them through
``batch.datasets``; these two functions are for making inputs and reading
outputs whole.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from mha_deploy.atomic import atomic_path
from mha_deploy.errors import InputError

ITEM_SUFFIXES = (".npz", ".safetensors")


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
        if "allow_pickle=False" in str(exc):  # numpy's refusal of an object array
            raise InputError(
                f"{path}: cannot read arrays (it holds pickled Python objects, which are never unpickled: "
                "unsafe, as unpickling can run any code)"
            ) from exc
        raise InputError(f"{path}: cannot read arrays ({exc})") from exc
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise InputError(f"{path}: cannot read arrays ({exc})") from exc


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
