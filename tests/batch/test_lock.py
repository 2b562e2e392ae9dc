"""OutputLock: one holder per output, named when refused; nothing left behind; a dead holder blocks nobody."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from mha_deploy.batch import lock as lock_module
from mha_deploy.batch.lock import OutputError, OutputInUseError, OutputLock, lock_path


def test_holder_is_named_and_release_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    path = lock_path(out, output_is_directory=True)
    assert path == out / "_mha_deploy.lock"
    with OutputLock(path, out) as held:
        assert path.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
        held.acquire()  # idempotent
        with pytest.raises(OutputInUseError, match=rf"{out} is in use by pid {os.getpid()} \(another mha-deploy"):
            OutputLock(path, out).acquire()
    assert not (tmp_path / "new").exists(), "the directories the lock created, empty, are removed"


def test_file_outputs_lock_beside_them(tmp_path):
    out = tmp_path / "out.npz"
    path = lock_path(out, output_is_directory=False)
    assert path == tmp_path / ".out.npz.mha-deploy.lock"
    with OutputLock(path, out):
        assert path.exists()
        other = OutputLock(lock_path(tmp_path / "out.npz.b", False), tmp_path / "out.npz.b")
        other.acquire()  # another output's lock is independent
        other.release()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_left_by_a_dead_holder_blocks_nobody(tmp_path):
    path = tmp_path / ".out.npz.mha-deploy.lock"
    path.write_text("999999 some-host\n")  # what a SIGKILLed holder leaves: the kernel dropped its lock
    with OutputLock(path, tmp_path / "out.npz"):
        assert path.read_text().startswith(f"{os.getpid()} ")


def test_a_lock_file_removed_under_the_opener_is_retried(tmp_path, monkeypatch):
    """Between open and flock the previous holder may remove the file: the lock must be on the one at the path."""
    calls = []
    real = lock_module._same_file

    def first_time_stale(fd, path):
        calls.append(path)
        return len(calls) > 1 and real(fd, path)

    monkeypatch.setattr(lock_module, "_same_file", first_time_stale)
    with OutputLock(tmp_path / "x.lock", tmp_path / "x"):
        assert len(calls) == 2


def test_without_flock_infer_refuses_to_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows
    with pytest.raises(OutputError, match="does not support Windows"):
        OutputLock(tmp_path / "x.lock", tmp_path / "x").acquire()


def test_an_unwritable_place_is_an_output_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="cannot create"):
            OutputLock(tmp_path / "out" / "_mha_deploy.lock", tmp_path / "out").acquire()
    finally:
        tmp_path.chmod(0o700)


def test_a_lock_dropped_unreleased_is_let_go(tmp_path):
    import gc

    path, out = tmp_path / "x.lock", tmp_path / "x"
    OutputLock(path, out).acquire()  # dropped at once, as by a job abandoned after an error
    gc.collect()
    with OutputLock(path, out):
        pass
