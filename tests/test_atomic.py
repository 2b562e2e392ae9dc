"""Atomic writes: all or nothing, with ordinary permissions."""

from __future__ import annotations

import os

import pytest

from mha_deploy.atomic import atomic_path


def test_success_replaces_with_umask_permissions(tmp_path):
    target = tmp_path / "sub" / "out.npz"
    old = os.umask(0o022)
    try:
        with atomic_path(target) as tmp:
            assert tmp.parent == target.parent and tmp.suffix == ".npz"
            tmp.write_bytes(b"new")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["out.npz"]


def test_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out.onnx"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]
