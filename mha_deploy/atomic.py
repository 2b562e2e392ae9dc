"""Write a file so that readers see either the old file or the whole new one, never a part.

Shared by the exporters (models), checkpoints and serving (outputs): no torch here.

A temporary is named ``.<name>.<12 hex digits>.tmp<suffix>`` beside its
destination ``<name>``: the whole destination name is in it, so the temporaries
of ``a.npz`` and of ``a.b.npz`` can never be taken for one another, and
``stale_temporaries`` finds them by exact match (no glob, so ``[``, ``*`` or
``?`` in a name mean nothing).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from mha_deploy.errors import OutputError

_TOKEN_HEX = 12


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (through links too), or the same path when either does not exist:
    what a tool must know before it writes ``a`` while reading ``b``."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def temporary_name(path: str | os.PathLike) -> Path:
    """A fresh temporary path for ``path`` (in the same directory, so that the rename is atomic)."""
    path = Path(path)
    # Keep the real suffix last: np.savez appends ".npz" to names without it.
    return path.with_name(f".{path.name}.{secrets.token_hex(_TOKEN_HEX // 2)}.tmp{path.suffix}")


def stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """The temporaries of ``path`` that exist now: left by a killed writer, or being written by a live one.

    Only the caller knows which: remove them only while holding whatever keeps
    other writers of ``path`` away (``mha_deploy.batch.lock.OutputLock`` for outputs).
    """
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{_TOKEN_HEX}}}\.tmp{re.escape(path.suffix)}")
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return []
    return [Path(entry.path) for entry in entries if pattern.fullmatch(entry.name) and entry.is_file()]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``, on error removed.

    The temporary file gets the permissions a plain ``open`` would give (tempfile's
    mkstemp would leave 0600, unreadable to a service running as another user).
    ``OutputError`` when the temporary cannot be created at all.
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created here, so that a directory that takes no files (read-only, gone) is reported naming the
        # destination, not as whatever the writer makes of the temporary's name.
        tmp.open("xb").close()
    except OSError as exc:
        raise OutputError(f"{path}: cannot write it ({exc.strerror or exc})") from exc
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
