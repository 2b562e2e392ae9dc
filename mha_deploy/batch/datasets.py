"""Datasets of items as shards on disk, read lazily and written shard by shard.

A dataset is one file or a directory of shard files (``.npz``, ``.safetensors``,
``.parquet``, ``.jsonl``; names starting with ``.`` or ``_`` are ignored, as Spark and Ray
do). Outputs keep their shard's name and format, except a JSONL shard's, which is
``<stem>.npz``. Readers hand out items one at a time, so a runner never holds more than
its read-ahead window of inputs; writers stream outputs into a temporary file
that is renamed onto the shard's output path only when the shard is complete.

Layouts (``npz``/``safetensors`` as in ``mha_deploy.batch.items``):

- self-attention: ``<id>`` -> [seq, d_model]; cross: ``<id>.query``, ``<id>.key``, ``<id>.value``
- outputs: ``<id>`` -> [q_seq, d_model] and ``<id>.attn_weights`` -> [heads, q_seq, kv_seq]
  (``output_keys``; the job refuses an item whose keys another item of the shard already takes)
- Parquet: see ``mha_deploy.batch.parquet``; JSONL: see ``mha_deploy.batch.jsonl``.

A member that cannot be read (damaged, pickled objects, a header declaring
more data than the archive holds) is a bad item, named by its id, that
``--on-error`` stops at or skips; a file that cannot be opened at all stops the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mha_deploy.atomic import atomic_path
from mha_deploy.batch.base import ItemReader, ItemWriter, RawItem, refuse_padding_masks
from mha_deploy.batch.items import ITEM_SUFFIXES
from mha_deploy.batch.jsonl import JSONL_SUFFIX, JsonlItemReader
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime.validation import physical_memory_bytes

PARQUET_SUFFIX = ".parquet"
OUTPUT_SUFFIXES = (*ITEM_SUFFIXES, PARQUET_SUFFIX)
# JSONL is read, not written: outputs are float arrays, which JSON would hold as text several times their size
# and parse slowly; a JSONL shard's outputs go to the streamed npz.
DATASET_SUFFIXES = (*OUTPUT_SUFFIXES, JSONL_SUFFIX)
JSONL_OUTPUT_SUFFIX = ".npz"
# Zip entries carry a timestamp; a fixed one makes an output shard's bytes depend on its contents only.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Shard:
    """One input file of a dataset and where its output goes."""

    name: str  # relative to the dataset root: the output keeps it
    path: Path
    output: Path

    def fingerprint(self) -> dict[str, int]:
        """Size and modification time: enough to notice a change while the shard runs (the manifest keys on SHA-256)."""
        stat = self.path.stat()
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def list_shards(input_path: str | os.PathLike, output_path: str | os.PathLike) -> list[Shard]:
    """The shards of a dataset: one file (output: ``output_path``) or a directory's files (output: same names)."""
    input_path, output_path = Path(input_path), Path(output_path)
    if input_path.is_dir():
        if output_path.exists() and not output_path.is_dir():
            raise InputError(
                f"--input {input_path} is a directory, so --output must be one too ({output_path} is a file)"
            )
        paths = sorted(
            p
            for p in input_path.iterdir()
            if p.is_file() and p.suffix in DATASET_SUFFIXES and not p.name.startswith((".", "_"))
        )
        if not paths:
            raise InputError(f"{input_path}: no {', '.join(DATASET_SUFFIXES)} files in this directory")
        outputs = [_output_name(p) for p in paths]
        shared = next((name for name, count in Counter(outputs).items() if count > 1), None)
        if shared is not None:
            sources = [p.name for p, name in zip(paths, outputs, strict=True) if name == shared]
            raise InputError(
                f"{input_path}: {' and '.join(sources)} would both write {shared} (a JSONL shard's outputs go to "
                f"<stem>{JSONL_OUTPUT_SUFFIX}); rename one of them"
            )
        return [Shard(p.name, p, output_path / name) for p, name in zip(paths, outputs, strict=True)]
    if not input_path.is_file():
        raise InputError(f"input file not found: {input_path}")
    if input_path.suffix not in DATASET_SUFFIXES:
        raise InputError(f"input file {input_path} must end in {' or '.join(DATASET_SUFFIXES)}")
    if output_path.suffix not in OUTPUT_SUFFIXES:
        read_only = " (JSONL is read, not written)" if output_path.suffix == JSONL_SUFFIX else ""
        raise InputError(f"output file {output_path} must end in {' or '.join(OUTPUT_SUFFIXES)}{read_only}")
    if output_path.is_dir():
        raise InputError(f"--output {output_path} is a directory; give a file name for a single input file")
    return [Shard(input_path.name, input_path, output_path)]


