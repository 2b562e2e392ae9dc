"""``serve``: the app under uvicorn, with a clean exit on a bad model and a graceful one on SIGTERM.

On SIGTERM (or Ctrl+C) uvicorn stops accepting connections, lets every request
it has accepted finish (up to ``graceful_timeout_s``), then the app drains the
batcher and logs how many requests it accepted and answered. uvicorn re-raises
the signal afterwards, so the process ends as killed by SIGTERM (exit 143), as
process supervisors expect.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from mha_deploy.errors import MHADeployError
from mha_deploy.serving.http.parsing import RequestLimits


@dataclass(frozen=True)
class ServeConfig:
    model: str | os.PathLike
    host: str = "127.0.0.1"
    port: int = 8000
    provider: str = "auto"
    # ORT intra-op threads (None: one per core).
    threads: int | None = None
    max_batch: int = 32
    max_wait_ms: float = 2.0
    # Batches run at once, each in its own thread (they share ORT's intra-op pool).
    workers: int = 1
    max_queue: int = 4096
    max_batch_tokens: int = 8192
    limits: RequestLimits = field(default_factory=RequestLimits)
    optimized_model_path: str | os.PathLike | None = None
    # Let idle ORT intra-op threads spin-wait for work (lower latency alone, less CPU for everything else).
    spin: bool = False
    # On SIGTERM: longest wait for accepted requests to finish before exiting anyway (CLI --drain-timeout).
    graceful_timeout_s: float = 30.0
    log_level: str = "info"
    access_log: bool = False


class ServeError(MHADeployError):
    """The server could not start (missing dependency, model that does not load, port in use)."""


def serve(config: ServeConfig) -> None:
    """Run the server until SIGTERM/SIGINT. Raises ``ServeError`` or the load error if it cannot start."""
    try:
        import uvicorn

        from mha_deploy.serving.http.app import BatchingConfig, create_app
    except ImportError as exc:
        raise ServeError(f"the server needs the 'serve' extra: pip install 'mha-deploy[serve]' ({exc})") from exc
    from mha_deploy.runtime.session import MHASession

    _configure_logging(config.log_level)
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

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

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    batching = BatchingConfig(
        config.max_batch, config.max_wait_ms, config.workers, config.max_queue, config.max_batch_tokens
    )
    app = create_app(load_session, batching, config.limits, on_load_error)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=config.graceful_timeout_s,
        lifespan="on",
    )
    server = uvicorn.Server(uvicorn_config)
    server.run()
    if failures:
        raise failures[0]
    if not server.started:
        raise ServeError(f"the server did not start on {config.host}:{config.port} (see the log above)")


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("mha_deploy.serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
