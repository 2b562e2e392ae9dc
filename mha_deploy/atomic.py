"""Write a file so that readers see either the old file or the whole new one, never a part.

Shared by the exporters (models), checkpoints and serving (outputs): no torch here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``, on error removed.

    The temporary file gets the permissions a plain ``open`` would give (tempfile's
    mkstemp would leave 0600, unreadable to a service running as another user).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keep the real suffix last: np.savez appends ".npz" to names without it.
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(6)}.tmp{path.suffix}")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