def _output_name(path: Path) -> str:
    """A directory shard's output: the same name, or ``<stem>.npz`` for JSONL, which is not written."""
    return path.stem + JSONL_OUTPUT_SUFFIX if path.suffix == JSONL_SUFFIX else path.name


def open_reader(
    path: Path, signature: Signature, d_model: int, window: int
) -> contextlib.AbstractContextManager[ItemReader]:
    """A reader of ``path``'s items; ``window`` is how many rows a Parquet reader decodes at a time."""
    if path.suffix == PARQUET_SUFFIX:
        from mha_deploy.batch.parquet import ParquetItemReader

        return ParquetItemReader(path, signature, window, d_model)
    if path.suffix == JSONL_SUFFIX:
        return JsonlItemReader(path, signature)
    if path.suffix == ".npz":
        return NpzItemReader(path, signature, d_model)
    return SafetensorsItemReader(path, signature)


def open_writer(path: Path, like: Path, signature: Signature) -> contextlib.AbstractContextManager[ItemWriter]:
    """A writer that streams into a temporary file beside ``path`` and renames it onto ``path`` on success.

    ``like`` is the input shard: a Parquet output copies its tensor column type.
    """
    if path.suffix == PARQUET_SUFFIX:
        from mha_deploy.batch.parquet import ParquetItemWriter

        return _atomic_writer(path, lambda tmp: ParquetItemWriter(tmp, like, signature.query_input))
    if path.suffix == ".npz":
        return _atomic_writer(path, NpzItemWriter)
    return _atomic_writer(path, SafetensorsItemWriter)


@contextlib.contextmanager
def _atomic_writer(path: Path, make):
    with atomic_path(path) as tmp, make(tmp) as writer:
        yield writer


def _read_error(path: Path, exc: Exception) -> InputError:
    return InputError(f"{path}: cannot read arrays ({exc})")


def _group_names(names: list[str], signature: Signature, source: Path) -> dict[str, dict[str, str]]:
    """File keys -> item id -> {input name: file key}, in order of first appearance."""
    refuse_padding_masks(source, names, signature.padding_masks, "key")
    parts = signature.item_inputs
    if len(parts) == 1:  # one input per item: the key is the id
        return {name: {parts[0]: name} for name in names}
    # A custom model's query input (its first per-token output's rows: an encoder-decoder's target) is the item
    # itself (<id>), its others <id>.<input>; the built-in cross-attention and decoder name every part.
    bare = signature.query_input if signature.model == "custom" else None
    items: dict[str, dict[str, str]] = {}
    for name in names:
        item_id, _, part = name.rpartition(".")
        if bare is not None and (part not in parts or not item_id or part == bare):
            items.setdefault(name, {})[bare] = name
            continue
        if part not in parts or not item_id:
            expected = ", ".join(f"<id>.{p}" for p in parts)
            raise InputError(f"{source}: key {name!r} is not one of {expected}, which this model reads per item")
        items.setdefault(item_id, {})[part] = name
    return items


