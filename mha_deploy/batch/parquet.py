"""Items in Parquet, the form Ray Data and Spark keep embeddings in (``pip install "mha-deploy[parquet]"``).

Layout, one row per item:

- ``id``: string
- self-attention: ``x``: list<list<float32>> [seq][d_model] (or list<fixed_size_list<float32, d_model>>,
  what Spark's ``array<array<float>>`` and Ray's nested lists read as)
- cross-attention: ``query``, ``key``, ``value``, each like ``x``
- token and segment ids: list<int64> [seq]
- an image or audio input (a fixed shape, [channels, height, width] or [mel, frames]): nested lists of that
  shape (list<list<list<float32>>>), or one flat list<float32> of all its values in row-major order
- other columns are ignored, except the model's padding masks, which are refused: items are unpadded and
  the runner builds each batch's masks (``base.refuse_padding_masks``).

Outputs: ``id`` and ``output`` (the same nested type as the input's tensor column),
plus ``attn_weights`` list<list<list<float32>>> [heads][q_seq][kv_seq] when the model returns weights.
A reader decodes at most 16 rows at a time and a writer writes row groups of at most 16
rows, so neither holds a whole file. pyarrow still decodes a nested-list column one whole
row group at a time, at about 5-7x the row group's size (repetition and definition levels per
float, measured with pyarrow 26): keep input row groups small (tens of MB, not Spark's 128 MB).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mha_deploy.batch.base import RawItem, refuse_padding_masks
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.signature import ID_ROLES

ID_COLUMN = "id"
# Rows decoded, and rows per written row group, at a time: bounds pyarrow's transient buffers.
ROWS_PER_BATCH = 16


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InputError('Parquet needs pyarrow: pip install "mha-deploy[parquet]"') from exc
    return pa, pq


def decode_ids(column) -> list[np.ndarray | str]:
    """A list<integer> column -> per row an integer array [seq] of token ids (as stored), or a problem."""
    pa, _ = _pyarrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not is_id_list(column.type):
        raise InputError(f"column type {column.type} is not a list of token ids (list<int64>)")
    offsets = column.offsets.to_numpy()
    flat = column.flatten()
    # Ids keep their integer type (the validator names a uint64 id past int64 as it is); a null element is
    # named by position, not read as whatever number pyarrow would fill it with.
    values = flat.fill_null(0).to_numpy(zero_copy_only=False)
    null_ids = flat.is_null().to_numpy(zero_copy_only=False) if flat.null_count else None
    base = offsets[0]
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    decoded: list[np.ndarray | str] = []
    for row in range(len(column)):
        start, end = offsets[row] - base, offsets[row + 1] - base
        if nulls[row]:
            decoded.append("is null")
        elif null_ids is not None and null_ids[start:end].any():
            position = int(np.argmax(null_ids[start:end]))
            decoded.append(f"holds a null id at position {position}: every token id must be an integer")
        else:
            decoded.append(values[start:end])
    return decoded


def is_id_list(column_type) -> bool:
    """Whether a column type is a list of integers (token ids): list<int64> or list<int32>..."""
    pa, _ = _pyarrow()
    is_list = pa.types.is_list(column_type) or pa.types.is_large_list(column_type)
    return is_list and pa.types.is_integer(column_type.value_type)


def is_vector_list(column_type) -> bool:
    """Whether a column type is a list of vectors of numbers: list<list<number>> or list<fixed_size_list<...>>."""
    pa, _ = _pyarrow()
    lists = (pa.types.is_list, pa.types.is_large_list)
    if not any(test(column_type) for test in lists):
        return False
    vector = column_type.value_type
    if not any(test(vector) for test in (*lists, pa.types.is_fixed_size_list)):
        return False
    number = vector.value_type
    return pa.types.is_floating(number) or pa.types.is_integer(number)


def decode_sequences(column, d_model: int) -> list[np.ndarray | str]:
    """A nested-list column -> per row an array [seq, width] (width = d_model when well formed), or a problem."""
    pa, _ = _pyarrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
        raise InputError(f"column type {column.type} is not a list of vectors (list<list<float32>>)")
    outer = column.offsets.to_numpy()
    rows = column.flatten()  # the vectors of every item, in order
    if pa.types.is_fixed_size_list(rows.type):
        widths = np.full(len(rows), rows.type.list_size)
    elif pa.types.is_list(rows.type) or pa.types.is_large_list(rows.type):
        inner = rows.offsets.to_numpy()
        widths = np.diff(inner)
    else:
        raise InputError(f"column type {column.type} is not a list of vectors (list<list<float32>>)")
    values = rows.flatten().to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(widths)])
    base = outer[0]
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    decoded: list[np.ndarray | str] = []
    for index in range(len(column)):
        if nulls[index]:
            decoded.append("is null")
            continue
        first, last = outer[index] - base, outer[index + 1] - base
        row_widths = widths[first:last]
        if len(row_widths) and (row_widths != row_widths[0]).any():
            decoded.append(f"vectors of different lengths {sorted(set(row_widths.tolist()))[:5]}")
            continue
        width = int(row_widths[0]) if len(row_widths) else d_model
        decoded.append(values[starts[first] : starts[last]].reshape(last - first, width))
    return decoded


def _list_sizes(array) -> np.ndarray | None:
    """The length of each list of a list-typed arrow array, or None for an array of values."""
    pa, _ = _pyarrow()
    if pa.types.is_fixed_size_list(array.type):
        return np.full(len(array), array.type.list_size)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return np.diff(array.offsets.to_numpy())
    return None


def decode_tensors(column, shape: tuple[int, ...]) -> list[np.ndarray | str]:
    """A column of fixed-shape items (an image, audio features) -> per row an array, or a problem. Nested lists
    give the row's own shape (the validator names sizes that are not ``shape``); one flat list of exactly
    prod(``shape``) values is ``shape`` in row-major order."""
    pa, _ = _pyarrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    levels, values = [], column
    while (sizes := _list_sizes(values)) is not None:
        levels.append(np.concatenate([[0], np.cumsum(sizes)]))  # each list's start in the next level, then the end
        values = values.flatten()
    if not levels or not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise InputError(f"column type {column.type} is not nested lists of numbers (list<list<list<float32>>>)")
    flat = values.to_numpy(zero_copy_only=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    decoded: list[np.ndarray | str] = []
    for row in range(len(column)):
        if nulls[row]:
            decoded.append("is null")
            continue
        low, high, dims = row, row + 1, []
        for starts in levels:
            sizes = np.diff(starts[low : high + 1])
            if len(sizes) and (sizes != sizes[0]).any():
                decoded.append(f"holds lists of different lengths {sorted(set(sizes.tolist()))[:5]} at depth "
                               f"{len(dims) + 1}")
                break
            dims.append(int(sizes[0]) if len(sizes) else 0)
            low, high = int(starts[low]), int(starts[high])
        else:
            array = flat[low:high].reshape(dims)
            flat_whole = len(dims) == 1 and len(shape) > 1 and dims[0] == int(np.prod(shape))
            decoded.append(array.reshape(shape) if flat_whole else array)
    return decoded


def encode_nested(arrays: list[np.ndarray], fixed_inner: bool = False):
    """Arrays of one rank (shapes may differ) -> a nested list array, one row per array."""
    pa, _ = _pyarrow()
    rank = arrays[0].ndim
    values = pa.array(np.concatenate([a.ravel() for a in arrays]))
    for axis in reversed(range(rank)):
        if axis == rank - 1 and fixed_inner and rank > 1:
            values = pa.FixedSizeListArray.from_arrays(values, arrays[0].shape[-1])
            continue
        # At this level there is one list per index of the axes before it, each as long as this axis.
        sizes = np.concatenate([np.full(int(np.prod(a.shape[:axis])), a.shape[axis], np.int64) for a in arrays])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        offset_type = pa.int32() if offsets[-1] < 2**31 else pa.int64()
        array_type = pa.ListArray if offset_type == pa.int32() else pa.LargeListArray
        values = array_type.from_arrays(pa.array(offsets, offset_type), values)
    return values


class ParquetItemReader:
    def __init__(self, path: Path, signature: Signature, window: int, d_model: int = 0):
        self.path, self.signature, self.window = path, signature, max(1, window)
        self.d_model = d_model

    def __enter__(self):
        pa, pq = _pyarrow()
        try:
            # No pre-buffering: it would fetch whole row groups ahead of the rows being decoded.
            self._file = pq.ParquetFile(self.path, pre_buffer=False)
        except Exception as exc:  # ArrowInvalid, OSError
            raise InputError(f"{self.path}: cannot read Parquet ({exc})") from exc
        names = self._file.schema_arrow.names
        refuse_padding_masks(self.path, names, self.signature.padding_masks, "column")
        self.columns = [ID_COLUMN, *self.signature.item_inputs]
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise InputError(
                f"{self.path}: no column {', '.join(missing)}; this model reads "
                f"columns {', '.join(self.columns)} (has {', '.join(names)})"
            )
        schema = self._file.schema_arrow
        for name in self.columns[1:]:
            column_type = schema.field(name).type
            role = self.signature.tensors[name].role
            if role in ID_ROLES:
                if not is_id_list(column_type):
                    raise InputError(
                        f"{self.path}: column {name} is {column_type}; it must hold per row a list of "
                        f"{role.replace('tokens', 'token')} ids (list<int64>: [seq])"
                    )
            elif name in self.signature.fixed_shape_inputs:
                if _list_sizes(pa.nulls(0, column_type)) is None:
                    shape = "x".join(map(str, self.signature.tensors[name].axes[1:]))
                    raise InputError(
                        f"{self.path}: column {name} is {column_type}; it must hold per row one {role} of "
                        f"{shape} numbers (nested lists, or one flat list)"
                    )
            elif not is_vector_list(column_type):
                raise InputError(
                    f"{self.path}: column {name} is {column_type}; it must hold per row a list of "
                    "vectors of numbers (list<list<float32>>: [seq][d_model])"
                )
        return self

    def __exit__(self, *exc_info):
        self._file.close()

    def count(self) -> int:
        return self._file.metadata.num_rows

    def __iter__(self) -> Iterator[RawItem]:
        # Decoding nested lists costs several times the data (repetition and definition levels per float):
        # small record batches on one thread keep that transient small; the runner gathers its window from them.
        rows = min(self.window, ROWS_PER_BATCH)
        for batch in self._file.iter_batches(batch_size=rows, columns=self.columns, use_threads=False):
            ids = batch.column(ID_COLUMN).to_pylist()
            decoded = {name: self._decode(name, batch.column(name)) for name in self.columns[1:]}
            for row, item_id in enumerate(ids):
                if item_id is None:
                    yield RawItem(f"<row {row}>", None, "id is null")
                    continue
                parts = {name: decoded[name][row] for name in decoded}
                problems = [f"{name} {p}" for name, p in parts.items() if isinstance(p, str)]
                if problems:
                    yield RawItem(str(item_id), None, "; ".join(problems))
                else:
                    yield RawItem(str(item_id), parts)


    def _decode(self, name: str, column) -> list[np.ndarray | str]:
        spec = self.signature.tensors[name]
        if spec.role in ID_ROLES:
            return decode_ids(column)
        if name in self.signature.fixed_shape_inputs:
            return decode_tensors(column, spec.axes[1:])
        return decode_sequences(column, self.d_model)


class ParquetItemWriter:
    """One row group per ``write`` call, into ``path`` (a temporary file the caller renames)."""

    def __init__(self, path: Path, like: Path, column: str = "x"):
        pa, pq = _pyarrow()
        self.path = path
        self._fixed_inner = False
        if like.suffix == ".parquet":
            schema = pq.read_schema(like)
            # The output keeps the input's vector type: the query column's, whose rows it has.
            if column in schema.names:
                inner = getattr(schema.field(column).type, "value_type", None)  # None: not a list (the reader says)
                self._fixed_inner = inner is not None and pa.types.is_fixed_size_list(inner)
        self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc_info):
        if self._writer is None and exc_type is None:
            self._write_table([])  # a shard whose items were all skipped still gets a valid file
        if self._writer is not None:
            self._writer.close()

    def write(self, results):
        for start in range(0, len(results), ROWS_PER_BATCH):
            self._write_table(results[start : start + ROWS_PER_BATCH])

    def _write_table(self, results):
        pa, pq = _pyarrow()
        columns = {ID_COLUMN: pa.array([item_id for item_id, _ in results], pa.string())}
        if not results:
            columns["output"] = pa.array([], pa.list_(pa.list_(pa.float32())))
        for name in results[0][1] if results else ():
            # The query's vector type carries over to the output of the same rows; other outputs are plain lists.
            fixed_inner = self._fixed_inner and name == "output"
            arrays = [result[name] for _, result in results]
            columns[name] = (
                encode_nested(arrays, fixed_inner) if arrays[0].ndim else pa.array(np.stack(arrays))
            )
        table = pa.table(columns)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)
