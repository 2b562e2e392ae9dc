"""``serve``: the app under uvicorn (and gRPC), a clean exit on a bad model and a graceful one on SIGTERM.

On SIGTERM (or Ctrl+C) uvicorn stops accepting connections and the gRPC server
stops accepting calls at the same moment; every request either has accepted
finishes (up to ``graceful_timeout_s``), then the app drains the batcher and
logs how many requests it accepted and answered. uvicorn re-raises the signal
afterwards, so the process ends as killed by SIGTERM (exit 143), as process
supervisors expect. A body still arriving cannot hold the drain for longer
than ``limits.body_timeout_s``.

Slow or idle clients cannot starve others (``connections``): a connection with
no request in progress closes after ``keep_alive_timeout_s``, request headers
must arrive within ``header_timeout_s``, bodies within ``body_timeout_s``, at
most ``max_idle_connections`` stay idle (the oldest is closed), and only
authorised requests in progress count against ``max_connections``. gRPC
calls likewise (``grpc_server``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path

from mha_deploy.batching import BatchingConfig
from mha_deploy.errors import MHADeployError
from mha_deploy.serving.http.parsing import RequestLimits

# Names usable in a URL path segment unescaped (what Triton accepts too).
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class ServeConfig:
    model: str | os.PathLike
    host: str = "127.0.0.1"
    port: int = 8000
    provider: str = "auto"
    # ORT intra-op threads (None: one per core).
    threads: int | None = None
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    optimized_model_path: str | os.PathLike | None = None
    # Let idle ORT intra-op threads spin-wait for work (lower latency alone, less CPU for everything else).
    spin: bool = False
    # On SIGTERM: longest wait for accepted requests to finish before exiting anyway (CLI --drain-timeout).
    graceful_timeout_s: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    # The model's name in the v2 protocol (None: the model file's stem).
    name: str | None = None
    # gRPC (inference.GRPCInferenceService) on this port, same host; None: no gRPC.
    grpc_port: int | None = None
    # One key per line; when given, every route and call but health needs "Authorization: Bearer <key>".
    api_key_file: str | os.PathLike | None = None
    # TLS for REST and gRPC alike: a PEM certificate (chain) and its private key.
    ssl_certfile: str | os.PathLike | None = None
    ssl_keyfile: str | os.PathLike | None = None
    # Requests (REST) and calls (gRPC) in progress at once, counted once authorised (health checks aside);
    # more get 503 / RESOURCE_EXHAUSTED. Connections without a request in progress take none.
    max_connections: int = 1000
    # A connection with no request in progress (new, after a TLS handshake, or between requests) is closed
    # after this many seconds; gRPC connections with no call too.
    keep_alive_timeout_s: float = 5.0
    # A request's headers must be complete this many seconds after its first byte (the body has body_timeout_s).
    header_timeout_s: float = 10.0
    # Connections with no request in progress kept at once; beyond, the one idle the longest is closed.
    # None: half the process's open-file limit.
    max_idle_connections: int | None = None
    # A KV-cache decoder is served as a generator (OpenAI's and Triton's generate routes) with these settings.
    generation: GenerationOptions = field(default_factory=lambda: GenerationOptions())
    # An encoder whose output is one vector per item is served on OpenAI's /v1/embeddings too, with these settings
    # (texts through generation.tokenizer).
    embeddings: EmbeddingOptions = field(default_factory=lambda: EmbeddingOptions())

    @property
    def model_name(self) -> str:
        """``name``, or the model file's stem with anything but letters, digits, ``_.-`` replaced by ``_``."""
        return self.name or re.sub(r"[^A-Za-z0-9_.-]", "_", Path(self.model).stem)


