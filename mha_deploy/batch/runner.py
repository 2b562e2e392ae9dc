"""``BatchRunner``: many variable-length items through one session, in padded batches.

Items arrive as a stream; the runner reads ahead ``bucket_window`` of them,
sorts that window by length (length bucketing), cuts it into batches of at most
``batch_size`` items and ``max_batch_tokens`` padded positions (``RunnerOptions``), runs them, and hands
back the window's results in input order. Memory is bounded by one window, not
by the dataset. Whole datasets of shards (resume, manifests) are
``mha_deploy.batch.job``'s concern.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

from mha_deploy.batch.base import Item, RawItem, Result
from mha_deploy.batch.planner import (
    DEFAULT_MAX_SCORE_BYTES,
    BatchLimits,
    collate,
    plan_batches,
    score_bytes,
    split_outputs,
)
from mha_deploy.batching import RunnerOptions
from mha_deploy.errors import InputError
from mha_deploy.runtime.decoding import refuse_kv_cache
from mha_deploy.runtime.session import MHASession
from mha_deploy.runtime.validation import in_model_dtype, item_problem, output_problem

BatchCallback = Callable[[int, int], None]


@dataclass
class ItemError:
    """A bad item: which one, in which shard, and what is wrong with it."""

    shard: str
    item_id: str
    message: str

    def __str__(self) -> str:
        return f"{self.shard}: {self.message}" if self.shard else self.message


@dataclass
class RunStats:
    provider: str
    items: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    batch_ms: list[float] = field(default_factory=list)
    errors: list[ItemError] = field(default_factory=list)
    shards_written: int = 0
    shards_skipped: int = 0

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

    def batch_latency_ms(self, percentile: float) -> float:
        return float(np.percentile(self.batch_ms, percentile)) if self.batch_ms else 0.0

    def merge(self, other: RunStats) -> None:
        """Add ``other``'s counts (e.g. one shard's, or one Ray actor's) to these; wall time is not added."""
        self.items += other.items
        self.tokens += other.tokens
        self.padded_tokens += other.padded_tokens
        self.batch_ms.extend(other.batch_ms)
        self.errors.extend(other.errors)
        self.shards_written += other.shards_written
        self.shards_skipped += other.shards_skipped

    def summary(self) -> str:
        text = (
            f"{self.items} items, {self.tokens} tokens in {self.seconds:.2f} s: "
            f"{self.items_per_second:.1f} items/s, {self.tokens_per_second:.0f} tokens/s, "
            f"{len(self.batch_ms)} batches (p50 {self.batch_latency_ms(50):.1f} ms, "
            f"p99 {self.batch_latency_ms(99):.1f} ms), padding {self.padding_ratio:.1%}, provider {self.provider}"
        )
        if self.shards_written or self.shards_skipped:
            text += f"; shards: {self.shards_written} written, {self.shards_skipped} already done"
        if self.errors:
            text += f"; {len(self.errors)} bad items skipped"
        return text

    def to_dict(self) -> dict:
        return {
            "items": self.items,
            "tokens": self.tokens,
            "padded_tokens": self.padded_tokens,
            "padding_ratio": self.padding_ratio,
            "seconds": self.seconds,
            "items_per_second": self.items_per_second,
            "tokens_per_second": self.tokens_per_second,
            "batches": len(self.batch_ms),
            "batch_ms_p50": self.batch_latency_ms(50),
            "batch_ms_p99": self.batch_latency_ms(99),
            "provider": self.provider,
            "shards_written": self.shards_written,
            "shards_skipped": self.shards_skipped,
            "errors": [asdict(error) for error in self.errors],
        }


