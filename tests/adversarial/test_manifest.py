"""Tracker #5, and resume that verifies what it skips: a manifest never reports 'done' for what is not.

A single-file output's manifest mixed jobs: a.npz -> out.npz, then b.npz ->
out.npz (not refused), then a.npz again reported '1 already done' while
out.npz held b's items. And resume trusted a shard's name: a truncated or
damaged output, or an input replaced with its size and mtime kept, was skipped.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from mha_deploy.batch.items import read_arrays
from mha_deploy.metadata import Signature
from tests.adversarial.conftest import assert_loud, infer, sequences
from tests.batch.test_resume import files, write_dataset

SIGNATURE = Signature("self", "padding")


def test_another_input_into_the_same_output_file_is_refused_never_reported_done(tmp_path, export_model):
    model = export_model(SIGNATURE)[0]
    np.savez(tmp_path / "a.npz", a1=sequences((3,), seed=1)[0], a2=sequences((2,), seed=2)[0])
    np.savez(tmp_path / "b.npz", b1=sequences((4,), seed=3)[0])
    out = tmp_path / "out.npz"

    assert infer(model, tmp_path / "a.npz", out).exit_code == 0
    assert_loud(infer(model, tmp_path / "b.npz", out), f"{out} holds the outputs of --input {tmp_path / 'a.npz'}",
                "--overwrite")
    assert sorted(read_arrays(out)) == ["a1", "a2"], "a's outputs are kept"

    assert infer(model, tmp_path / "b.npz", out, "--overwrite").exit_code == 0
    assert sorted(read_arrays(out)) == ["b1"]
    again = infer(model, tmp_path / "a.npz", out)
    assert "already done" not in again.output
    assert_loud(again, f"holds the outputs of --input {tmp_path / 'b.npz'}")
    assert sorted(read_arrays(out)) == ["b1"]

    done = infer(model, tmp_path / "b.npz", out)
    assert done.exit_code == 0 and "1 already done" in done.stdout, done.output


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped byte":  # same size, same mtime: only the digest can tell
        stat = path.stat()
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped byte", "deleted"])
def test_a_damaged_finished_shard_is_redone_not_skipped(tmp_path, export_model, how):
    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=3, items=4)
    assert infer(model, tmp_path / "in", tmp_path / "out").exit_code == 0
    reference = files(tmp_path / "out")
    _damage(tmp_path / "out" / "shard-1.npz", how)

    rerun = infer(model, tmp_path / "in", tmp_path / "out")
    assert rerun.exit_code == 0, rerun.output
    assert "1 written, 2 already done" in rerun.stdout
    assert "redid shard-1.npz: its output" in rerun.stderr
    assert files(tmp_path / "out") == reference, "the redone shard is byte-identical"


def test_an_input_replaced_with_size_and_mtime_kept_is_redone(tmp_path, export_model):
    """`cp -p` of another shard of the same size keeps the mtime: the content digest still tells."""
    model = export_model(SIGNATURE)[0]
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "s.npz", item=sequences((5,), seed=1)[0])
    np.savez(tmp_path / "other.npz", item=sequences((5,), seed=2)[0])
    assert infer(model, tmp_path / "in", tmp_path / "out").exit_code == 0
    stat = (tmp_path / "in" / "s.npz").stat()
    shutil.copyfile(tmp_path / "other.npz", tmp_path / "in" / "s.npz")
    os.utime(tmp_path / "in" / "s.npz", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (tmp_path / "in" / "s.npz").stat().st_size == stat.st_size

    rerun = infer(model, tmp_path / "in", tmp_path / "out")
    assert rerun.exit_code == 0 and "1 written, 0 already done" in rerun.stdout, rerun.output
    assert infer(model, tmp_path / "other.npz", tmp_path / "expected.npz").exit_code == 0
    assert (tmp_path / "out" / "s.npz").read_bytes() == (tmp_path / "expected.npz").read_bytes()


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: "not json",
        lambda m: json.dumps({**m, "format": 99}),
        lambda m: json.dumps({**m, "shards": {k: {**v, "output": {"size": "big"}} for k, v in m["shards"].items()}}),
    ],
    ids=["garbage", "unknown-format", "wrong-types"],
)
def test_a_tampered_manifest_is_refused(tmp_path, export_model, edit):
    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=1, items=2)
    assert infer(model, tmp_path / "in", tmp_path / "out").exit_code == 0
    manifest = tmp_path / "out" / "_mha_deploy_manifest.json"
    manifest.write_text(edit(json.loads(manifest.read_text())))
    assert_loud(infer(model, tmp_path / "in", tmp_path / "out"), f"{manifest}: unreadable", "--overwrite")
    assert infer(model, tmp_path / "in", tmp_path / "out", "--overwrite").exit_code == 0


def test_the_manifest_records_what_produced_each_output(tmp_path, export_model):
    from mha_deploy.runtime.digest import sha256_digest

    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=1, items=2)
    assert infer(model, tmp_path / "in", tmp_path / "out", "--max-batch-tokens", "64").exit_code == 0
    manifest = json.loads((tmp_path / "out" / "_mha_deploy_manifest.json").read_text())
    record = manifest["shards"]["shard-0.npz"]
    assert manifest["model"] == sha256_digest(model) and manifest["input"] == str((tmp_path / "in").resolve())
    assert record["input"]["sha256"] == sha256_digest(tmp_path / "in" / "shard-0.npz")
    assert record["output"] == {
        "name": "shard-0.npz",
        "size": (tmp_path / "out" / "shard-0.npz").stat().st_size,
        "sha256": sha256_digest(tmp_path / "out" / "shard-0.npz"),
    }
    assert record["options"] == {"on_error": "stop", "batch_size": None, "max_batch_tokens": 64, "bucket_window": 256}
