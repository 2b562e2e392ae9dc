"""Tracker #7: `mha-deploy triton --overwrite` swapped out the whole model directory, taking with it the
other version directories and the files users keep beside a model (labels, notes)."""

from __future__ import annotations

import os

from click.testing import CliRunner

from mha_deploy.batch.lock import OutputLock, lock_path
from mha_deploy.cli import main
from mha_deploy.metadata import Signature
from mha_deploy.serving.triton import TritonConfig, write_triton_model
from tests.adversarial.conftest import assert_loud
from tests.serving.test_triton import parse_config


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_replaces_only_the_version_it_writes(export_model, tmp_path):
    """Other version directories and files a user put beside the model survive --overwrite, byte for byte."""
    first, _ = export_model(Signature("self", "padding"))
    second, _ = export_model(Signature("self", "none"))
    repo = tmp_path / "repo"
    target = write_triton_model(first, repo, TritonConfig(name="mha"))
    (target / "1" / "notes.txt").write_text("inside the version that is replaced")
    (target / "2").mkdir()
    (target / "2" / "model.onnx").write_bytes(b"version 2, another model")
    (target / "labels.txt").write_text("cat\ndog\n")
    kept = {k: v for k, v in _tree(target).items() if not k.startswith("1/") and k != "config.pbtxt"}

    result = CliRunner().invoke(
        main, ["triton", str(second), "--repo", str(repo), "--name", "mha", "--overwrite"]
    )
    assert result.exit_code == 0, result.output
    assert "also holds version(s) 2" in result.stderr and "Triton serves the latest" in result.stderr
    after = _tree(target)
    assert {k: v for k, v in after.items() if k in kept} == kept, "other versions and files are untouched"
    assert sorted(after) == sorted([*kept, "1/model.onnx", "config.pbtxt"]), "version 1 is replaced whole"
    assert after["1/model.onnx"] == second.read_bytes()
    assert [t.name for t in parse_config(target / "config.pbtxt").input] == ["x"], "the config follows the model"
    assert sorted(p.name for p in repo.iterdir()) == ["mha"], "no staging or backup directory is left"

    write_triton_model(first, repo, TritonConfig(name="mha", version=3), overwrite=True)
    assert _tree(target)["3/model.onnx"] == first.read_bytes() and _tree(target)["1/model.onnx"] == second.read_bytes()


def test_a_second_writer_of_one_entry_is_refused_while_the_first_writes(export_model, tmp_path):
    """Round 2: two concurrent `--overwrite` runs swapped the entry out from under each other ("unexpected")."""
    model, _ = export_model(Signature("self", "padding"))
    repo = tmp_path / "repo"
    write_triton_model(model, repo, TritonConfig(name="mha"))
    before = _tree(repo / "mha")
    with OutputLock(lock_path(repo / "mha", output_is_directory=False), repo / "mha"):
        result = CliRunner().invoke(main, ["triton", str(model), "--repo", str(repo), "--name", "mha", "--overwrite"])
        assert_loud(result, f"{repo / 'mha'} is in use by pid {os.getpid()}")
    assert _tree(repo / "mha") == before
    assert sorted(p.name for p in repo.iterdir()) == ["mha"]


def test_a_name_too_long_for_a_file_is_refused_before_anything_is_written(export_model, tmp_path):
    model, _ = export_model(Signature("self", "padding"))
    result = CliRunner().invoke(main, ["triton", str(model), "--repo", str(tmp_path / "repo"), "--name", "a" * 300])
    assert_loud(result, "is 300 characters; at most 200")
    assert len(result.stderr) < 300
    assert not (tmp_path / "repo").exists()
