"""The ASGI app: routes, body limits, errors as JSON, readiness, and the batcher's lifetime.

Routes:

- ``POST /v1/infer``: one item (see ``parsing``) -> its output. A JSON request gets
  ``{"output": [[...]], "provider": ..., "latency_ms": ...}`` (plus ``attn_weights``
  when the model returns them); an ``application/x-npy`` request gets the output as
  ``.npy``; an ``application/x-npz`` request gets an ``.npz`` with ``output`` (and
  ``attn_weights``). Binary responses carry ``X-Provider`` and ``X-Latency-Ms`` headers.
- ``GET /v1/model``: the model's recorded metadata.
- ``GET /healthz``: 200 while the process serves HTTP at all (liveness).
- ``GET /readyz``: 200 once the model is loaded and warmed up, 503 while loading,
  after a failed load, and while draining on shutdown (readiness).
- ``GET /metrics``: Prometheus text.

Refused requests get ``{"error": {"kind": ..., "message": ...}}`` with a 4xx status
(400 unparsable, 413 body too large, 415 content type, 422 wrong shape or values,
503 not ready or overloaded); an unexpected failure gets a 500 of the same form.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.runtime.session import MHASession
from mha_deploy.serving.http.batcher import MicroBatcher
from mha_deploy.serving.http.metrics import ServerMetrics
from mha_deploy.serving.http.parsing import (
    CONTENT_TYPES,
    JSON,
    NPY,
    NPZ,
    RequestError,
    RequestLimits,
    media_type,
    parse_request,
)

try:  # ~15x faster than tolist() + json.dumps for arrays of floats (part of the 'serve' extra)
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

logger = logging.getLogger("mha_deploy.serve")
# Parsing and encoding bodies larger than this would hold the event loop for milliseconds: do it in a thread.
THREAD_THRESHOLD_BYTES = 256 * 1024


@dataclass(frozen=True)
class BatchingConfig:
    max_batch: int = 32
    max_wait_ms: float = 2.0
    workers: int = 1
    max_queue: int = 4096
    # Padded positions (items × longest sequence) in one ORT run: bounds a run's memory.
    max_batch_tokens: int = 8192


@dataclass
class _State:
    status: str = "loading"  # loading -> ready -> draining; or failed
    session: MHASession | None = None
    batcher: MicroBatcher | None = None
    accepted: int = 0
    answered: int = 0


def create_app(
    load_session: Callable[[], MHASession],
    batching: BatchingConfig | None = None,
    limits: RequestLimits | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> Starlette:
    """The app. ``load_session`` runs in a thread at startup (the port is open and /healthz answers meanwhile)."""
    batching = batching or BatchingConfig()
    limits = limits or RequestLimits()
    state = _State()
    metrics = ServerMetrics()

    async def load() -> None:
        try:
            session = await asyncio.to_thread(load_session)
            batcher = MicroBatcher(session, **dataclasses.asdict(batching), metrics=metrics)
            await batcher.start()
        except Exception as exc:
            state.status = "failed"
            logger.error("cannot load the model: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)
            return
        state.session, state.batcher, state.status = session, batcher, "ready"
        metrics.ready.set(1)
        logger.info("ready: %r, max_batch=%d max_wait_ms=%g", session, batching.max_batch, batching.max_wait_ms)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loading = asyncio.create_task(load())
        yield
        # Runs after uvicorn stopped accepting and every open request got its response.
        if state.status == "ready":
            state.status = "draining"
        metrics.ready.set(0)
        await loading
        if state.batcher is not None:
            await state.batcher.stop()
        logger.info("stopped: %d requests accepted, %d answered", state.accepted, state.answered)

    async def infer(request: Request) -> Response:
        start = time.perf_counter()
        state.accepted += 1
        metrics.in_flight.inc()
        try:
            response = await _infer(request, start)
        finally:
            metrics.in_flight.dec()
            state.answered += 1
        metrics.responses.labels(str(response.status_code)).inc()
        metrics.latency.observe(time.perf_counter() - start)
        return response

    async def _infer(request: Request, start: float) -> Response:
        kind = media_type(request.headers.get("content-type"))
        metrics.requests.labels(kind if kind in CONTENT_TYPES else "other").inc()
        try:
            if state.status != "ready":
                raise RequestError(503, "not_ready", f"the server is {state.status}")
            session, batcher = state.session, state.batcher
            body = await read_body(request, limits.max_body_bytes)
            if len(body) > THREAD_THRESHOLD_BYTES:
                item = await run_in_threadpool(parse_request, body, kind, session.metadata, limits)
            else:
                item = parse_request(body, kind, session.metadata, limits)
            result = await batcher.submit(item)
            latency_ms = (time.perf_counter() - start) * 1e3
            return await _respond(kind, result, session.provider, latency_ms)
        except RequestError as exc:
            metrics.errors.labels(exc.kind).inc()
            return JSONResponse(exc.to_json(), status_code=exc.status)
        except Exception as exc:
            logger.exception("request failed")
            metrics.errors.labels("internal").inc()
            message = f"internal error: {type(exc).__name__}: {exc}"
            return JSONResponse({"error": {"kind": "internal", "message": message}}, status_code=500)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        body = {"status": state.status}
        if state.status == "ready":
            body["provider"] = state.session.provider
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    async def model_info(request: Request) -> Response:
        if state.session is None:
            return JSONResponse({"error": {"kind": "not_ready", "message": f"the server is {state.status}"}}, 503)
        meta = state.session.metadata
        return JSONResponse({**dataclasses.asdict(meta), "provider": state.session.provider})

    async def metrics_endpoint(request: Request) -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"kind": kind, "message": str(exc.detail)}}, status_code=exc.status_code)

    routes = [
        Route("/v1/infer", infer, methods=["POST"]),
        Route("/v1/model", model_info, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.mha = state
    app.state.metrics = metrics
    return app


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed ``max_bytes``."""
    too_large = RequestError(413, "body_too_large", f"request body exceeds this server's limit of {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, "bad_content_length", f"Content-Length {declared!r} is not a number")
        if int(declared) > max_bytes:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _respond(kind: str, result: dict[str, np.ndarray], provider: str, latency_ms: float) -> Response:
    size = result["output"].nbytes * 4  # rough size of the encoded body
    encode = _encode_json if kind == JSON else _encode_npy if kind == NPY else _encode_npz
    if size > THREAD_THRESHOLD_BYTES:
        body = await run_in_threadpool(encode, result, provider, latency_ms)
    else:
        body = encode(result, provider, latency_ms)
    if kind == JSON:
        return Response(body, media_type=JSON)
    headers = {"X-Provider": provider, "X-Latency-Ms": f"{latency_ms:.3f}"}
    return Response(body, media_type=NPY if kind == NPY else NPZ, headers=headers)


def _encode_json(result: dict[str, np.ndarray], provider: str, latency_ms: float) -> bytes:
    # Both print each float32 with the shortest digits that read back as the same float32.
    if orjson is not None:
        payload = {name: np.ascontiguousarray(array) for name, array in result.items()}
        payload.update(provider=provider, latency_ms=round(latency_ms, 3))
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    payload = {name: array.tolist() for name, array in result.items()}
    payload.update(provider=provider, latency_ms=round(latency_ms, 3))
    return json.dumps(payload, separators=(",", ":")).encode()


def _encode_npy(result: dict[str, np.ndarray], provider: str, latency_ms: float) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(result["output"]), allow_pickle=False)
    return buffer.getvalue()


def _encode_npz(result: dict[str, np.ndarray], provider: str, latency_ms: float) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.ascontiguousarray(array) for name, array in result.items()})
    return buffer.getvalue()