@dataclass(frozen=True)
class GenerationOptions:
    """How a generator is served (``mha-deploy serve`` of a KV-cache decoder; ignored for other models)."""

    # tokenizers' tokenizer.json: text prompts and text out (without it, token ids in and out); an encoder's
    # /v1/embeddings takes texts through it too.
    tokenizer: str | os.PathLike | None = None
    # A jinja2 chat template over ``messages``: enables /v1/chat/completions.
    chat_template: str | os.PathLike | None = None
    # Cache positions the running requests may hold at most (planned from prompt + max_tokens).
    max_kv_tokens: int = 65536
    # The most tokens one request may generate.
    max_new_tokens: int = 1024
    # Prompt + max_tokens at most (None: what the file records, else unbounded but for the KV budget).
    max_length: int | None = None
    # Prompt tokens prefilled per turn of the decode loop (longer prompts in chunks, between decode steps).
    prefill_chunk: int = 512
    # Ids that end every sequence.
    eos_token_ids: tuple[int, ...] = ()
    # Let requests of different lengths share one cache; None: when that is exact (mixes_lengths_exactly).
    mix_lengths: bool | None = None
    # Sequences (n x prompts) one request may ask for.
    max_choices: int = 16
    # An encoder-decoder: the encoder's file (the served model is then its decoder) and the decoder's start id
    # (None: the one the decoder file recorded at export).
    encoder: str | os.PathLike | None = None
    start_id: int | None = None


@dataclass(frozen=True)
class EmbeddingOptions:
    """How an encoder's pooled output is served on OpenAI's ``/v1/embeddings`` (``serve`` of a plain encoder)."""

    # Scale each vector to unit length (L2), as OpenAI's embeddings come; False: the model's output as it is.
    normalize: bool = True
    # The output holding the vectors ([batch, d] floats); None: the file's only such output.
    output: str | None = None


class ServeError(MHADeployError):
    """The server could not start (missing dependency, model that does not load, port in use)."""


def check_model_name(name: str) -> None:
    """Refuse a model name that is not one URL path segment unescaped (``_MODEL_NAME``)."""
    if not _MODEL_NAME.match(name):
        raise ServeError(f"model name {name!r}: use letters, digits, '_', '.' and '-' only")


def serve(config: ServeConfig) -> None:
    """Run the server until SIGTERM/SIGINT. Raises ``ServeError`` or the load error if it cannot start."""
    try:
        import uvicorn

        import mha_deploy.serving.http.app  # noqa: F401  (the app's imports: a missing one is refused here by name)
        from mha_deploy.serving.http.connections import deadline_protocol
    except ImportError as exc:
        raise ServeError(f"the server needs the 'serve' extra: pip install 'mha-deploy[serve]' ({exc})") from exc
    from mha_deploy.serving.http.auth import ApiKeys

    check_model_name(config.model_name)
    _check_tls(config)
    api_keys = ApiKeys.from_file(config.api_key_file) if config.api_key_file is not None else None
    _configure_logging(config.log_level)
    config = _with_companion_encoder(config)
    if is_generator(config.model) and config.grpc_port is not None:
        raise ServeError("a generator (KV-cache decoder) is served over REST only (OpenAI's routes and Triton's "
                         "generate extension): drop --grpc-port")
    grpc_config = _grpc_config(config)
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    class _Server(uvicorn.Server):
        """uvicorn's server, stopping the gRPC server's intake at the moment it stops its own."""

        def __init__(self, config: uvicorn.Config, grpc_frontend=None):
            super().__init__(config)
            self.grpc_frontend = grpc_frontend

        async def shutdown(self, sockets=None) -> None:
            if self.grpc_frontend is not None:
                self.grpc_frontend.begin_stop()
            await super().shutdown(sockets)

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app = build_app(config, api_keys, on_load_error, grpc_config)
    max_idle = config.max_idle_connections or max(64, _raise_open_file_limit() // 2)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_timeout_s,
        lifespan="on",
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        # Not uvicorn's limit_concurrency, which counts idle and unauthorised connections: RequestSlots.
        http=deadline_protocol(config.keep_alive_timeout_s, config.header_timeout_s, max_idle),
        timeout_keep_alive=config.keep_alive_timeout_s,
    )
    server = _Server(uvicorn_config, app.state.grpc)
    server.run()
    if failures:
        raise failures[0]
    if not server.started:
        raise ServeError(f"the server did not start on {config.host}:{config.port} (see the log above)")


