"""Round 2, defects 2 and 3: a lock that wrote through a planted link, and two jobs writing one file.

A symlink (or hard link) planted at an output's lock path had the job's pid
line written into its target. A directory job ``--output L1`` and a file job
``--output L1/s11.npz`` took different locks, so both ran and one's result
was lost.
"""

from __future__ import annotations

import os

import pytest

from mha_deploy.batch.lock import OutputInUseError, OutputLock, lock_path
from mha_deploy.metadata import Signature
from tests.adversarial.conftest import assert_loud, infer
from tests.batch.test_resume import write_dataset


@pytest.fixture
def model(export_model):
    return export_model(Signature("self", "padding"))[0]


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_link_at_the_lock_path_is_refused_and_its_target_untouched(tmp_path, model, link):
    write_dataset(tmp_path / "ds", shards=1, items=3)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    planted = tmp_path / "out" / "_mha_deploy.lock"
    os.symlink(victim, planted) if link == "symlink" else os.link(victim, planted)
    result = infer(model, tmp_path / "ds", tmp_path / "out")
    assert_loud(result, str(planted), "remove it")
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_mha_deploy.lock"]


def test_a_file_job_inside_a_running_directory_jobs_output_is_refused(tmp_path, model):
    write_dataset(tmp_path / "ds", shards=1, items=3)
    single = tmp_path / "ds" / "shard-0.npz"
    out = tmp_path / "L1"
    with OutputLock(lock_path(out, output_is_directory=True), out):
        result = infer(model, single, out / "s11.npz")
        assert_loud(result, "inside", "the output of another mha-deploy job", f"pid {os.getpid()}")
        assert [p.name for p in out.iterdir()] == ["_mha_deploy.lock"], "the refused job leaves nothing"


def test_a_directory_job_over_a_running_file_jobs_output_is_refused(tmp_path, model):
    write_dataset(tmp_path / "ds", shards=1, items=3)
    out = tmp_path / "L1"
    inner = out / "s11.npz"
    with OutputLock(lock_path(inner, output_is_directory=False), inner):
        result = infer(model, tmp_path / "ds", out)
        assert_loud(result, ".s11.npz.mha-deploy.lock", "another mha-deploy job", f"pid {os.getpid()}")
    assert not (out / "shard-0.npz").exists()


def test_nested_directory_jobs_refuse_each_other_both_ways(tmp_path):
    outer, inner = tmp_path / "L1", tmp_path / "L1" / "sub"
    with OutputLock(lock_path(outer, True), outer), pytest.raises(OutputInUseError, match="inside"):
        OutputLock(lock_path(inner, True), inner).acquire()
    with OutputLock(lock_path(inner, True), inner), pytest.raises(OutputInUseError, match=r"sub/_mha_deploy\.lock"):
        OutputLock(lock_path(outer, True), outer).acquire()
    # Siblings, and a lock file a dead job left above, block nobody.
    (tmp_path / "_mha_deploy.lock").write_text("999999 host\n")
    with OutputLock(lock_path(tmp_path / "a", True), tmp_path / "a"):
        OutputLock(lock_path(tmp_path / "b", True), tmp_path / "b").acquire()
