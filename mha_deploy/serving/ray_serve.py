"""The server as a Ray Serve deployment: N replicas of the app ``mha-deploy serve`` runs, behind Ray Serve's HTTP proxy.

Each replica builds, from one ``ServeConfig``, the Starlette app the single-process server runs
(``http.server``): a generator's (OpenAI's routes, Triton's generate extension, continuous batching inside the
replica) or the plain Open Inference Protocol server's (``/v2``, ``/v1/infer``, ``/v1/embeddings``). The replica
starts the app (its lifespan: the model loads there) before it reports itself started, so that it takes requests
only once the model is loaded and warm, and fails with the load error when it cannot load. Ray Serve's proxy takes
the HTTP connections, picks a replica per request and streams the replica's ASGI messages back, server-sent events
included. Routes, bodies and errors are the app's own; the proxy adds an ``X-Request-ID`` header.

Per replica: Ray Serve calls ``check_health`` (a replica whose model failed, or that is no longer ready, is
replaced); ``GET /replicas`` lists every replica with its status, and ``GET /replicas/ID/metrics`` is that
replica's Prometheus text (``/metrics`` is the one replica that answered it; the ``X-Replica`` header on every
answer names it). ``replica_reports`` gives the same in Python.

What the proxy cannot carry is refused (``unsupported_options``): gRPC (Ray Serve's gRPC proxy serves servicers
registered with it, not a server of the app's own), and uvicorn's own connection guards (header timeout, idle
connections): the proxy holds the connections. TLS and the keep-alive timeout are the proxy's (``http_options``).

A killed replica: requests in flight on it fail (the proxy answers 500, or a stream ends early), Ray Serve starts
another and routes later requests to the live ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from mha_deploy.errors import InputError
from mha_deploy.serving.http.server import (
    _MODEL_NAME,
    ServeConfig,
    ServeError,
    _check_tls,
    _configure_logging,
    _with_companion_encoder,
    build_app,
    check_model_name,
)

logger = logging.getLogger("mha_deploy.serve")
REPLICA_HEADER = "x-replica"
# How often the replica's startup looks whether the model finished loading (the plain server loads it in a task).
_LOAD_POLL_S = 0.05


@dataclass(frozen=True)
class RayServeOptions:
    """How the server runs on Ray Serve: replicas (or Ray Serve's autoscaling config instead), the cluster, and
    what each replica reserves."""

    replicas: int = 1
    # Ray cluster to join (None: $RAY_ADDRESS or the one last started on this machine, else a local one).
    address: str | None = None
    # Ray Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...); replaces replicas.
    autoscaling: Mapping | None = None
    app_name: str = "mha-deploy"
    # CPUs each replica reserves (None: the config's ORT threads, else 1); GPUs each reserves.
    cpus_per_replica: float | None = None
    gpus_per_replica: float = 0
    # Times Ray Serve starts a replica whose start failed before the deployment fails (at least 1).
    start_retries: int = 2

    def __post_init__(self):
        if self.replicas < 1:
            raise InputError(f"replicas must be at least 1, not {self.replicas}")
        if self.gpus_per_replica < 0 or (self.cpus_per_replica is not None and self.cpus_per_replica < 0):
            raise InputError("cpus_per_replica and gpus_per_replica cannot be negative")
        if self.start_retries < 1:
            raise InputError(f"start_retries must be at least 1 (Ray Serve's least), not {self.start_retries}")
        if not _MODEL_NAME.match(self.app_name):
            raise InputError(f"app name {self.app_name!r}: use letters, digits, '_', '.' and '-' only")


def read_autoscaling(value: str) -> dict:
    """Ray Serve's autoscaling config from JSON text or a JSON file's path, checked by Ray Serve's own schema."""
    text = value
    if not value.lstrip().startswith(("{", "[")):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"autoscaling: {value!r} is neither a JSON object nor a readable file ({exc})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"autoscaling: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InputError("autoscaling: expected a JSON object such as {\"min_replicas\": 1, \"max_replicas\": 4}")
    return _checked_autoscaling(config)


def _checked_autoscaling(config: Mapping) -> dict:
    from ray.serve.config import AutoscalingConfig

    try:
        AutoscalingConfig(**config)
    except Exception as exc:  # pydantic's ValidationError, or a TypeError
        raise InputError(f"autoscaling: {exc}") from None
    return dict(config)


def unsupported_options(config: ServeConfig) -> list[str]:
    """The settings of ``config`` a Ray Serve deployment cannot carry, as the CLI names them."""
    defaults = ServeConfig(config.model)
    refused = []
    if config.grpc_port is not None:
        refused.append("--grpc-port")
    if config.max_idle_connections is not None:
        refused.append("--max-idle-connections")
    if config.header_timeout_s != defaults.header_timeout_s:
        refused.append("--header-timeout")
    if config.access_log:
        refused.append("--access-log")
    return refused


def _absolute(config: ServeConfig) -> ServeConfig:
    """Every path in ``config`` made absolute: replicas run in other working directories (and on other nodes, where
    the same path must hold the same file)."""

    def resolve(path):  # symbolic links kept: the file's name is the model's
        return os.path.abspath(path) if path is not None else None

    options = config.generation
    return replace(
        config, name=config.model_name, model=resolve(config.model),
        optimized_model_path=resolve(config.optimized_model_path), api_key_file=resolve(config.api_key_file),
        ssl_certfile=None, ssl_keyfile=None,
        generation=replace(options, tokenizer=resolve(options.tokenizer),
                           chat_template=resolve(options.chat_template), encoder=resolve(options.encoder)),
    )


def replica_app(config: ServeConfig):
    """The app one replica serves: the single-process server's (``build_app``), for a generator or any other model."""
    from mha_deploy.serving.http.auth import ApiKeys

    api_keys = ApiKeys.from_file(config.api_key_file) if config.api_key_file is not None else None
    failures: list[BaseException] = []
    app = build_app(config, api_keys, failures.append)
    app.state.load_failures = failures
    return app


class ServerReplica:
    """One replica: the server's app, started only once its model is loaded (Ray Serve wraps this class with
    ``serve.ingress``; ``server_application`` builds the deployment)."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.service = None
        self.replica_id = "?"

    async def __serve_build_asgi_app__(self):
        from ray import serve
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        _configure_logging(self.config.log_level)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        app = replica_app(self.config)
        self.service = service = app.state.mha
        await self._start_app(app)

        async def replicas(request) -> Response:
            return JSONResponse([{k: v for k, v in report.items() if k != "metrics"}
                                 for report in await self._reports(context)])

        async def replica_metrics(request) -> Response:
            wanted = request.path_params["replica"]
            for report in await self._reports(context):
                if report["replica"] == wanted:
                    return Response(report["metrics"], media_type=report["metrics_type"])
            return PlainTextResponse(f"no replica {wanted!r} (GET /replicas lists them)", status_code=404)

        # Before the app's own routes: paths the app does not have, behind its API keys like the rest.
        app.router.routes[:0] = [Route("/replicas", replicas, methods=["GET"]),
                                 Route("/replicas/{replica}/metrics", replica_metrics, methods=["GET"])]
        app.add_middleware(_NameReplica, replica=self.replica_id)
        logger.info("replica %s of %s: %s", self.replica_id, context.app_name, service.model_name)
        return app

    async def _start_app(self, app) -> None:
        """Run the app's startup here, until its model is loaded and warm (the plain server loads it in a task while
        its port is open: a replica started then would take requests it cannot serve), so that a model that does
        not load fails the replica with its own error (Ray Serve's message for a failed lifespan names none). Ray
        Serve's run of the app's lifespan then only finds it started, and its shutdown drains the app."""
        running = app.router.lifespan_context(app)
        await running.__aenter__()
        service = self.service
        while service.status == "loading":
            await asyncio.sleep(_LOAD_POLL_S)
        if not service.ready:
            await running.__aexit__(None, None, None)
            failures = app.state.load_failures
            reason = f"{failures[0]}" if failures else f"the server is {service.status}"
            raise ServeError(f"replica cannot serve {self.config.model}: {reason}")

        @contextlib.asynccontextmanager
        async def started(asgi_app):
            try:
                yield
            finally:
                await running.__aexit__(None, None, None)

        app.router.lifespan_context = started

    def check_health(self) -> None:
        """Ray Serve's health check: a replica that is not ready (model failed, engine stopped) is replaced."""
        if self.service is not None and self.service.status not in ("ready", "draining"):
            raise ServeError(f"replica {self.replica_id} is {self.service.status}")

    def replica_report(self) -> dict:
        """This replica's id, node, status, counts and Prometheus text."""
        import ray

        service = self.service
        content, content_type = service.metrics.render() if service is not None else (b"", "text/plain")
        return {
            "replica": self.replica_id, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
            "status": service.status if service is not None else "starting",
            "accepted": getattr(service, "accepted", 0), "answered": getattr(service, "answered", 0),
            "metrics": content.decode(), "metrics_type": content_type,
        }

    async def _reports(self, context) -> list[dict]:
        from ray import serve

        handle = serve.get_deployment_handle(context.deployment, app_name=context.app_name)
        return sorted(await handle.broadcast("replica_report").results_async(), key=lambda r: r["replica"])


class _NameReplica:
    """ASGI middleware: every answer names the replica that gave it (``X-Replica``)."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def server_application(config: ServeConfig, options: RayServeOptions | None = None):
    """The Ray Serve application of ``config``'s server with ``options`` (``serve.run`` it, or ``serve_on_ray``).
    Checks what can be checked before any replica starts: the name, the files, the options replicas cannot carry."""
    from ray import serve

    options = options or RayServeOptions()
    refused = unsupported_options(config)
    if refused:
        raise ServeError(f"{', '.join(refused)}: not available with Ray Serve replicas (Ray Serve's HTTP proxy holds "
                         "the connections and serves no gRPC of the app's own); drop "
                         f"{'it' if len(refused) == 1 else 'them'}")
    check_model_name(config.model_name)
    for label, path in (("model", config.model), ("tokenizer", config.generation.tokenizer),
                        ("chat template", config.generation.chat_template), ("encoder", config.generation.encoder),
                        ("API key file", config.api_key_file)):
        if path is not None and not Path(path).is_file():
            raise ServeError(f"{label} {path}: no such file (every node that runs a replica needs it at this path)")
    config = _absolute(_with_companion_encoder(config))
    threads = config.threads or 1
    actor_options = {"num_cpus": options.cpus_per_replica if options.cpus_per_replica is not None else threads,
                     "num_gpus": options.gpus_per_replica}
    if config.provider == "cuda" and not options.gpus_per_replica:
        raise ServeError("provider cuda on Ray needs GPUs per replica (--num-gpus): Ray hides every GPU from a replica "
                         "that reserves none")
    scaling = ({"autoscaling_config": _checked_autoscaling(options.autoscaling)} if options.autoscaling is not None
               else {"num_replicas": options.replicas})
    deployment = serve.deployment(
        serve.ingress()(ServerReplica),
        name=f"{options.app_name}-server",
        ray_actor_options=actor_options,
        # Continuous batching wants every request a replica can hold, not Ray Serve's default of a few.
        max_ongoing_requests=config.max_connections,
        graceful_shutdown_timeout_s=config.graceful_timeout_s,
        max_constructor_retry_count=options.start_retries,
        **scaling,
    )
    # One ORT thread count per replica, fixed here: left unset, each replica would take one per core of its node.
    return deployment.bind(replace(config, threads=threads))


def http_options(config: ServeConfig) -> dict:
    """Ray Serve's proxy options from ``config``: its address, TLS and keep-alive timeout."""
    _check_tls(config)
    options = {"host": config.host, "port": config.port, "keep_alive_timeout_s": int(config.keep_alive_timeout_s)}
    if config.ssl_certfile is not None:
        options.update(ssl_certfile=str(Path(config.ssl_certfile).resolve()),
                       ssl_keyfile=str(Path(config.ssl_keyfile).resolve()))
    return options


def deploy(config: ServeConfig, options: RayServeOptions | None = None) -> str:
    """Start Ray Serve's proxy (on ``config``'s host and port) and the application on the Ray cluster this process
    is connected to (``ray.init`` first); returns the URL once every replica is ready."""
    options = options or RayServeOptions()
    return _start(server_application(config, options), http_options(config), config, options)


def _start(application, proxy: dict, config: ServeConfig, options: RayServeOptions) -> str:
    from ray import serve

    serve.start(http_options=proxy)
    _check_proxy(config)
    running = serve.status().applications.get(options.app_name)
    if running is not None and getattr(running.status, "value", running.status) != "DELETING":
        raise ServeError(f"an application named {options.app_name!r} already runs on this Ray cluster: serve.delete "
                         "it first (its command's Ctrl+C does), or give this one another name")
    try:
        serve.run(application, name=options.app_name, route_prefix="/", blocking=False)
    except Exception as exc:  # Ray Serve's DEPLOY_FAILED: the replicas' error is in the deployment's status
        reason = _replica_error(options) or exc
        raise ServeError(f"the Ray Serve deployment of {config.model} failed: {reason}") from None
    scheme = "https" if config.ssl_certfile is not None else "http"
    return f"{scheme}://{config.host}:{config.port}"


def _replica_error(options: RayServeOptions) -> str | None:
    """The last line of the failed deployment's message: the exception its replicas raised on starting."""
    from ray import serve

    try:
        deployments = serve.status().applications[options.app_name].deployments.values()
    except Exception:  # the application is gone: nothing more to say
        return None
    lines = [line for d in deployments for line in (d.message or "").splitlines() if line.strip()]
    # "mha_deploy....ServeError: replica cannot serve ...": the message without the exception's class
    return re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1].strip()) if lines else None