def build_app(config: ServeConfig, api_keys, on_load_error, grpc_config=None):
    """The app ``serve`` runs, and each Ray Serve replica: a generator's (OpenAI's routes, Triton's generate) or the
    Open Inference Protocol server's (``/v2``, ``/v1/infer``, ``/v1/embeddings``), its model loaded by the app's
    lifespan (a load error goes to ``on_load_error``)."""
    from mha_deploy.runtime.session import MHASession
    from mha_deploy.serving.http.app import create_app

    if is_generator(config.model):
        return _generation_app(config, api_keys, on_load_error)

    def load_session() -> MHASession:
        return MHASession(
            config.model,
            provider=config.provider,
            threads=config.threads,
            optimized_model_path=config.optimized_model_path,
            # Idle ORT threads spin by default, burning the CPU the event loop needs between runs.
            session_config={"session.intra_op.allow_spinning": "1" if config.spin else "0"},
            warmup=True,
        )

    return create_app(
        load_session, config.batching, config.limits, on_load_error,
        model_name=config.model_name, api_keys=api_keys, grpc_config=grpc_config,
        max_requests=config.max_connections, embeddings=config.embeddings,
        tokenizer=_tokenizer(config.generation.tokenizer),
    )


def is_generator(model: str | os.PathLike) -> bool:
    """Whether the file is a KV-cache decoder over token ids (input_ids and past_key_values.* inputs, Optimum's
    names): served as a generator. A decoder over float sequences (``export --model decoder --kv-cache``) is not: it
    generates no tokens. A file that cannot be read is left to the model's loader, which says why."""
    from mha_deploy.runtime.session_file import read_graph

    try:
        graph = read_graph(model).graph  # input names only: the weights' bytes stay in the file
    except Exception:
        return False
    names = {value.name for value in graph.input}
    return "input_ids" in names and any(name.startswith("past_key_values.") for name in names)


def _with_companion_encoder(config: ServeConfig) -> ServeConfig:
    """A decoder that ``export --kv-cache`` wrote as one of an encoder-decoder pair names its encoder (beside it)
    and start id: served with them, as ``generate`` takes them (``encoder_companion``, one place for both). The
    pair's encoder given instead is refused here, naming its decoder, before any port is bound."""
    from mha_deploy.runtime.kv_stepper import encoder_companion

    options = config.generation
    if options.encoder is not None:
        return config
    found = encoder_companion(config.model)
    if found is None:
        return config
    encoder, start_id = found
    logging.getLogger("mha_deploy.serve").info("encoder %s (named by %s)", encoder, Path(config.model).name)
    return replace(config, generation=replace(
        options, encoder=encoder, start_id=options.start_id if options.start_id is not None else start_id))


