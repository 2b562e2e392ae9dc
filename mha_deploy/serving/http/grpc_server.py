"""gRPC: the Open Inference Protocol's ``inference.GRPCInferenceService`` on grpc.aio, beside the REST server.

Runs in the same event loop as uvicorn and serves the same ``InferenceService``,
so gRPC and REST requests share one micro-batcher and one ORT session. The
service definition and its generated stubs are tritonclient's
(``tritonclient.grpc.service_pb2``/``service_pb2_grpc``, the ones Triton's
clients use): ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata and ModelInfer are served; every other method answers
UNIMPLEMENTED.

ModelInfer takes tensors as ``raw_input_contents`` (what tritonclient sends:
one raw little-endian buffer per input, in the order of ``inputs``) or as typed
``contents`` (``fp32_contents``, ``bool_contents``; FP16 has no typed field, so
it must be raw). Outputs always come back as ``raw_output_contents``.

Every method is registered as client-streaming, which is the same on the wire
as unary, so that a call is handled from its arrival, before its message: the
API key (in the call's metadata) is checked first, then the message must
arrive within ``receive_timeout_s`` (DEADLINE_EXCEEDED otherwise), and only
then does the call take one of ``max_concurrent_rpcs`` slots. So calls without
a key, or whose message never comes, cannot take the slots of authorised
ones. The message is decoded here too: a malformed one is INVALID_ARGUMENT, a
large one is decoded in a thread, off the event loop.

Status codes: INVALID_ARGUMENT (REST's 400), NOT_FOUND (404), UNAUTHENTICATED,
UNAVAILABLE (503: not ready, or the queue is full), RESOURCE_EXHAUSTED (a
message over the size limit, or more concurrent calls than allowed),
DEADLINE_EXCEEDED (a message that did not arrive in time), INTERNAL with no
details (500). Details never carry a file path or a traceback.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from mha_deploy.errors import MHADeployError
from mha_deploy.metadata import ModelMetadata
from mha_deploy.serving.http import v2
from mha_deploy.serving.http.auth import HEALTH_METHODS, ApiKeys
from mha_deploy.serving.http.parsing import RequestError
from mha_deploy.serving.http.service import THREAD_THRESHOLD_BYTES, InferenceService

logger = logging.getLogger("mha_deploy.serve")
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# Protocol datatype -> the typed contents field that carries it (FP16 has none: raw only).
TYPED_CONTENTS = {"FP32": "fp32_contents", "BOOL": "bool_contents", "INT64": "int64_contents"}
_VARINT_CONTENTS = {"int64_contents"}
# Whether the call being handled presented a valid API key (always, without keys): health calls answer
# anyone, but name the served model only to those who did (``TrackedService.model_ready``).
_AUTHORIZED: contextvars.ContextVar[bool] = contextvars.ContextVar("authorized", default=True)
# The size of the call's request message as it arrived (ByteSize would walk a large message on the event loop).
_MESSAGE_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("message_bytes", default=0)


class GrpcServeError(MHADeployError):
    """The gRPC server cannot start (port in use, unreadable certificate)."""


@dataclass(frozen=True)
class GrpcConfig:
    host: str = "127.0.0.1"
    port: int = 8001
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Largest request message (gRPC refuses larger ones with RESOURCE_EXHAUSTED before they reach the servicer).
    max_message_bytes: int = 64 * 2**20
    # Calls handled at once (counted once authorised and received); more get RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int | None = 1000
    # On shutdown: how long calls in flight may take before they are cancelled.
    grace_s: float = 30.0
    # How long a call's request message may take to arrive (REST's body timeout); also bounds the shutdown.
    receive_timeout_s: float = 10.0
    # A connection with no call in progress is closed after this long (REST's idle timeout); None: never.
    idle_timeout_s: float | None = 5.0


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        service: InferenceService,
        api_keys: ApiKeys | None = None,
        max_calls: int | None = None,
        receive_timeout_s: float = 10.0,
    ):
        self.service = service
        self.api_keys = api_keys
        self.max_calls = max_calls
        self.receive_timeout_s = receive_timeout_s
        self.in_flight = 0  # calls whose request reached a handler and that have not answered yet

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.service.ready)

    async def ModelReady(self, request, context):
        async def answer():
            return pb.ModelReadyResponse(ready=self.service.model_ready(request.name, request.version,
                                                                        _AUTHORIZED.get()))

        return await self._answer(context, answer, slot=False)

    async def ServerMetadata(self, request, context):
        async def answer():
            return pb.ServerMetadataResponse(**v2.server_metadata())

        return await self._answer(context, answer)

    async def ModelMetadata(self, request, context):
        async def answer():
            self.service.check_model(request.name, request.version)
            session, _ = self.service.require_ready()
            document = v2.model_metadata(self.service.model_name, session.metadata)
            tensors = {key: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in document.pop(key)]
                       for key in ("inputs", "outputs")}
            return pb.ModelMetadataResponse(**document, **tensors)

        return await self._answer(context, answer)

    async def ModelInfer(self, request, context):
        async def answer():
            self.service.check_model(request.model_name, request.model_version)
            session, _ = self.service.require_ready()
            metadata = session.metadata
            large = _MESSAGE_BYTES.get() > THREAD_THRESHOLD_BYTES  # typed contents too, not only raw ones
            max_item_tokens = self.service.limits.max_item_tokens
            if large:
                inputs, names = await asyncio.to_thread(decode_request, request, metadata, max_item_tokens)
            else:
                inputs, names = decode_request(request, metadata, max_item_tokens)
            outputs = await self.service.infer_v2(inputs, in_thread=large)
            return encode_response(self.service.model_name, request.id, outputs, names)

        with self.service.track("grpc"):
            return await self._answer(context, answer, count=True)

    async def _answer(self, context, answer: Callable[[], Awaitable], slot: bool = True, count: bool = False):
        """``answer()`` in one of the ``max_calls`` slots (health checks need none), or the call aborted with
        the status code of what went wrong."""
        if slot and self.max_calls is not None and self.in_flight >= self.max_calls:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is handling its limit of {self.max_calls} calls"
            )
        self.in_flight += 1
        try:
            return await self._answer_or_abort(context, answer, count)
        finally:
            self.in_flight -= 1

    async def _answer_or_abort(self, context, answer: Callable[[], Awaitable], count: bool):
        try:
            response = await answer()
            if count:
                self.service.metrics.responses.labels("OK").inc()
            return response
        except RequestError as exc:
            error = exc
        except Exception:
            logger.exception("gRPC call failed")
            error = RequestError(500, "internal", "internal error (the server log has the details)")
        code = STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)
        if count:
            self.service.metrics.errors.labels(error.kind).inc()
            self.service.metrics.responses.labels(code.name).inc()
        await context.abort(code, error.message)

    def _authorized(self, context) -> bool:
        if self.api_keys is None:
            return True
        metadata = {key.lower(): value for key, value in context.invocation_metadata() or ()}
        return self.api_keys.allows(metadata.get("authorization"))

    def on_arrival(self, method: str, request_type):
        """The behaviour of a client-streaming handler for ``method``: key, message within the deadline,
        decoding, then the method itself (see the module docstring)."""
        health = f"/{SERVICE.full_name}/{method}" in HEALTH_METHODS

        async def behaviour(request_iterator, context):
            authorized = self._authorized(context)
            if not authorized and not health:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send 'authorization: Bearer <key>'"
                )
            try:
                raw = await asyncio.wait_for(context.read(), self.receive_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):  # distinct types before Python 3.11
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request message did not arrive within {self.receive_timeout_s:g} s",
                )
            if raw is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the call carried no request message")
            try:
                if len(raw) > THREAD_THRESHOLD_BYTES:
                    request = await asyncio.to_thread(request_type.FromString, raw)
                else:
                    request = request_type.FromString(raw)
            except DecodeError:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid {request_type.__name__}"
                )
            _AUTHORIZED.set(authorized)
            _MESSAGE_BYTES.set(len(raw))
            return await getattr(self, method)(request, context)

        return behaviour


def method_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Every method of the service, each as a client-streaming handler of ``servicer.on_arrival``."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.stream_unary_rpc_method_handler(
            servicer.on_arrival(method.name, request_type), response_serializer=response_type.SerializeToString
        )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def _unimplemented(name: str):
    async def method(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by this server")

    method.__name__ = name
    return method


for _method in SERVICE.methods:
    if _method.name not in InferenceServicer.__dict__:
        setattr(InferenceServicer, _method.name, _unimplemented(_method.name))


def decode_request(
    request: pb.ModelInferRequest, metadata: ModelMetadata, max_item_tokens: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The request's input arrays (checked) and the names of the outputs it asks for."""
    if not request.inputs:
        raise v2.bad_request("no_inputs", "the request needs at least one input")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise v2.bad_request(
            "wrong_data_size", f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input"
        )
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        shape = list(tensor.shape)
        dtype = v2.check_declared(metadata, tensor.name, tensor.datatype, shape, max_item_tokens)
        if tensor.name in inputs:
            raise v2.bad_request("duplicate_input", f"input {tensor.name} is given twice")
        filled = [field.name for field, _ in tensor.contents.ListFields()]
        if raw:
            if filled:
                raise v2.bad_request("bad_data", f"input {tensor.name}: give raw_input_contents or contents, not both")
            inputs[tensor.name] = v2.array_from_bytes(tensor.name, dtype, shape, raw[index])
            continue
        field = TYPED_CONTENTS.get(tensor.datatype)
        if field is None:
            raise v2.bad_request("bad_data", f"input {tensor.name}: {tensor.datatype} data must be raw_input_contents")
        if filled not in ([field], []) or (not filled and math.prod(shape)):
            raise v2.bad_request("bad_data", f"input {tensor.name}: {tensor.datatype} data goes in contents.{field}")
        if field in _VARINT_CONTENTS:
            # Packed as varints on the wire, not fixed-width: listed (token ids are short).
            inputs[tensor.name] = v2.array_from_list(tensor.name, dtype, shape, list(getattr(tensor.contents, field)))
        else:
            inputs[tensor.name] = v2.array_from_bytes(tensor.name, dtype, shape, _packed_values(tensor.contents))
    for output in request.outputs:
        if "classification" in output.parameters:
            raise v2.bad_request("unsupported", "the classification extension is not supported")
    names = v2.check_outputs(metadata, [output.name for output in request.outputs] or None)
    return inputs, names


