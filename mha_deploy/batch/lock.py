"""An exclusive lock on a job's output, held for the whole run, so that two jobs never write one output.

``flock`` on a lock file beside the output file (``.<name>.mha-deploy.lock``) or
inside the output directory (``_mha_deploy.lock``: readers of datasets skip
``_`` names). The holder writes its pid and host into the file, so a refused
job can say who holds the output. The kernel drops the lock when its holder
exits, however it exits (SIGKILL included): a lock file left behind is never
mistaken for a live holder.

The holder removes the file before it lets go. A job that opened the file just
before that removal would then hold a lock on a file no longer at the path, so
after locking, the inode open is compared with the one at the path, and the
attempt is retried when they differ (the usual protocol for removable lock files).

The lock file is opened without following a link (``O_NOFOLLOW``) and must be a
regular file with no other name: a symlink or hard link planted at its path
would otherwise have the holder's pid line written into whatever it points at.

One job per output tree: after taking its own lock, a job refuses to run when
a directory above its output is another job's locked output directory, or,
for a directory output, when a lock inside it is held (a file job writing one
of its files, a directory job below it). Both jobs lock first and look second,
so of two nested jobs starting together at least one sees the other.

POSIX only: Windows has no ``flock``, and ``mha-deploy infer`` refuses to run
there rather than write without a lock. ``flock`` on NFS is emulated with
byte-range locks by Linux (2.6.12 and later), which an NFS server arbitrates
between machines.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import weakref
from pathlib import Path

from mha_deploy.errors import OutputError, OutputInUseError

_ATTEMPTS = 16
DIRECTORY_LOCK = "_mha_deploy.lock"
FILE_LOCK_SUFFIX = ".mha-deploy.lock"


def lock_path(output: Path, output_is_directory: bool) -> Path:
    """Where the lock of ``output`` lives: inside an output directory, beside an output file."""
    if output_is_directory:
        return output / DIRECTORY_LOCK
    return output.with_name(f".{output.name}{FILE_LOCK_SUFFIX}")


def _fcntl():
    try:
        import fcntl
    except ImportError:  # Windows
        raise OutputError(
            "locking an output needs POSIX flock, which this platform lacks: `mha-deploy infer` "
            "does not support Windows (use WSL or Linux)"
        ) from None
    return fcntl


class OutputLock:
    """``flock(LOCK_EX | LOCK_NB)`` on ``path`` for ``output``; ``acquire`` is idempotent, ``release`` too."""

    def __init__(self, path: Path, output: Path):
        self.path, self.output = Path(path), Path(output)
        self._fd: int | None = None
        self._created: list[Path] = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fcntl = _fcntl()
        self._make_parent()
        for _ in range(_ATTEMPTS):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(fd)
                os.close(fd)
                self._remove_created()
                raise OutputInUseError(
                    f"{self.output} is in use by {owner} (another mha-deploy job writing it, lock "
                    f"{self.path.name}); wait for it to finish or choose another --output"
                ) from None
            except OSError as exc:  # e.g. ENOLCK: an NFS mount without a lock manager
                os.close(fd)
                self._remove_created()
                raise OutputError(f"{self.output}: cannot lock {self.path} ({exc.strerror or exc})") from exc
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the previous holder removed the file after we opened it: try the new one
        else:
            self._remove_created()
            raise OutputError(f"{self.output}: could not lock {self.path} in {_ATTEMPTS} attempts")
        try:
            self._refuse_nested_jobs()
        except OutputError:
            self.path.unlink(missing_ok=True)  # ours, and still locked: see the module docstring
            os.close(fd)
            self._remove_created()
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd = fd
        # A lock never released (its job dropped after an error) is let go when it is collected.
        self._finalizer = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: see the module docstring
        finally:
            self._finalizer.detach()
            os.close(self._fd)
            self._fd = None
        self._remove_created()

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._remove_created()
            if self.path.is_symlink():
                raise OutputError(
                    f"{self.output}: its lock file {self.path} is a symbolic link; the lock never follows one: "
                    "remove it"
                ) from None
            reason = exc.strerror or exc
            raise OutputError(f"{self.output}: cannot create its lock file {self.path} ({reason})") from exc
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or opened.st_nlink != 1:
            os.close(fd)
            self._remove_created()
            raise OutputError(
                f"{self.output}: its lock file {self.path} is not a plain file of its own (a hard link or a special "
                "file); the lock never writes through one: remove it"
            )
        return fd

    def _refuse_nested_jobs(self) -> None:
        """``OutputInUseError`` when a held lock sits above this output (a directory job's) or, for a
        directory output, anywhere inside it."""
        output = self.output.resolve()
        for directory in output.parents:
            owner = _holder(directory / DIRECTORY_LOCK)
            if owner is not None:
                raise OutputInUseError(
                    f"{self.output} is inside {directory}, the output of another mha-deploy job ({owner}); wait "
                    "for it to finish or choose an --output outside it"
                )
        if self.path.name != DIRECTORY_LOCK:
            return
        own = output / DIRECTORY_LOCK
        for root, _directories, files in os.walk(output):
            for name in files:
                path = Path(root) / name
                if path == own or not (name == DIRECTORY_LOCK or name.endswith(FILE_LOCK_SUFFIX)):
                    continue
                owner = _holder(path)
                if owner is not None:
                    raise OutputInUseError(
                        f"{self.output} holds {path.relative_to(output)}, the lock of another mha-deploy job "
                        f"({owner}) writing inside it; wait for it to finish or choose another --output"
                    )

    def _make_parent(self) -> None:
        """Create the lock's directory (the output directory, or an output file's parent) if missing."""
        missing = []
        for directory in (self.path.parent, *self.path.parent.parents):
            if directory.exists():
                break
            missing.append(directory)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"{self.output}: cannot create {self.path.parent} ({exc.strerror or exc})") from exc
        self._created = missing  # deepest first

    def _remove_created(self) -> None:
        """Directories this lock created and nothing filled: a failed job leaves no empty output directory."""
        for directory in self._created:
            with contextlib.suppress(OSError):  # not empty (the job wrote something), or already gone
                directory.rmdir()
        self._created = []


def _same_file(fd: int, path: Path) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (at_path.st_dev, at_path.st_ino)


def _holder(path: Path) -> str | None:
    """Who holds the lock file at ``path`` (``_owner``), or None when nobody does or there is none."""
    fcntl = _fcntl()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # none, a link (never ours), unreadable: not a lock a job holds
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _owner(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # also lets go of the shared lock, if taken
    return None


def _owner(fd: int) -> str:
    """``pid N`` (``on host H`` when it is another machine), from what the holder wrote into the lock file."""
    try:
        pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid.isdigit():
        return "another process"
    return f"pid {pid}" + (f" on host {host}" if host and host != socket.gethostname() else "")