def _generation_app(config: ServeConfig, api_keys, on_load_error):
    """The generator's app: tokenizer and chat template read now (a bad file stops the start with one line), the
    model loaded by the app's lifespan."""
    from mha_deploy.serving.engine import GenerationEngine
    from mha_deploy.serving.http.generation import GenerationService, GenerationSettings
    from mha_deploy.serving.http.generation_app import create_generation_app, load_chat_template

    options = config.generation
    tokenizer = _tokenizer(options.tokenizer)
    template = None
    if options.chat_template is not None:
        try:
            template = load_chat_template(options.chat_template)
        except Exception as exc:  # unreadable, or not a jinja2 template
            raise ServeError(f"cannot use the chat template {options.chat_template}: {exc}") from None
    settings = GenerationSettings(
        max_new_tokens=options.max_new_tokens, max_length=options.max_length, max_choices=options.max_choices,
        eos_token_ids=tuple(options.eos_token_ids),
    )

    def load_engine(metrics) -> GenerationEngine:
        from mha_deploy.runtime.kv_stepper import KVCacheStepper, open_decoder

        # Idle ORT threads spin by default, burning the CPU the event loop needs between steps.
        session_config = {"session.intra_op.allow_spinning": "1" if config.spin else "0"}
        model = open_decoder(config.model, config.threads, provider=config.provider, session_config=session_config)
        encoder = start_id = None
        if options.encoder is not None:
            encoder = open_decoder(options.encoder, config.threads, provider=config.provider,
                                   session_config=session_config)
            # mha-deploy metadata, or the record of export --kv-cache's pair
            recorded = getattr(getattr(model, "metadata", None), "generation", None) or getattr(
                getattr(model, "pair", None), "generation", None)
            start_id = options.start_id if options.start_id is not None else getattr(
                recorded, "decoder_start_token_id", None)
            if start_id is None:
                raise ServeError(f"{config.model} records no decoder start id: give --start-id with --encoder")
        elif options.start_id is not None:
            raise ServeError("--start-id is an encoder-decoder's: give --encoder too")
        stepper = KVCacheStepper(model, encoder=encoder, decoder_start_token_id=start_id)
        return GenerationEngine(
            stepper, max_kv_tokens=options.max_kv_tokens, max_running=config.batching.max_batch,
            max_waiting=config.batching.max_queue, prefill_chunk=options.prefill_chunk,
            mix_lengths=options.mix_lengths, observer=metrics,
        )

    service = GenerationService(load_engine, settings, config.limits, config.model_name, on_load_error,
                                tokenizer=tokenizer, chat_template=template)
    return create_generation_app(service, api_keys=api_keys, max_requests=config.max_connections,
                                 drain_timeout_s=config.graceful_timeout_s)


def _tokenizer(path: str | os.PathLike | None):
    """The ``PromptTokenizer`` at ``path`` (None: none); a file that is not one stops the start with one line."""
    if path is None:
        return None
    from mha_deploy.batch.generation import PromptTokenizer

    return PromptTokenizer(path)


def _check_tls(config: ServeConfig) -> None:
    """Both files or neither, and usable: refused here with one line rather than by uvicorn with a traceback."""
    if (config.ssl_certfile is None) != (config.ssl_keyfile is None):
        raise ServeError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if config.ssl_certfile is None:
        return
    asked = []

    def passphrase() -> bytes:  # OpenSSL asks only for an encrypted key; the server has no one to ask
        asked.append(True)
        return b""

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, password=passphrase)
    except (OSError, ssl.SSLError) as exc:
        if asked:
            raise ServeError(
                f"the TLS key {config.ssl_keyfile} is protected by a passphrase, which the server cannot ask "
                "for: give it the key decrypted (openssl pkey -in KEY -out KEY.plain), readable only by its user"
            ) from None
        raise ServeError(
            f"cannot use the TLS certificate {config.ssl_certfile} with key {config.ssl_keyfile}: {exc}"
        ) from None


def _grpc_config(config: ServeConfig):
    if config.grpc_port is None:
        return None
    try:
        from mha_deploy.serving.http.grpc_server import GrpcConfig
    except ImportError as exc:
        raise ServeError(
            f"gRPC needs grpcio and tritonclient[grpc] (in the 'serve' extra): pip install 'mha-deploy[serve]' ({exc})"
        ) from exc
    return GrpcConfig(
        host=config.host,
        port=config.grpc_port,
        ssl_certfile=str(config.ssl_certfile) if config.ssl_certfile else None,
        ssl_keyfile=str(config.ssl_keyfile) if config.ssl_keyfile else None,
        max_message_bytes=config.limits.max_body_bytes,
        max_concurrent_rpcs=config.max_connections,
        grace_s=config.graceful_timeout_s,
        receive_timeout_s=config.limits.body_timeout_s,
        idle_timeout_s=config.keep_alive_timeout_s,
    )


def _raise_open_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit, and return the limit: every open connection
    holds a file descriptor, and the common soft limit of 1024 would refuse new connections (authorised ones
    too) while idle ones wait out their timeout."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("mha_deploy.serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
