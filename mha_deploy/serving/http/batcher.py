"""Dynamic micro-batching: concurrent requests share one padded ORT run.

Items wait in a queue. When a worker is free, the batcher takes the oldest item
and keeps collecting until it has ``max_batch`` items or the oldest has waited
``max_wait_ms``; items that queued while every worker was busy have usually
waited long enough already and go at once, so under load batches fill up
without adding latency, and at low load an item waits at most ``max_wait_ms``.

The collected items are cut into runs of similar length by the batch planner
(``mha_deploy.batch.planner``: at most ``max_padding`` of a run is padding, at
most ``max_batch_tokens`` padded positions, and items whose unpaddable axes
differ run apart), padded with ``collate`` (padding masks mark the padding when
the model has them), run in a worker thread so the event loop keeps accepting
requests, and cut back with ``split_outputs``.

``submit_many`` queues the rows of one protocol request together (all admitted
or none), and ``run_formed`` queues a batch the caller formed itself, which runs
as given: for a request whose padding mask is not right padding, the only layout
the planner can re-pad exactly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mha_deploy.batch.base import Item, Result
from mha_deploy.batch.planner import (
    DEFAULT_MAX_SCORE_BYTES,
    BatchLimits,
    collate,
    plan_batches,
    score_bytes,
    split_outputs,
)
from mha_deploy.batching import BatchingConfig
from mha_deploy.errors import BatcherStoppedError
from mha_deploy.runtime.decoding import refuse_kv_cache
from mha_deploy.runtime.session import MHASession
from mha_deploy.runtime.validation import output_problem
from mha_deploy.serving.http.metrics import ServerMetrics
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.signature import ID_ROLES, Signature

logger = logging.getLogger("mha_deploy.serve")


@dataclass
class _Waiting:
    item: Item  # or, when ``formed``, a whole batch of feeds
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    formed: bool = False


class MicroBatcher:
    """``await batcher.submit(item)`` returns the item's outputs, computed in a batch with whatever else was waiting.

    ``max_batch=1`` turns batching off: every item runs alone (``workers`` of them at once).
    """

    def __init__(self, session: MHASession, config: BatchingConfig | None = None, metrics: ServerMetrics | None = None):
        config = config or BatchingConfig()
        refuse_kv_cache(session.metadata, "the HTTP server's micro-batcher")
        self.session = session
        self.max_batch = config.max_batch
        self.max_wait = config.max_wait_ms / 1e3
        self.workers = config.workers
        self.max_queue = config.max_queue
        self.max_batch_tokens = config.max_batch_tokens
        self.max_padding = config.max_padding
        self.metrics = metrics or ServerMetrics()
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._arrived = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="mha-batch")
        self._loop_task = asyncio.create_task(self._collect(), name="mha-batcher")

    async def stop(self) -> None:
        """Run everything already submitted, then stop (submit refuses new items from now on)."""
        self._stopping = True
        self._arrived.set()
        if self._loop_task is not None:
            await self._loop_task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def submit(self, item: Item) -> Result:
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: list[Item]) -> list[Result]:
        """Each item's outputs; the items are queued together or, when the queue has no room for all, refused."""
        futures = self._enqueue([_Waiting(item, self._new_future()) for item in items])
        if len(futures) == 1:  # the common case, without gather's wrapper future
            return [await futures[0]]
        return list(await asyncio.gather(*futures))

    async def run_formed(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs of ``feeds``, a batch run as given (not re-padded), in its turn with the queued items."""
        (future,) = self._enqueue([_Waiting(feeds, self._new_future(), formed=True)])
        return await future

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _enqueue(self, waiting: list[_Waiting]) -> list[asyncio.Future]:
        # No await between the room check and the append: requests cannot interleave here.
        if self._stopping or self._loop_task is None:
            raise RequestError(503, "not_ready", "the server is not running batches (starting up or shutting down)")
        if self._loop_task.done():
            raise BatcherStoppedError("the batcher has died") from self._loop_task.exception()
        if len(waiting) > self.max_queue:
            raise RequestError(
                400, "too_many_rows", f"{len(waiting)} rows in one request; this server queues at most {self.max_queue}"
            )
        if len(self._queue) + len(waiting) > self.max_queue:
            raise RequestError(503, "overloaded", f"{len(self._queue)} items are already waiting; retry later")
        self._queue.extend(waiting)
        self.metrics.queued.set(len(self._queue))
        self._arrived.set()
        return [w.future for w in waiting]

    async def _collect(self) -> None:
        slots = asyncio.Semaphore(self.workers)
        running: set[asyncio.Task] = set()
        while True:
            await slots.acquire()
            batch = await self._next_batch()
            if not batch:
                break
            self.metrics.queued.set(len(self._queue))
            task = asyncio.create_task(self._run(batch))
            running.add(task)
            task.add_done_callback(lambda t: (running.discard(t), slots.release()))
        if running:
            await asyncio.gather(*running)

    async def _next_batch(self) -> list[_Waiting]:
        """Up to ``max_batch`` items, once the oldest has waited ``max_wait``; [] when stopping with nothing left."""
        while not self._queue:
            if self._stopping:
                return []
            self._arrived.clear()
            await self._arrived.wait()
        # The deadline is measured from the oldest item's arrival, in wall time shared with submit.
        deadline = self._queue[0].enqueued + self.max_wait
        while len(self._queue) < self.max_batch and not self._stopping:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        return [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]

    async def _run(self, batch: list[_Waiting]) -> None:
        started = time.perf_counter()
        for waiting in batch:
            self.metrics.queue_wait.observe(started - waiting.enqueued)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run_waiting, batch)
        except Exception as exc:
            if len(batch) == 1:
                refused = table_index_error(exc, batch[0].item, self.session.signature)
                if refused is None:
                    logger.error("inference failed: %s: %s", type(exc).__name__, exc)
                _settle(batch[0].future, error=refused or exc)
                return
            # Something in the batch broke the run: retry alone so that only the culprit fails.
            for waiting in batch:
                await self._run([waiting])
            return
        for waiting, result in zip(batch, results, strict=True):
            # Finite inputs can still overflow inside the model: never answer NaN as a number.
            problem = output_problem(result)
            if problem:
                _settle(waiting.future, error=RequestError(422, problem.kind, problem.message))
            else:
                _settle(waiting.future, result)

    def _run_waiting(self, batch: list[_Waiting]) -> list[Result]:
        """Runs in a worker thread: the queued items batched by the planner, and each formed batch as it is."""
        results: list[Result | None] = [None] * len(batch)
        plain = [i for i, waiting in enumerate(batch) if not waiting.formed]
        if plain:
            for index, result in zip(plain, self._run_items([batch[i].item for i in plain]), strict=True):
                results[index] = result
        for index, waiting in enumerate(batch):
            if waiting.formed:
                start = time.perf_counter()
                results[index] = self.session.run(waiting.item)
                self.metrics.batch_size.observe(len(next(iter(waiting.item.values()))))
                self.metrics.batch_run.observe(time.perf_counter() - start)
        return results  # type: ignore[return-value]

    def _run_items(self, items: list[Item]) -> list[Result]:
        """Runs in a worker thread: pad, run, cut back (one run per key length if keys cannot be padded)."""
        start = time.perf_counter()
        signature = self.session.signature
        results: list[Result | None] = [None] * len(items)
        limits = BatchLimits(
            max_batch_tokens=self.max_batch_tokens,
            max_padding=self.max_padding,
            max_score_bytes=DEFAULT_MAX_SCORE_BYTES,
            score_bytes=score_bytes(self.session.metadata),
        )
        for indices in plan_batches(items, signature, limits):
            batch = collate([items[i] for i in indices], signature)
            outputs = self.session.run(batch.feeds)
            for index, result in zip(indices, split_outputs(outputs, batch, signature), strict=True):
                results[index] = result
            self.metrics.batch_size.observe(len(indices))
            self.metrics.padding.labels("real").inc(batch.real_tokens)
            self.metrics.padding.labels("padding").inc(batch.padded_tokens - batch.real_tokens)
        self.metrics.batch_run.observe(time.perf_counter() - start)
        return results  # type: ignore[return-value]


# ONNX Runtime's refusal of an index past the table a Gather (or GatherND) reads: ids the validator could not check
# because the file records no vocabulary and the graph's table is computed, not stored.
_INDEX_PAST_TABLE = re.compile(r"indices element out of data bounds, idx=(-?\d+)(?: must be within the inclusive "
                               r"range \[-?\d+,(-?\d+)\])?|invalid indice found, indice = (-?\d+)")


def table_index_error(exc: Exception, feeds: dict[str, np.ndarray], signature: Signature) -> RequestError | None:
    """A 400 naming the token input that holds the id ONNX Runtime found past a table, or None when ``exc`` is not
    that error or no token input holds the id."""
    found = _INDEX_PAST_TABLE.search(str(exc))
    if found is None:
        return None
    index = int(found.group(1) or found.group(3))
    for spec in signature.custom_inputs:
        if spec.role in ID_ROLES and spec.name in feeds and (np.asarray(feeds[spec.name]) == index).any():
            table = f": the model's table holds ids 0 to {found.group(2)}" if found.group(2) is not None else ""
            return RequestError(400, "id_out_of_range", f"{spec.name} holds id {index}, past the table its ids index "
                                                        f"in this model{table} (the file records no vocabulary)")
    return None


def _settle(future: asyncio.Future, result: Result | None = None, error: Exception | None = None) -> None:
    if future.done():  # the caller went away (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
