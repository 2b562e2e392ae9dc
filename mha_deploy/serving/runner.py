"""``BatchRunner``: many variable-length items through one session, in padded batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.serving.batching import Item, collate, plan_batches, split_outputs
from mha_deploy.serving.session import MHASession


@dataclass
class RunStats:
    provider: str
    items: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    batch_ms: list[float] = field(default_factory=list)

    @property
    def padding_ratio(self) -> float:
        """Share of the computed query positions that were padding."""
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (
            f"{self.items} items, {self.tokens} tokens in {self.seconds:.2f} s: "
            f"{self.items_per_second:.1f} items/s, {self.tokens_per_second:.0f} tokens/s, "
            f"{len(self.batch_ms)} batches, padding {self.padding_ratio:.1%}, provider {self.provider}"
        )


class BatchRunner:
    """Runs items (id -> {input name: [seq, d_model]}) through ``session`` and returns outputs by id."""

    def __init__(self, session: MHASession, batch_size: int = 16):
        if batch_size < 1:
            raise InputError(f"batch size must be at least 1, got {batch_size}")
        self.session = session
        self.batch_size = batch_size

    def check_item(self, item_id: str, item: Mapping[str, np.ndarray]) -> None:
        """Raise ``InputError`` naming ``item_id`` if the item cannot go into a batch."""
        metadata = self.session.metadata
        for name in self.session.signature.sequence_inputs:
            array = item[name]
            where = f"item {item_id!r}" + (f" ({name})" if name != "x" else "")
            if array.dtype != np.dtype(metadata.dtype):
                raise InputError(f"{where}: dtype {array.dtype}, the model takes {metadata.dtype}")
            if array.ndim != 2 or array.shape[1] != metadata.d_model:
                raise InputError(f"{where}: shape {array.shape}, expected [seq, {metadata.d_model}]")
            if array.shape[0] == 0:
                raise InputError(f"{where}: empty sequence")
            if not np.isfinite(array).all():
                raise InputError(f"{where}: contains NaN or Inf")
        if self.session.signature.attention == "cross" and item["key"].shape[0] != item["value"].shape[0]:
            raise InputError(f"item {item_id!r}: key and value lengths differ")

    def run(
        self, items: Mapping[str, Item], on_batch: Callable[[int, int], None] | None = None
    ) -> tuple[dict[str, dict[str, np.ndarray]], RunStats]:
        """Outputs by id (in the order of ``items``) and what the run measured.

        Every item is checked before the first batch runs, so bad input fails
        fast and nothing is half done. ``on_batch(items, tokens)`` reports progress.
        """
        for item_id, item in items.items():
            self.check_item(item_id, item)
        ids = list(items)
        values = [items[i] for i in ids]
        signature = self.session.signature
        stats = RunStats(provider=self.session.provider)
        results: dict[str, dict[str, np.ndarray]] = {}
        start = time.perf_counter()
        for indices in plan_batches(values, signature, self.batch_size):
            batch = collate([values[i] for i in indices], signature)
            t0 = time.perf_counter()
            outputs = self.session.run(batch.feeds)
            stats.batch_ms.append((time.perf_counter() - t0) * 1e3)
            for index, result in zip(indices, split_outputs(outputs, batch), strict=True):
                results[ids[index]] = result
            stats.items += len(indices)
            stats.tokens += batch.real_tokens
            stats.padded_tokens += batch.padded_tokens
            if on_batch:
                on_batch(len(indices), batch.real_tokens)
        stats.seconds = time.perf_counter() - start
        return {item_id: results[item_id] for item_id in ids}, stats


def output_arrays(results: Mapping[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Results by id -> the arrays of an output file (``<id>``, ``<id>.attn_weights``)."""
    arrays = {}
    for item_id, result in results.items():
        arrays[item_id] = result["output"]
        if "attn_weights" in result:
            arrays[f"{item_id}.attn_weights"] = result["attn_weights"]
    return arrays
