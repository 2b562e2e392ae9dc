"""What every dataset format shares: one item as read, and the reader and writer protocols.

A module of its own so that the formats (``datasets``, ``parquet``) and the
runner import it and not each other.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import NamedTuple, Protocol

import numpy as np

from mha_deploy.errors import InputError

# One item: sequence input name (x, or query/key/value, or x/memory) -> [seq, d_model].
Item = dict[str, np.ndarray]
# One item's outputs: output name -> array without padding.
Result = dict[str, np.ndarray]


class RawItem(NamedTuple):
    """One item as read: its arrays, or why they could not be read."""

    item_id: str
    item: Item | None
    problem: str | None = None
    # Where the item is in its file, for a format whose ids need not find it (a JSON line: "line 4").
    place: str | None = None

    @property
    def label(self) -> str:
        """How messages name the item: ``item '<id>'``, with its place when it has one."""
        return f"item {self.item_id!r}" + (f" ({self.place})" if self.place else "")


class ItemReader(Protocol):
    def count(self) -> int:
        """How many items the shard holds, read from its index or footer only."""

    def __iter__(self) -> Iterator[RawItem]: ...


class ItemWriter(Protocol):
    def write(self, results: list[tuple[str, dict[str, np.ndarray]]]) -> None:
        """Append results (id, {output name: array}) in order."""


def mask_in_dataset(source: object, where: str, mask: str) -> InputError:
    """The refusal of a dataset that holds the model's padding mask ``mask`` (``where``: the column, key or
    field): items are unpadded, and ``infer`` and ``generate`` build every batch's masks from their lengths, so a
    mask given per item would be ignored (the server's /v1 and npz bodies refuse it the same way)."""
    return InputError(
        f"{source}: {where}: {mask} is this model's padding mask, which is built for each batch from its items' "
        "lengths; remove it and keep only each item's real tokens"
    )


def refuse_padding_masks(source: object, names: Iterable[str], masks: Collection[str], kind: str) -> None:
    """``mask_in_dataset`` for the first of ``names`` that is one of the padding ``masks``. ``kind`` says what the
    names are: "key" (npz and safetensors keys: ``<id>.<mask>``, or a whole batch's ``<mask>``), or "column" or
    "field" (a Parquet column, a JSON line's field: the mask's own name)."""
    for name in names:
        mask = name.rpartition(".")[2] if kind == "key" else name
        if mask in masks:
            raise mask_in_dataset(source, f"key {name!r}" if kind == "key" else f"{kind} {name}", mask)
