"""What every dataset format shares: one item as read, and the reader and writer protocols.

A module of its own so that the formats (``datasets``, ``parquet``) and the
runner import it and not each other.
"""

from __future__ import annotations

from collections.abc import Iterator
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


class ItemReader(Protocol):
    def count(self) -> int:
        """How many items the shard holds, read from its index or footer only."""

    def __iter__(self) -> Iterator[RawItem]: ...


class ItemWriter(Protocol):
    def write(self, results: list[tuple[str, dict[str, np.ndarray]]]) -> None:
        """Append results (id, {output name: array}) in order."""


def mask_in_dataset(source: object, where: str, mask: str) -> InputError:
    """The refusal of a dataset that holds the model's padding mask ``mask`` (``where``: the column, or the
    file's keys): items are unpadded, and the runner builds every batch's masks from their lengths, so a mask
    given per item would be ignored (the server's /v1 and npz bodies refuse it the same way)."""
    return InputError(
        f"{source}: {where}: {mask} is this model's padding mask, which infer builds from each item's length; "
        "remove it and keep only each item's real tokens"
    )