class BatchRunner:
    """Runs items (id -> {input name: [seq, d_model]}) through ``session`` and returns outputs by id.

    ``options`` (``RunnerOptions``, or its fields as keywords) bound the
    batches and say what happens at a bad item: "stop" raises ``InputError``
    at the first, "skip" leaves it out and records it in ``RunStats.errors``.
    An item whose outputs hold NaN or Inf (finite inputs that overflowed) is a
    bad item too, found after its batch ran.
    """

    def __init__(self, session: MHASession, options: RunnerOptions | None = None, **fields):
        if options is not None and fields:
            raise TypeError("give RunnerOptions or their fields as keywords, not both")
        self.options = options if options is not None else RunnerOptions(**fields)
        refuse_kv_cache(session.metadata, "the batch runner")
        self.session = session

    @property
    def on_error(self) -> str:
        return self.options.on_error

    @property
    def window_items(self) -> int:
        """Items read ahead before batching: the memory bound of a run, in items."""
        return self.options.window_items

    def prepare_item(
        self, item_id: str, item: Mapping[str, np.ndarray], place: str | None = None
    ) -> tuple[Item, str | None]:
        """The item in the model's dtype (see ``in_model_dtype``), and what makes it unusable (naming ``item_id``,
        and ``place``, where in its file it is, when given)."""
        item = in_model_dtype(self.session.metadata, item)
        problem = item_problem(self.session.metadata, item)
        return item, (f"{RawItem(item_id, None, place=place).label}: {problem}" if problem else None)

    def item_problem(self, item_id: str, item: Mapping[str, np.ndarray]) -> str | None:
        """What makes the item unusable (naming ``item_id``), or None."""
        return self.prepare_item(item_id, item)[1]

    def check_item(self, item_id: str, item: Mapping[str, np.ndarray]) -> Item:
        """The item in the model's dtype; raises ``InputError`` naming ``item_id`` if it cannot go into a batch."""
        item, problem = self.prepare_item(item_id, item)
        if problem:
            raise InputError(problem)
        return item

    def run(
        self, items: Mapping[str, Item], on_batch: BatchCallback | None = None
    ) -> tuple[dict[str, Result], RunStats]:
        """Outputs by id (in the order of ``items``) and what the run measured.

        With ``on_error="stop"`` every item is checked before the first batch
        runs, so bad input fails fast. ``on_batch(items, tokens)`` reports progress.
        """
        if self.on_error == "stop":
            items = {item_id: self.check_item(item_id, item) for item_id, item in items.items()}
        stats = RunStats(provider=self.session.provider)
        start = time.perf_counter()
        raw = (RawItem(item_id, item) for item_id, item in items.items())
        results = {item_id: result for window in self.run_stream(raw, stats, on_batch) for item_id, result in window}
        stats.seconds = time.perf_counter() - start
        return results, stats

    def run_stream(
        self, items: Iterable[RawItem], stats: RunStats, on_batch: BatchCallback | None = None, source: str = ""
    ) -> Iterator[list[tuple[str, Result]]]:
        """Per window of ``window_items`` items, their results in input order; counts go into ``stats``.

        ``source`` (a shard name) is put in front of error messages.
        """
        window: list[RawItem] = []
        for raw in items:
            item, problem = raw.item, raw.problem and f"{raw.label}: {raw.problem}"
            if not problem:
                item, problem = self.prepare_item(raw.item_id, raw.item, raw.place)
            if problem:
                error = ItemError(source, raw.item_id, problem)
                if self.on_error == "stop":
                    raise InputError(str(error))
                stats.errors.append(error)
                continue
            window.append(raw._replace(item=item))
            if len(window) >= self.window_items:
                yield self._run_window(window, stats, on_batch, source)
                window = []
        if window:
            yield self._run_window(window, stats, on_batch, source)

    def _bad_output(self, source: str, raw: RawItem, result: Result, stats: RunStats) -> bool:
        """Whether ``result`` (``raw``'s) must be left out (recorded, or raised with ``on_error="stop"``)."""
        problem = output_problem(result)
        if problem is None:
            return False
        error = ItemError(source, raw.item_id, f"{raw.label}: {problem.message}")
        if self.on_error == "stop":
            raise InputError(str(error))
        stats.errors.append(error)
        return True

    def _run_window(
        self, window: list[RawItem], stats: RunStats, on_batch: BatchCallback | None, source: str = ""
    ) -> list[tuple[str, Result]]:
        signature = self.session.signature
        values = [raw.item for raw in window]
        results: list[Result | None] = [None] * len(window)
        limits = BatchLimits(
            self.options.batch_size,
            self.options.max_batch_tokens,
            max_score_bytes=DEFAULT_MAX_SCORE_BYTES,
            score_bytes=score_bytes(self.session.metadata),
        )
        plan = plan_batches(values, signature, limits, sort=self.options.bucket_window > 0)
        for indices in plan:
            batch = collate([values[i] for i in indices], signature)
            t0 = time.perf_counter()
            outputs = self.session.run(batch.feeds)
            stats.batch_ms.append((time.perf_counter() - t0) * 1e3)
            for index, result in zip(indices, split_outputs(outputs, batch, signature), strict=True):
                if not self._bad_output(source, window[index], result, stats):
                    results[index] = result
                    stats.items += 1
            stats.tokens += batch.real_tokens
            stats.padded_tokens += batch.padded_tokens
            if on_batch:
                on_batch(len(indices), batch.real_tokens)
        return [(raw.item_id, result) for raw, result in zip(window, results, strict=True) if result is not None]