class _KeyedFileReader:
    """Shared by npz and safetensors: items are groups of keys, loaded one item at a time."""

    def __init__(self, path: Path, signature: Signature):
        self.path, self.signature = path, signature

    def __enter__(self):
        try:
            self._open()
        except InputError:
            raise
        except Exception as exc:  # zipfile, OSError, safetensors' own error type
            raise _read_error(self.path, exc) from exc
        names = self._names()
        # A hand-made zip can hold one name twice; which copy is meant is unknown.
        self._duplicates = {name for name, count in Counter(names).items() if count > 1}
        self._items = _group_names(list(dict.fromkeys(names)), self.signature, self.path)
        return self

    def __exit__(self, *exc_info):
        self._close()

    def count(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[RawItem]:
        for item_id, keys in self._items.items():
            missing = [p for p in self.signature.item_inputs if p not in keys]
            if missing:
                yield RawItem(item_id, None, f"lacks {', '.join(f'{item_id}.{p}' for p in missing)}")
                continue
            twice = [key for key in keys.values() if key in self._duplicates]
            if twice:
                problem = f"key {twice[0]!r} appears twice in the file: which copy is meant is unknown"
                yield RawItem(item_id, None, problem)
                continue
            arrays, problem = {}, None
            for name, key in keys.items():
                try:
                    arrays[name] = self._load(key, name)
                except _UnusableMember as exc:
                    problem = f"{key!r} {exc}"
                    break
                except Exception as exc:  # a damaged member: the item is bad, the rest of the file may be fine
                    problem = f"cannot read {key!r} ({type(exc).__name__}: {exc})"
                    break
            yield RawItem(item_id, None, problem) if problem else RawItem(item_id, arrays)


class _UnusableMember(Exception):
    """A member refused from its header alone (the message completes "'<key>' ...")."""


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_PICKLE_MESSAGE = "holds pickled Python objects, which are never unpickled (unsafe: unpickling can run any code)"


class NpzItemReader(_KeyedFileReader):
    """Reads each member's .npy header before its data: a member declaring more data than the archive holds or
    than the machine's memory, or a shape the model cannot take (zip bombs among them), is refused unread."""

    def __init__(self, path: Path, signature: Signature, d_model: int = 0):
        super().__init__(path, signature)
        # Each input's item shape past its length ((d_model,), (), (80,)); unchecked where d_model is unknown. An
        # image's or audio input's whole item shape ((3, 224, 224)): it has no length.
        fixed = {"d_model": d_model}
        self._tails = {
            name: signature.tensors[name].item_shape(0, fixed)[1:] if d_model else None
            for name in signature.sequence_inputs
        } | {name: signature.tensors[name].item_shape(0, fixed) for name in signature.fixed_shape_inputs}
        self._whole = set(signature.fixed_shape_inputs)

    def _open(self):
        if not zipfile.is_zipfile(self.path):
            raise InputError(f"{self.path}: cannot read arrays (not an .npz archive: not a zip file)")
        self._zip = zipfile.ZipFile(self.path)
        self._members = {_npz_key(info.filename): info for info in self._zip.infolist()}

    def _names(self) -> list[str]:
        return [_npz_key(name) for name in self._zip.namelist()]

    def _load(self, key: str, name: str) -> np.ndarray:
        info = self._members[key]
        fmt = np.lib.format
        with self._zip.open(info) as stream:
            version = fmt.read_magic(stream)
            read_header = _NPY_HEADERS.get(version)
            if read_header is None:
                raise _UnusableMember(f"is an .npy file of version {version}, which is not read here")
            shape, _fortran_order, dtype = read_header(stream)
            header_bytes = stream.tell()
        if dtype.hasobject:
            raise _UnusableMember(_PICKLE_MESSAGE)
        declared = math.prod(shape) * dtype.itemsize
        if declared > info.file_size - header_bytes:
            raise _UnusableMember(
                f"is damaged: its header declares {declared} bytes of data, the archive holds "
                f"{info.file_size - header_bytes}"
            )
        tail = self._tails[name]
        past_length = tuple(shape) if name in self._whole else tuple(shape[1:])
        if len(shape) < 1 or (tail is not None and past_length != tail) or dtype.kind not in "fiu":
            # Not an item the model takes: a stand-in of the declared shape and dtype, without the data,
            # lets the one validator name what is wrong.
            return np.broadcast_to(np.zeros((), dtype), shape)
        memory = physical_memory_bytes()
        if memory is not None and declared > memory:
            raise _UnusableMember(
                f"declares {declared / 2**30:.1f} GiB of data (shape {tuple(shape)}), more than this "
                f"machine's {memory / 2**30:.1f} GiB of memory"
            )
        with self._zip.open(info) as stream:
            return fmt.read_array(stream, allow_pickle=False)

    def _close(self):
        if getattr(self, "_zip", None) is not None:
            self._zip.close()


def _npz_key(member: str) -> str:
    """np.savez's member name -> the key np.load shows (``.npy`` removed)."""
    return member.removesuffix(".npy")


class SafetensorsItemReader(_KeyedFileReader):
    def _open(self):
        from safetensors import safe_open

        self._file = safe_open(str(self.path), framework="numpy")

    def _names(self) -> list[str]:
        return list(self._file.keys())

    def _load(self, key: str, name: str) -> np.ndarray:
        return self._file.get_tensor(key)

    def _close(self):
        self._file = None


def output_key(item_id: str, output_name: str) -> str:
    """The npz/safetensors key of one output of an item: ``<id>`` for ``output``, else ``<id>.<output name>``."""
    return item_id if output_name == "output" else f"{item_id}.{output_name}"


def output_keys(item_id: str, signature: Signature, suffix: str) -> tuple[str, ...]:
    """What an item's results are stored under in an output of ``suffix``: its keys, or its Parquet id."""
    if suffix == PARQUET_SUFFIX:
        return (item_id,)
    return tuple(output_key(item_id, spec.name) for spec in signature.item_outputs)


def item_arrays(item_id: str, result: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """The file keys of one item's results: ``<id>`` (output) and ``<id>.<name>`` (attn_weights, or a custom
    model's outputs)."""
    for name, array in result.items():
        yield output_key(item_id, name), array


class _UniqueKeys:
    """The last guard before a key is written twice (npz would keep both, safetensors the last): refuse it."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: set[str] = set()

    def add(self, key: str) -> None:
        if key in self._seen:
            raise InputError(f"{self.path}: key {key!r} would be written twice; an item's outputs would be lost")
        self._seen.add(key)


class NpzItemWriter:
    """Streams arrays into a zip as ``np.savez`` lays it out, so the shard's outputs are never all in memory."""

    def __init__(self, path: Path):
        self._zip = zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._keys = _UniqueKeys(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._zip.close()

    def write(self, results):
        for item_id, result in results:
            for key, array in item_arrays(item_id, result):
                self._keys.add(key)
                info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_EPOCH)
                info.external_attr = 0o644 << 16
                with self._zip.open(info, "w", force_zip64=True) as entry:
                    np.lib.format.write_array(entry, np.ascontiguousarray(array), allow_pickle=False)


class SafetensorsItemWriter:
    """Safetensors puts every tensor's offset in a header before the data, so a shard's outputs are kept to the end."""

    def __init__(self, path: Path):
        self.path = path
        self._arrays: dict[str, np.ndarray] = {}
        self._keys = _UniqueKeys(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc_info):
        if exc_type is None:
            from safetensors.numpy import save_file

            try:
                save_file(self._arrays, str(self.path))
            except OSError:
                raise
            except Exception as exc:  # SafetensorError wraps the OS's (disk full): the caller names the output
                raise OSError(f"safetensors cannot write it: {exc}") from exc

    def write(self, results):
        for item_id, result in results:
            for key, array in item_arrays(item_id, result):
                self._keys.add(key)
                self._arrays[key] = np.ascontiguousarray(array)
