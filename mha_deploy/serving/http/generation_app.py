"""The ASGI app of a generator (a KV-cache decoder): OpenAI's routes, Triton's generate extension, the v2 protocol's
health and metadata, and the same API keys, request slots, health checks and metrics as every server here.

- ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``: ``openai_routes``.
- ``/v1/embeddings``: 400, a generator returns tokens, not embeddings (``embeddings`` serves an encoder's).
- ``/v2/models/NAME/generate``, ``/generate_stream``: ``triton_generate``.
- ``/v2/health/live|ready``, ``/v2``, ``/v2/models/NAME[/ready]``: as for any model; the metadata describes the
  generator as what it serves (``text_input`` -> ``text_output``, the batching it does, its KV budget), and
  ``/v2/models/NAME/infer`` answers 400 pointing to the generation routes (tensors in, tensors out does not fit a
  loop that chooses tokens).
- ``/healthz``, ``/readyz``, ``/metrics``.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.serving.http import v2
from mha_deploy.serving.http.app import RequireApiKey
from mha_deploy.serving.http.auth import ApiKeys
from mha_deploy.serving.http.connections import RequestSlots
from mha_deploy.serving.http.embeddings import generator_refusal
from mha_deploy.serving.http.generation import GenerationService
from mha_deploy.serving.http.openai_routes import error_body, openai_routes
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.serving.http.rest_v2 import model_ready_response
from mha_deploy.serving.http.triton_generate import triton_generate_routes

logger = logging.getLogger("mha_deploy.serve")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def create_generation_app(
    service: GenerationService,
    *,
    api_keys: ApiKeys | None = None,
    max_requests: int | None = None,
    drain_timeout_s: float | None = None,
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.load()
        yield
        await service.drain(drain_timeout_s)
        logger.info("stopped: %d requests accepted, %d answered", service.accepted, service.answered)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        return JSONResponse({"status": service.status}, status_code=200 if service.ready else 503)

    async def metrics_endpoint(request: Request) -> Response:
        content, content_type = service.metrics.render()
        return Response(content, media_type=content_type)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": service.ready}, status_code=200 if service.ready else 503)

    async def server_metadata(request: Request) -> Response:
        meta = v2.server_metadata()
        meta["extensions"] = [*meta["extensions"], "generate"]
        return JSONResponse(meta)

    def known(request: Request) -> Response | None:
        """A 404 unless the path names the served model (routes only callers with a key reach)."""
        try:
            service.check_model(request.path_params["name"], request.path_params.get("version", ""))
        except RequestError as exc:
            return JSONResponse({"error": exc.message}, exc.status)
        return None

    async def model_ready(request: Request) -> Response:
        return model_ready_response(service, request)

    async def model_metadata(request: Request) -> Response:
        refused = known(request)
        if refused is not None:
            return refused
        if not service.ready:
            return JSONResponse({"error": f"the server is {service.status}"}, 503, headers={"Retry-After": "1"})
        engine = service.engine
        features = getattr(engine.stepper, "source_features", None)
        return JSONResponse({
            "name": service.model_name,
            "versions": [v2.MODEL_VERSION],
            "platform": v2.PLATFORM,
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]},
                       {"name": "input_ids", "datatype": "INT64", "shape": [-1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]},
                        {"name": "output_ids", "datatype": "INT64", "shape": [-1]}],
            "parameters": {
                "generator": True,
                "routes": [f"/v2/models/{service.model_name}/generate",
                           f"/v2/models/{service.model_name}/generate_stream", *OPENAI_PATHS],
                "batching": engine.batching,
                "max_kv_tokens": engine.budget.max_kv_tokens,
                "max_running": engine.max_running,
                "vocab_size": engine.stepper.graph.vocab_size,
                "max_length": service.settings.max_length,
                "max_new_tokens": service.settings.max_new_tokens,
                "eos_token_ids": list(service.settings.eos_token_ids),
                "encoder_decoder": engine.stepper.encoder is not None,
                # an encoder-decoder: a prompt (input_ids, text_input) is its source, which this file encodes
                "encoder": engine.stepper.encoder.source if engine.stepper.encoder is not None else None,
                "decoder_start_token_id": engine.stepper.decoder_start_token_id,
                "max_target_tokens": engine.limits.target_max_length,
                # an encoder of features (Whisper): the source a request sends as input_features, not a prompt
                "input_features": None if features is None else {
                    "name": features.name, "shape": list(features.axes[1:]), "dtype": features.dtype},
                # what an encoder-decoder's requests may add (seq2seq_fields); recorded default for the forced id
                "forced_bos_token_id": getattr(engine.stepper.generation_ids, "forced_bos_token_id", None),
                "tokenizer": service.tokenizer is not None,
                "chat_template": service.chat_template is not None,
            },
        })

    async def infer(request: Request) -> Response:
        return known(request) or JSONResponse({"error": (
            f"{service.model_name!r} is a generator (a KV-cache decoder): POST /v2/models/{service.model_name}"
            "/generate (Triton's generate extension) or /v1/completions, not /infer")}, status_code=400)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        if request.url.path.startswith(OPENAI_PATHS):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            return JSONResponse(error_body(exc.status_code, code, str(exc.detail)), status_code=exc.status_code)
        if request.url.path.startswith("/v2"):
            return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"kind": kind, "message": str(exc.detail)}}, status_code=exc.status_code)

    model_paths = ("/v2/models/{name}", "/v2/models/{name}/versions/{version}")
    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        *openai_routes(service),
        generator_refusal(service.model_name),
        *triton_generate_routes(service),
        *(Route(path, model_metadata, methods=["GET"]) for path in model_paths),
        *(Route(path + "/ready", model_ready, methods=["GET"]) for path in model_paths),
        *(Route(path + "/infer", infer, methods=["POST"]) for path in model_paths),
    ]
    middleware = [Middleware(RequireApiKey, keys=api_keys)] if api_keys is not None else []
    if max_requests is not None:
        middleware.append(Middleware(RequestSlots, limit=max_requests))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: http_error})
    app.state.mha = service
    app.state.metrics = service.metrics
    app.state.grpc = None
    return app


def load_chat_template(path) -> object:
    """A jinja2 chat template from a file, compiled in jinja2's sandbox (a template is code: it may not reach
    Python's internals), with ``raise_exception`` as Hugging Face's templates call it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    with open(path, encoding="utf-8") as handle:
        return environment.from_string(handle.read())

