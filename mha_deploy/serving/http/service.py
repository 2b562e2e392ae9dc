"""What every protocol of one server process shares: the model's lifetime, the micro-batcher, and the counters.

REST (/v1 and /v2) and gRPC are thin adapters over one ``InferenceService``:
requests from all of them go into the same ``MicroBatcher`` and so share ORT
runs, and readiness, draining and the accepted/answered counts are the same
for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from mha_deploy.batching import BatchingConfig
from mha_deploy.runtime.session import MHASession
from mha_deploy.serving.http import v2
from mha_deploy.serving.http.batcher import MicroBatcher
from mha_deploy.serving.http.metrics import ServerMetrics
from mha_deploy.serving.http.parsing import RequestError, RequestLimits

logger = logging.getLogger("mha_deploy.serve")
# Decoding and checking requests larger than this would hold the event loop for milliseconds: do it in a thread.
THREAD_THRESHOLD_BYTES = 256 * 1024


class TrackedService:
    """What every served model counts, whatever it serves: requests accepted and answered (the SIGTERM log line
    reports them), in flight and their latency (its ``metrics``' gauges), and whether it is ready."""

    status: str
    accepted: int
    answered: int
    model_name: str

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def check_model(self, name: str, version: str = "") -> None:
        """404 unless ``name`` (and ``version``, when given) is the model this server serves; the message names the
        served model (only callers with a key get here: see ``model_ready``)."""
        if name != self.model_name:
            raise RequestError(404, "unknown_model", f"unknown model {name!r}: this server serves {self.model_name!r}")
        if version not in ("", v2.MODEL_VERSION):
            raise RequestError(404, "unknown_version", f"model {name!r} has version {v2.MODEL_VERSION} only")

    def model_ready(self, name: str, version: str, authorized: bool) -> bool:
        """A health check of model ``name``: whether it can take requests. Health checks answer callers without a
        key too, but only one with a key learns which model is served (a 404 naming it, for another name): one
        without gets the server's readiness whatever name it asks, so that no answer tells the served name from a
        guess."""
        if authorized:
            self.check_model(name, version)
        return self.ready

    @contextlib.contextmanager
    def track(self, protocol: str) -> Iterator[None]:
        """Count one request from arrival to response."""
        start = time.perf_counter()
        self.accepted += 1
        self.metrics.in_flight.inc()
        self.metrics.requests.labels(protocol).inc()
        try:
            yield
        finally:
            self.metrics.in_flight.dec()
            self.answered += 1
            self.metrics.latency.observe(time.perf_counter() - start)


class InferenceService(TrackedService):
    """The loaded model and its batcher, with a status: loading -> ready -> draining (or failed)."""

    def __init__(
        self,
        load_session: Callable[[], MHASession],
        batching: BatchingConfig,
        limits: RequestLimits,
        model_name: str,
        on_load_error: Callable[[BaseException], None] | None = None,
    ):
        self._load_session = load_session
        self.batching = batching
        self.limits = limits
        self.model_name = model_name
        self._on_load_error = on_load_error
        self.metrics = ServerMetrics()
        self.status = "loading"
        self.session: MHASession | None = None
        self.batcher: MicroBatcher | None = None
        self.accepted = 0
        self.answered = 0

    async def load(self) -> None:
        try:
            session = await asyncio.to_thread(self._load_session)
            batcher = MicroBatcher(session, self.batching, metrics=self.metrics)
            await batcher.start()
        except Exception as exc:
            self.status = "failed"
            logger.error("cannot load the model: %s", exc)
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self.session, self.batcher = session, batcher
        if self.status != "loading":  # another part failed to start (the gRPC port): the server is exiting
            return
        self.status = "ready"
        self.metrics.ready.set(1)
        logger.info(
            "ready: model %r %r, max_batch=%d max_wait_ms=%g",
            self.model_name, session, self.batching.max_batch, self.batching.max_wait_ms,
        )

    async def drain(self) -> None:
        """Run everything already submitted, then stop the batcher."""
        if self.status == "ready":
            self.status = "draining"
        self.metrics.ready.set(0)
        if self.batcher is not None:
            await self.batcher.stop()

    def require_ready(self) -> tuple[MHASession, MicroBatcher]:
        if self.status != "ready":
            raise RequestError(503, "not_ready", f"the server is {self.status}")
        return self.session, self.batcher  # type: ignore[return-value]

    async def infer_v2(
        self, inputs: Mapping[str, np.ndarray], in_thread: bool = False
    ) -> dict[str, np.ndarray]:
        """A v2 batch request's outputs (every output, shaped as the request's batch)."""
        session, batcher = self.require_ready()
        metadata = session.metadata
        if in_thread:
            plan = await asyncio.to_thread(v2.plan_request, metadata, inputs, self.limits.max_item_tokens)
        else:
            plan = v2.plan_request(metadata, inputs, self.limits.max_item_tokens)
        return await v2.run_plan(plan, batcher, metadata)
