"""Content digests: what caches and manifests are keyed by (a file's bytes, never its mtime).

``cp -p``, ``rsync -t`` and restores from backups keep modification times, so a
replaced file can look unchanged to anything that compares mtimes.
"""

from __future__ import annotations

import hashlib
import os

_BLOCK = 1 << 20


def sha256_digest(source: str | os.PathLike | bytes) -> str:
    """``"sha256:<hex>"`` of a file's contents (read in blocks) or of bytes."""
    digest = hashlib.sha256()
    if isinstance(source, bytes | bytearray | memoryview):
        digest.update(source)
    else:
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                digest.update(block)
    return f"sha256:{digest.hexdigest()}"
