"""API keys: ``Authorization: Bearer <key>`` on every route but health, for REST and gRPC alike.

The key file holds one key per line (several keys let a key be rotated without
downtime); blank lines and lines starting with ``#`` are ignored. A presented
key is compared with every key in constant time (``hmac.compare_digest``), so
the response time says nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path

from mha_deploy.errors import MHADeployError

# Paths anyone may GET: liveness and readiness, which orchestrators probe without credentials.
_HEALTH_PATH = re.compile(r"^/(healthz|readyz|v2/health/(live|ready)|v2/models/[^/]+(/versions/[^/]+)?/ready)$")
# gRPC methods that are health checks (the same set as the REST paths above).
HEALTH_METHODS = frozenset(
    f"/inference.GRPCInferenceService/{name}" for name in ("ServerLive", "ServerReady", "ModelReady")
)
MIN_KEY_LENGTH = 16
# The ASGI scope's state entry saying whether a request presented a valid key (set with API keys only).
AUTHORIZED = "mha_authorized"


class ApiKeyError(MHADeployError):
    """The API key file cannot be used."""


def is_health_path(path: str) -> bool:
    return _HEALTH_PATH.match(path) is not None


def is_authorized(scope) -> bool:
    """Whether an HTTP request presented a valid key (always, on a server without keys)."""
    return scope.get("state", {}).get(AUTHORIZED, True)


class ApiKeys:
    def __init__(self, keys: list[str]):
        if not keys:
            raise ApiKeyError("no API key given")
        short = [key for key in keys if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key)]
        if short:
            raise ApiKeyError(f"API keys must be at least {MIN_KEY_LENGTH} characters without spaces")
        # HTTP headers carry Latin-1 at most, and clients differ in how they encode beyond ASCII: such a key
        # could never authenticate.
        unprintable = [number for number, key in enumerate(keys, 1) if not (key.isascii() and key.isprintable())]
        if unprintable:
            raise ApiKeyError(
                f"API key {unprintable[0]} holds characters beyond printable ASCII, which no client can send "
                "in a header reliably: use letters, digits and punctuation"
            )
        self._keys = [key.encode() for key in keys]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ApiKeys:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")  # a BOM, as some editors write, is not key text
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"cannot read the API key file {path}: {exc}") from exc
        keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ApiKeyError(f"the API key file {path} holds no key (one key per line)")
        try:
            return cls(keys)
        except ApiKeyError as exc:
            raise ApiKeyError(f"the API key file {path}: {exc}") from None

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <one of the keys>``."""
        if not authorization:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        candidate = presented.strip().encode()
        # Compare with every key, whatever matched: no early exit that timing could reveal.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        return matched