def _check_proxy(config: ServeConfig) -> None:
    """Ray Serve runs one proxy configuration per cluster: one started before (by another app) keeps its address,
    which must then be the one asked for."""
    from ray.serve.context import _get_global_client

    running = _get_global_client().http_config
    if (running.host, running.port) != (config.host, config.port):
        raise ServeError(f"Ray Serve already runs on this cluster with its HTTP proxy on {running.host}:"
                         f"{running.port}: give --host {running.host} --port {running.port}, or start another cluster")


def replica_reports(app_name: str = RayServeOptions.app_name) -> list[dict]:
    """Every running replica's report (``ServerReplica.replica_report``) of the application ``app_name``."""
    from ray import serve

    handle = serve.get_deployment_handle(f"{app_name}-server", app_name=app_name)
    return sorted(handle.broadcast("replica_report").results(), key=lambda r: r["replica"])


def serve_on_ray(config: ServeConfig, options: RayServeOptions | None = None,
                 on_ready: Callable[[str], None] | None = None) -> None:
    """``mha-deploy serve --ray-replicas``: join (or start) a Ray cluster, deploy, serve until SIGINT/SIGTERM,
    then delete the application (its replicas drain up to ``graceful_timeout_s``) and leave."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ServeError(f'Ray Serve replicas need the \'ray\' extra: pip install "mha-deploy[ray]" ({exc})') from exc
    options = options or RayServeOptions()
    # Refused before any cluster starts: options replicas cannot carry, missing files, TLS that does not load.
    application, proxy = server_application(config, options), http_options(config)
    connected = not ray.is_initialized()
    if connected:
        ray.init(address=options.address, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = _start(application, proxy, config, options)
        if on_ready is not None:
            on_ready(url)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Only this application: Ray Serve (its controller and proxy) may serve others on a cluster joined.
        with contextlib.suppress(Exception):
            serve.delete(options.app_name)
        if connected:  # leaves a cluster joined, stops the one ray.init started
            ray.shutdown()
