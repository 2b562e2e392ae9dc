"""The ASGI app: the /v1 and /v2 REST routes, API keys, the gRPC server's lifetime, and the batcher's.

Routes (the Open Inference Protocol's ``/v2/...`` routes are in ``rest_v2``):

- ``POST /v1/infer``: one item (see ``parsing``) -> its output. A JSON request gets
  ``{"output": [[...]], "provider": ..., "latency_ms": ...}`` (plus ``attn_weights``
  when the model returns them); an ``application/x-npy`` request gets the output as
  ``.npy``; an ``application/x-npz`` request gets an ``.npz`` with ``output`` (and
  ``attn_weights``). Binary responses carry ``X-Provider`` and ``X-Latency-Ms`` headers.
- ``GET /v1/model``: the model's recorded metadata.
- ``POST /v1/embeddings``: OpenAI's embeddings, for a file whose output is one vector per item (``embeddings``).
- ``GET /healthz``: 200 while the process serves HTTP at all (liveness).
- ``GET /readyz``: 200 once the model is loaded and warmed up, 503 while loading,
  after a failed load, and while draining on shutdown (readiness).
- ``GET /metrics``: Prometheus text.

Refused /v1 requests get ``{"error": {"kind": ..., "message": ...}}`` with a 4xx status
(400 unparsable, 408 body too slow, 413 body too large, 415 content type, 422 wrong
shape or values, 503 not ready or overloaded, with ``Retry-After``); an unexpected
failure gets a 500 of the same form that says only that (details go to the log).

With API keys, every route but liveness and readiness needs ``Authorization:
Bearer <key>`` (401 otherwise, before the body is read). Authorised requests
then take one of ``max_requests`` slots (503 when none is free). With a ``GrpcConfig``,
the lifespan starts a gRPC server in the same event loop, serving the same
``InferenceService``: REST and gRPC requests share one batcher.
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

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.runtime.session import MHASession
from mha_deploy.serving.http.auth import AUTHORIZED, ApiKeys, is_health_path
from mha_deploy.serving.http.body import read_body
from mha_deploy.serving.http.connections import RequestSlots, refusal
from mha_deploy.serving.http.embeddings import PATH as EMBEDDINGS_PATH
from mha_deploy.serving.http.embeddings import check_embedding_output, embedding_routes
from mha_deploy.serving.http.openai_routes import error_body
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
from mha_deploy.serving.http.rest_v2 import v2_routes
from mha_deploy.serving.http.server import EmbeddingOptions
from mha_deploy.serving.http.service import THREAD_THRESHOLD_BYTES, BatchingConfig, InferenceService

try:  # ~15x faster than tolist() + json.dumps for arrays of floats (part of the 'serve' extra)
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

__all__ = ["BatchingConfig", "create_app", "read_body"]
logger = logging.getLogger("mha_deploy.serve")
INTERNAL_ERROR = "internal error (the server log has the details)"


def create_app(
    load_session: Callable[[], MHASession],
    batching: BatchingConfig | None = None,
    limits: RequestLimits | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    *,
    model_name: str = "model",
    api_keys: ApiKeys | None = None,
    grpc_config=None,
    max_requests: int | None = None,
    embeddings: EmbeddingOptions | None = None,
    tokenizer=None,
) -> Starlette:
    """The app. ``load_session`` runs in a thread at startup (the port is open and /healthz answers meanwhile).

    ``model_name`` is the name the v2 protocol serves the model under; ``grpc_config``, a
    ``grpc_server.GrpcConfig``, adds the gRPC server; ``max_requests`` caps the requests
    (authorised ones, health checks aside) handled at once (``connections.RequestSlots``). ``embeddings`` says how
    ``POST /v1/embeddings`` serves a file whose output is one vector per item, and ``tokenizer`` (a
    ``PromptTokenizer``) turns its texts into ids.
    """
    batching = batching or BatchingConfig()
    limits = limits or RequestLimits()
    embeddings = embeddings or EmbeddingOptions()

    def load_checked() -> MHASession:
        session = load_session()
        check_embedding_output(session.signature, embeddings)  # a bad --embedding-output stops the start
        return session

    service = InferenceService(load_checked, batching, limits, model_name, on_load_error)
    metrics = service.metrics
    frontend = None
    if grpc_config is not None:
        from mha_deploy.serving.http.grpc_server import GrpcFrontend

        frontend = GrpcFrontend(service, grpc_config, api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loading = asyncio.create_task(service.load())
        if frontend is not None:
            try:
                await frontend.start()
            except Exception as exc:
                # Reported like a model that does not load: the server exits with this one message.
                logger.error("%s", exc)
                service.status = "failed"
                if on_load_error is not None:
                    on_load_error(exc)
        yield
        # Runs after uvicorn stopped accepting and every open request got its response.
        if frontend is not None:
            await frontend.stop()
        await loading
        await service.drain()
        logger.info("stopped: %d requests accepted, %d answered", service.accepted, service.answered)

    async def infer(request: Request) -> Response:
        start = time.perf_counter()
        kind = media_type(request.headers.get("content-type"))
        with service.track(kind if kind in CONTENT_TYPES else "other"):
            response = await _infer(request, kind, start)
        metrics.responses.labels(str(response.status_code)).inc()
        return response

    async def _infer(request: Request, kind: str, start: float) -> Response:
        try:
            session, batcher = service.require_ready()
            body = await read_body(request, limits)
            if len(body) > THREAD_THRESHOLD_BYTES:
                item = await run_in_threadpool(parse_request, body, kind, session.metadata, limits)
            else:
                item = parse_request(body, kind, session.metadata, limits)
            result = await batcher.submit(item)
            latency_ms = (time.perf_counter() - start) * 1e3
            return await _respond(kind, result, session.provider, latency_ms)
        except RequestError as exc:
            metrics.errors.labels(exc.kind).inc()
            return _v1_error(exc)
        except Exception:
            logger.exception("request failed")
            metrics.errors.labels("internal").inc()
            return JSONResponse({"error": {"kind": "internal", "message": INTERNAL_ERROR}}, status_code=500)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        body = {"status": service.status}
        if service.ready:
            body["provider"] = service.session.provider
        return JSONResponse(body, status_code=200 if service.ready else 503)

    async def model_info(request: Request) -> Response:
        if service.session is None:
            return JSONResponse({"error": {"kind": "not_ready", "message": f"the server is {service.status}"}}, 503)
        meta = service.session.metadata
        return JSONResponse({**dataclasses.asdict(meta), "provider": service.session.provider})

    async def metrics_endpoint(request: Request) -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if request.url.path == EMBEDDINGS_PATH:  # OpenAI's clients read OpenAI's error shape
            code = {405: "method_not_allowed"}.get(exc.status_code, "http_error")
            return JSONResponse(error_body(exc.status_code, code, str(exc.detail)), status_code=exc.status_code)
        if request.url.path.startswith("/v2"):
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"kind": kind, "message": str(exc.detail)}}, status_code=exc.status_code)

    routes = [
        Route("/v1/infer", infer, methods=["POST"]),
        Route("/v1/model", model_info, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *v2_routes(service),
        *embedding_routes(service, embeddings, tokenizer),
    ]
    # The key is checked first (outermost), so that only authorised requests take a slot.
    middleware = [Middleware(RequireApiKey, keys=api_keys)] if api_keys is not None else []
    if max_requests is not None:
        middleware.append(Middleware(RequestSlots, limit=max_requests))
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={HTTPException: http_error}
    )
    app.state.mha = service
    app.state.metrics = metrics
    app.state.grpc = frontend
    return app


class RequireApiKey:
    """ASGI middleware: 401 for any HTTP request but health checks without ``Authorization: Bearer <key>``."""

    def __init__(self, app, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        authorized = self.keys.allows(header.decode("latin-1") if header is not None else None)
        if authorized or is_health_path(scope["path"]):
            # Health checks answer anyone, but name the served model only to those with a key
            # (TrackedService.model_ready).
            scope.setdefault("state", {})[AUTHORIZED] = authorized
            return await self.app(scope, receive, send)
        message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
        await refusal(scope["path"], 401, "unauthenticated", message, {"WWW-Authenticate": "Bearer"})(
            scope, receive, send
        )


def _v1_error(exc: RequestError) -> Response:
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers)


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