def _packed_values(contents: pb.InferTensorContents) -> bytes:
    """The values of the one typed field set in ``contents``, as raw little-endian bytes, read off the wire form.

    Packed fp32 is 4 little-endian bytes per value and packed bool one byte (0 or 1) per value, what
    ``array_from_bytes`` takes. Listing a field of 15M floats in Python instead holds the GIL, and so the event
    loop, for a second even in a thread.
    """
    wire = contents.SerializeToString()  # one field: its tag, its length, then the packed values
    position = 0
    for _ in range(2):  # skip the tag and the length (varints)
        while position < len(wire) and wire[position] & 0x80:
            position += 1
        position += 1
    return wire[position:]


def encode_response(
    model_name: str, request_id: str, outputs: dict[str, np.ndarray], names: list[str]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model_name, model_version=v2.MODEL_VERSION, id=request_id)
    for name in names:
        array = np.ascontiguousarray(outputs[name])
        tensor = response.outputs.add()
        tensor.name, tensor.datatype = name, v2.DATATYPES[array.dtype.name]
        tensor.shape.extend(array.shape)
        response.raw_output_contents.append(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    return response


class GrpcFrontend:
    """The grpc.aio server: started and stopped by the app's lifespan, in uvicorn's event loop."""

    def __init__(self, service: InferenceService, config: GrpcConfig, api_keys: ApiKeys | None = None):
        self.service = service
        self.config = config
        self.api_keys = api_keys
        self.port: int | None = None
        self.servicer: InferenceServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            # gRPC sets SO_REUSEPORT by default, so a second server would share a port in use without an error.
            ("grpc.so_reuseport", 0),
        ]
        if config.idle_timeout_s is not None:
            options.append(("grpc.max_connection_idle_ms", max(1, int(config.idle_timeout_s * 1000))))
        # No maximum_concurrent_rpcs: gRPC would count calls from their arrival, keyless and stalled ones too.
        server = grpc.aio.server(options=options)
        self.servicer = InferenceServicer(
            self.service, self.api_keys, config.max_concurrent_rpcs, config.receive_timeout_s
        )
        server.add_generic_rpc_handlers((method_handlers(self.servicer),))
        address = f"{config.host}:{config.port}"
        try:
            if config.ssl_certfile:
                credentials = grpc.ssl_server_credentials(
                    [(Path(config.ssl_keyfile).read_bytes(), Path(config.ssl_certfile).read_bytes())]
                )
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except (OSError, RuntimeError) as exc:
            raise GrpcServeError(f"gRPC cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise GrpcServeError(f"gRPC cannot listen on {address} (port in use?)")
        await server.start()
        self._server, self.port = server, port
        scheme = "TLS" if config.ssl_certfile else "plaintext"
        logger.info("gRPC (inference.GRPCInferenceService, %s) on %s:%d", scheme, config.host, port)

    def begin_stop(self) -> None:
        """Refuse new calls from now on; calls in flight get ``grace_s`` to finish (see ``_stop``)."""
        if self._stopping is None and self._server is not None:
            self._stopping = asyncio.ensure_future(self._stop())

    async def _stop(self) -> None:
        # gRPC's grace covers every open call, including one whose request message is still trickling in,
        # which would hold the shutdown for all of grace_s. As for REST bodies: after receive_timeout_s,
        # wait only for the calls the servicer is answering, then cancel what is left (calls never received).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_s
        graceful = asyncio.ensure_future(self._server.stop(self.config.grace_s))
        done, _ = await asyncio.wait({graceful}, timeout=min(self.config.receive_timeout_s, self.config.grace_s))
        if done:
            return
        while self.servicer.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self._server.stop(None)
        await graceful

    async def stop(self) -> None:
        self.begin_stop()
        if self._stopping is not None:
            await self._stopping
