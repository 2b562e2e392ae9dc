"""The Open Inference Protocol's REST routes (``/v2/...``), with Triton's binary tensor data extension.

- ``GET /v2/health/live``, ``/v2/health/ready``: liveness and readiness (200, or 503 while not ready).
- ``GET /v2``: server metadata (name, version, extensions).
- ``GET /v2/models/{name}[/versions/1]``: model metadata, every tensor's datatype and shape (-1: dynamic).
- ``GET /v2/models/{name}[/versions/1]/ready``: 200 when the model can take requests.
- ``POST /v2/models/{name}[/versions/1]/infer``: ``{"id", "inputs": [{"name", "shape", "datatype",
  "data"}], "outputs": [{"name", "parameters": {"binary_data": bool}}], "parameters":
  {"binary_data_output": bool}}``.

The binary tensor data extension (what tritonclient sends by default): the body
starts with ``Inference-Header-Content-Length`` bytes of that JSON, then the raw
little-endian data of every input whose ``parameters.binary_data_size`` says how
many bytes it has, in the order of ``inputs``. Outputs asked for as binary come
back the same way (the response's ``Inference-Header-Content-Length`` header
says where its JSON ends); the others as JSON ``data`` (flat, row-major).

Errors are ``{"error": "..."}``: 400 for a bad request, 404 for an unknown
model, 413 for a body over the limit, 408 for a body that arrives too slowly,
503 (with ``Retry-After``) when not ready or the queue is full.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mha_deploy.metadata import ModelMetadata
from mha_deploy.serving.http import v2
from mha_deploy.serving.http.auth import is_authorized
from mha_deploy.serving.http.body import read_body
from mha_deploy.serving.http.parsing import RequestError, is_decimal, load_json
from mha_deploy.serving.http.service import THREAD_THRESHOLD_BYTES, InferenceService, TrackedService

try:  # ~15x faster than tolist() + json.dumps for arrays of floats (part of the 'serve' extra)
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

logger = logging.getLogger("mha_deploy.serve")
HEADER_LENGTH = "inference-header-content-length"
BINARY = "application/octet-stream"


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (name, as binary), in the order asked


def error_response(exc: RequestError) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


def v2_routes(service: InferenceService) -> list[Route]:
    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": service.ready}, status_code=200 if service.ready else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(v2.server_metadata())

    async def model_ready(request: Request) -> Response:
        return model_ready_response(service, request)

    async def model_metadata(request: Request) -> Response:
        try:
            _check_model(request)
            session, _ = service.require_ready()
        except RequestError as exc:
            return error_response(exc)
        return JSONResponse(v2.model_metadata(service.model_name, session.metadata))

    async def infer(request: Request) -> Response:
        binary = HEADER_LENGTH in request.headers
        with service.track("v2_binary" if binary else "v2_json"):
            response = await _infer(request)
        service.metrics.responses.labels(str(response.status_code)).inc()
        return response

    async def _infer(request: Request) -> Response:
        try:
            _check_model(request)
            session, _ = service.require_ready()
            encoding = request.headers.get("content-encoding", "identity").lower()
            if encoding != "identity":
                raise RequestError(400, "unsupported_encoding", f"Content-Encoding {encoding!r} is not supported")
            body = await read_body(request, service.limits)
            large = len(body) > THREAD_THRESHOLD_BYTES
            header_length = request.headers.get(HEADER_LENGTH)
            args = (body, header_length, session.metadata, service.limits.max_item_tokens)
            parsed = await run_in_threadpool(parse_infer_request, *args) if large else parse_infer_request(*args)
            outputs = await service.infer_v2(parsed.inputs, in_thread=large)
            args = (service.model_name, parsed, outputs)
            content, json_length = await run_in_threadpool(encode_response, *args) if large else encode_response(*args)
        except RequestError as exc:
            service.metrics.errors.labels(exc.kind).inc()
            return error_response(exc)
        except Exception:
            logger.exception("v2 inference request failed")
            service.metrics.errors.labels("internal").inc()
            return JSONResponse({"error": "internal error (the server log has the details)"}, status_code=500)
        if json_length is None:
            return Response(content, media_type="application/json")
        return Response(content, media_type=BINARY, headers={"Inference-Header-Content-Length": str(json_length)})

    def _check_model(request: Request) -> None:
        service.check_model(request.path_params["name"], request.path_params.get("version", ""))

    routes = [
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata, methods=["GET"]),
            Route(f"{prefix}/ready", model_ready, methods=["GET"]),
            Route(f"{prefix}/infer", infer, methods=["POST"]),
        ]
    return routes


def model_ready_response(service: TrackedService, request: Request) -> Response:
    """``GET /v2/models/{name}[/versions/{version}]/ready`` of any server here (a health check: see
    ``TrackedService.model_ready``); the body names the model only to a caller with a key."""
    params = request.path_params
    authorized = is_authorized(request.scope)
    try:
        ready = service.model_ready(params["name"], params.get("version", ""), authorized)
    except RequestError as exc:
        return error_response(exc)
    body = {"name": service.model_name, "ready": ready} if authorized else {"ready": ready}
    return JSONResponse(body, status_code=200 if ready else 503)


# --- request and response bodies (no starlette below) -------------------------------------------


def parse_infer_request(
    body: bytes, header_length: str | None, metadata: ModelMetadata, max_item_tokens: int
) -> InferRequest:
    """An inference request body (JSON, or JSON then binary tensors) -> checked input arrays."""
    view = memoryview(body)
    if header_length is None:
        header, tail = view, view[len(view) :]
    else:
        if not is_decimal(header_length) or int(header_length) > len(body):
            raise v2.bad_request(
                "bad_header_length",
                f"Inference-Header-Content-Length {header_length!r} is not a length within the {len(body)}-byte body",
            )
        header, tail = view[: int(header_length)], view[int(header_length) :]
    payload = load_json(header, "the inference request header")
    if not isinstance(payload, dict):
        raise v2.bad_request("malformed_json", "the inference request must be a JSON object")
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise v2.bad_request("bad_id", f"id must be a string, got {type(request_id).__name__}")
    parameters = _parameters(payload, "the request")
    binary_default = parameters.get("binary_data_output", False) is True

    tensors = payload.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise v2.bad_request("no_inputs", "the request needs a non-empty list of inputs")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for tensor in tensors:
        if not isinstance(tensor, dict):
            raise v2.bad_request("bad_input", "each input must be an object with name, shape, datatype and data")
        name = tensor.get("name")
        dtype = v2.check_declared(metadata, name, tensor.get("datatype"), tensor.get("shape"), max_item_tokens)
        if name in inputs:
            raise v2.bad_request("duplicate_input", f"input {name} is given twice")
        tensor_parameters = _parameters(tensor, f"input {name}")
        size = tensor_parameters.get("binary_data_size")
        if size is not None and "data" in tensor:
            # Which of the two is meant is unknown (gRPC refuses raw and typed contents together too).
            raise v2.bad_request("bad_data", f"input {name}: give data or parameters.binary_data_size, not both")
        if size is not None:
            if type(size) is not int or size < 0 or offset + size > len(tail):
                raise v2.bad_request(
                    "wrong_data_size", f"input {name}: binary_data_size {size!r} runs past the end of the body"
                )
            inputs[name] = v2.array_from_bytes(name, dtype, tensor["shape"], tail[offset : offset + size])
            offset += size
        elif "data" in tensor:
            inputs[name] = v2.array_from_list(name, dtype, tensor["shape"], tensor["data"])
        else:
            raise v2.bad_request("no_data", f"input {name} has neither data nor parameters.binary_data_size")
    if offset != len(tail):
        raise v2.bad_request(
            "wrong_data_size", f"the body has {len(tail) - offset} bytes of binary data that no input claims"
        )
    return InferRequest(request_id, inputs, _requested_outputs(payload, metadata, binary_default))


def _parameters(document: dict, what: str) -> dict:
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise v2.bad_request("bad_parameters", f"parameters of {what} must be an object")
    return parameters


def _requested_outputs(payload: dict, metadata: ModelMetadata, binary_default: bool) -> list[tuple[str, bool]]:
    requested = payload.get("outputs")
    if requested is None:
        return [(name, binary_default) for name in v2.check_outputs(metadata, None)]
    if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
        raise v2.bad_request("bad_outputs", "outputs must be a list of objects with a name")
    binary = {}
    for output in requested:
        if not isinstance(output.get("name"), str):
            raise v2.bad_request("bad_outputs", "each requested output needs a name (a string)")
        parameters = _parameters(output, f"output {output['name']!r}")
        if parameters.get("classification"):
            raise v2.bad_request("unsupported", "the classification extension is not supported")
        binary[output.get("name")] = parameters.get("binary_data", binary_default) is True
    names = v2.check_outputs(metadata, list(binary))
    return [(name, binary[name]) for name in names]


def encode_response(model_name: str, request: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[bytes, int | None]:
    """The response body, and where its JSON ends when binary outputs follow it (else None)."""
    tensors, chunks = [], []
    for name, binary in request.outputs:
        array = np.ascontiguousarray(outputs[name])
        tensor = {"name": name, "datatype": v2.DATATYPES[array.dtype.name], "shape": list(array.shape)}
        if binary:
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = array.ravel() if orjson is not None else array.ravel().tolist()
        tensors.append(tensor)
    document = {"model_name": model_name, "model_version": v2.MODEL_VERSION, "outputs": tensors}
    if request.id is not None:
        document["id"] = request.id
    if orjson is not None:
        header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    else:
        header = json.dumps(document, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)
