"""JSON Lines datasets, one JSON object per line, read as a stream: ``infer``'s items and ``generate``'s prompts.

An item is ``{"id": ..., "<input name>": [...], ...}``, keyed by the model's input names as the npz and Parquet
readers key them: token and segment ids as a list of integers [seq], other sequences as lists of lists
[seq][features], an image as nested lists [channels][height][width], audio features as [mel][frames]. The
id is a string or an integer, as for ``generate``'s prompts. Other fields are ignored, except the model's padding
masks, which are refused (``base.refuse_padding_masks``): items are unpadded and each batch's masks are built from
their lengths. A line that is not such an object is a bad item named by its line; so is every other bad item, as
``<id> (line N)``, since ids may repeat or be integers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Iterator
from pathlib import Path

import numpy as np

from mha_deploy.batch.base import RawItem, refuse_padding_masks
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature

JSONL_SUFFIX = ".jsonl"


def jsonl_records(path: Path, masks: Collection[str]) -> Iterator[tuple[int, object]]:
    """(line number, its JSON value, or the ``ValueError`` that says why it is none) per line that is not blank.
    An object with a padding mask field (one of ``masks``) is refused here, so that counting the lines refuses it
    too, before anything is written."""
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    yield number, exc
                    continue
                if isinstance(record, dict):
                    refuse_padding_masks(f"{path}: line {number}", record, masks, "field")
                yield number, record
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror or exc})") from exc


def id_problem(item_id: object) -> str | None:
    """Why a JSON line's or Parquet row's id cannot be an item's id, or None. An id is a string or an integer:
    outputs carry it back as given, so null, a float, a list or an object would leave outputs that no id names
    (every null alike) or that compare unlike their input's (1.0 written as 1.0, read back as 1)."""
    if isinstance(item_id, str) or (isinstance(item_id, int) and not isinstance(item_id, bool)):
        return None
    return f"\"id\" must be a string or an integer, got {json.dumps(item_id, default=repr)}"


def record_problem(number: int, record: object) -> str | None:
    """Why line ``number``'s JSON value (or the ``ValueError`` of a line that is none) names no item, or None."""
    if isinstance(record, ValueError):
        return f"line {number} is not JSON ({record})"
    if not isinstance(record, dict) or "id" not in record:
        return f"line {number} is not an object with an \"id\""
    problem = id_problem(record["id"])
    return f"line {number}: {problem}" if problem is not None else None


def json_numbers(value: object) -> np.ndarray | str:
    """A field's numbers, nested in lists of equal lengths, as an array; or what is wrong with them. The dtype is
    numpy's (int64 for integers, float64 once a float is among them): the one validator then casts or refuses."""
    try:
        array = np.asarray(value)
    except ValueError:  # numpy's "inhomogeneous shape"
        return "holds lists of different lengths"
    if array.dtype.kind not in "fiu":
        # null, strings and integers past 64 bits make an object or str array; all-booleans a bool one.
        return "must hold numbers only (no true/false, null, strings or integers past 64 bits)"
    # numpy reads true and false among numbers as 1 and 0: an id or value nobody wrote.
    leaves = [value]
    for _ in range(array.ndim):
        leaves = list(itertools.chain.from_iterable(leaves))
    if any(leaf is True or leaf is False for leaf in leaves):
        return "holds true or false among its numbers; give numbers only"
    return array


class JsonlItemReader:
    """Items of a JSONL file, one line at a time: memory holds one line and its arrays, whatever the file's size."""

    def __init__(self, path: Path, signature: Signature):
        self.path, self.signature = path, signature

    def __enter__(self):
        if not self.path.is_file():
            raise InputError(f"{self.path}: cannot read it (no such file)")
        return self

    def __exit__(self, *exc_info):
        pass

    def count(self) -> int:
        """The lines that are not blank. JSONL has no index: every line is parsed, which refuses a padding mask
        field before any shard runs, as the npz and Parquet readers refuse one from their index."""
        return sum(1 for _ in jsonl_records(self.path, self.signature.padding_masks))

    def __iter__(self) -> Iterator[RawItem]:
        for number, record in jsonl_records(self.path, self.signature.padding_masks):
            problem = record_problem(number, record)
            if problem is not None:
                yield RawItem(f"<line {number}>", None, problem)
                continue
            yield self._item(str(record["id"]), record, f"line {number}")

    def _item(self, item_id: str, record: dict, place: str) -> RawItem:
        names = self.signature.item_inputs
        missing = [name for name in names if name not in record]
        if missing:
            return RawItem(item_id, None, f"lacks field {', '.join(missing)}, which this model reads per item", place)
        arrays = {}
        for name in names:
            array = json_numbers(record[name])
            if isinstance(array, str):
                return RawItem(item_id, None, f"{name} {array}", place)
            arrays[name] = array
        return RawItem(item_id, arrays, None, place)
