"""Fixtures of the serving tests: real server processes, started on demand and killed when done."""

from __future__ import annotations

from pathlib import Path

import pytest

from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.serving.helpers import Server


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """``start_server(model, *args, grpc=False, ca=None)``: a ready server, killed when the module's tests end."""
    servers = []

    def start(model: Path, *args: str, grpc: bool = False, ca: Path | None = None) -> Server:
        server = Server(model, tmp_path_factory.mktemp("server") / "server.log", *args, grpc=grpc, ca=ca)
        servers.append(server)
        return server.wait_ready()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def session(export_model):
    """The model ``v2_server`` serves, run directly: what every answer must equal."""
    return MHASession(export_model(Signature("self", "padding"))[0], provider="cpu")


@pytest.fixture(scope="session")
def v2_server(export_model, tmp_path_factory):
    """One server for the protocol tests: self-attention with a padding mask, REST and gRPC, no auth, no TLS."""
    path, _ = export_model(Signature("self", "padding"))
    server = Server(path, tmp_path_factory.mktemp("v2-server") / "server.log",
                    "--max-batch", "32", "--max-wait-ms", "2", "--threads", "2", "--max-item-tokens", "256", grpc=True)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cross_server(export_model, tmp_path_factory):
    """Cross-attention returning its attention weights: two outputs, a mask on the keys only."""
    path, _ = export_model(Signature("cross", "padding", return_weights=True))
    server = Server(path, tmp_path_factory.mktemp("cross-server") / "server.log", "--name", "cross",
                    "--max-wait-ms", "2", "--threads", "2", grpc=True)
    try:
        yield server.wait_ready()
    finally:
        server.stop()
