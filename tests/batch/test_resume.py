"""Crash safety: finished shards are skipped on a rerun, nothing half-written survives, SIGKILL loses nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mha_deploy.batch import BatchRunner
from mha_deploy.batch.job import DatasetJob, run_dataset
from mha_deploy.cli import main
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from mha_deploy.runtime.digest import sha256_digest
from tests.batch.test_datasets import write_shard
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL
SIGNATURE = Signature("self", "padding")


NAN_ERROR = "error: shard-1.npz: item 'nan': x contains NaN or Inf (or a value beyond float32's range)"


def write_dataset(
    root: Path, shards: int, items: int, mean_log_length: float = 3.0, seed: int = 0, suffix: str = ".npz"
) -> None:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        lengths = np.clip(rng.lognormal(mean_log_length, 1.0, items).astype(int), 1, 512)
        arrays = {f"s{shard}-{i}": rng.standard_normal((n, D), dtype=np.float32) for i, n in enumerate(lengths)}
        if suffix == ".npz":
            np.savez(root / f"shard-{shard}.npz", **arrays)
        else:
            write_shard(root / f"shard-{shard}{suffix}", {key: {"x": array} for key, array in arrays.items()})


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if not p.name.startswith("_")}


@pytest.fixture
def session(export_model):
    return MHASession(export_model(SIGNATURE)[0], provider="cpu")


def run(session, src, dst, **options) -> object:
    overwrite = options.pop("overwrite", False)
    return run_dataset(DatasetJob(src, dst, session.source, overwrite=overwrite), BatchRunner(session, **options))


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_rerun_skips_finished_shards(tmp_path, session, suffix):
    write_dataset(tmp_path / "in", shards=3, items=5, suffix=suffix)
    first = run(session, tmp_path / "in", tmp_path / "out")
    assert (first.shards_written, first.shards_skipped, first.items) == (3, 0, 15)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = run(session, tmp_path / "in", tmp_path / "out")
    assert (again.shards_written, again.shards_skipped, again.items) == (0, 3, 0)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.suffix == ".npz"} == {
        name: mtime for name, mtime in before.items() if name.endswith(".npz")
    }, "finished shards are not rewritten"


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_changed_input_shard_is_redone(tmp_path, session, suffix):
    write_dataset(tmp_path / "in", shards=2, items=4, suffix=suffix)
    run(session, tmp_path / "in", tmp_path / "out")
    source = tmp_path / "in" / f"shard-1{suffix}"
    record = json.loads((tmp_path / "out" / "_mha_deploy_manifest.json").read_text())["shards"][source.name]
    assert record["input"]["size"] == source.stat().st_size
    assert record["input"]["sha256"] == sha256_digest(source)
    assert record["output"]["name"] == "shard-1.npz"
    write_shard(source, {"new": {"x": np.ones((2, D), np.float32)}})
    stats = run(session, tmp_path / "in", tmp_path / "out")
    assert (stats.shards_written, stats.shards_skipped) == (1, 1)
    with np.load(tmp_path / "out" / "shard-1.npz") as out:
        assert out.files == ["new"]


def test_other_model_is_refused_without_overwrite(tmp_path, session, export_model):
    write_dataset(tmp_path / "in", shards=2, items=3)
    run(session, tmp_path / "in", tmp_path / "out")
    other = MHASession(export_model(Signature("self", "padding-causal"))[0], provider="cpu")
    with pytest.raises(InputError, match=r"written by another model.*--overwrite"):
        run(other, tmp_path / "in", tmp_path / "out")
    stats = run(other, tmp_path / "in", tmp_path / "out", overwrite=True)
    assert stats.shards_written == 2
    manifest = json.loads((tmp_path / "out" / "_mha_deploy_manifest.json").read_text())
    assert manifest["model"].startswith("sha256:") and sorted(manifest["shards"]) == ["shard-0.npz", "shard-1.npz"]


def test_foreign_output_is_not_clobbered(tmp_path, session):
    write_dataset(tmp_path / "in", shards=1, items=2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "shard-0.npz").write_bytes(b"someone else's")
    with pytest.raises(InputError, match="was not written by a resumable run"):
        run(session, tmp_path / "in", tmp_path / "out")
    assert (tmp_path / "out" / "shard-0.npz").read_bytes() == b"someone else's"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["shard-0.npz"]


def test_stop_at_a_bad_item_keeps_finished_shards_and_resumes(tmp_path, session):
    write_dataset(tmp_path / "in", shards=3, items=4)
    good = dict(np.load(tmp_path / "in" / "shard-1.npz"))
    np.savez(tmp_path / "in" / "shard-1.npz", **good, bad=np.ones((2, D + 1), np.float32))
    with pytest.raises(InputError, match=r"shard-1.npz: item 'bad': x has d_model 65"):
        run(session, tmp_path / "in", tmp_path / "out", bucket_window=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["_mha_deploy_manifest.json", "shard-0.npz"]
    np.savez(tmp_path / "in" / "shard-1.npz", **good)
    stats = run(session, tmp_path / "in", tmp_path / "out")
    assert (stats.shards_written, stats.shards_skipped) == (2, 1)


def test_cli_skip_lists_bad_items_and_json_summary(tmp_path, session):
    write_dataset(tmp_path / "in", shards=2, items=3)
    np.savez(tmp_path / "in" / "shard-1.npz", ok=np.ones((2, D), np.float32), nan=np.full((1, D), np.nan, np.float32))
    args = [
        "infer",
        session.source,
        "--input",
        tmp_path / "in",
        "--output",
        tmp_path / "out",
        "--no-progress",
        "--provider",
        "cpu",
    ]
    result = CliRunner().invoke(main, [str(a) for a in [*args, "--on-error", "skip", "--json"]])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["items"] == 4 and summary["shards_written"] == 2 and summary["padding_ratio"] >= 0
    assert summary["batch_ms_p99"] >= summary["batch_ms_p50"] > 0 and summary["provider"] == "cpu"
    assert summary["errors"] == [
        {"shard": "shard-1.npz", "item_id": "nan", "message": NAN_ERROR.removeprefix("error: shard-1.npz: ")}
    ]
    assert "skipped shard-1.npz: item 'nan': x contains NaN or Inf" in result.stderr
    with np.load(tmp_path / "out" / "shard-1.npz") as out:
        assert out.files == ["ok"]
    result = CliRunner().invoke(main, [str(a) for a in [*args, "--on-error", "skip"]])
    assert result.exit_code == 0 and "0 items" in result.stdout and "2 already done" in result.stdout
    # A shard finished by leaving a bad item out is not done for a run told to stop at bad items.
    result = CliRunner().invoke(main, [str(a) for a in [*args, "--on-error", "stop"]])
    assert result.exit_code == 1 and result.stderr.strip() == NAN_ERROR, result.stderr
    result = CliRunner().invoke(main, [str(a) for a in [*args, "--overwrite"]])
    assert result.exit_code == 1 and result.stderr.strip() == NAN_ERROR, (
        result.stderr
    )


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("mha-deploy")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mha_deploy.cli"]


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path, export_model, suffix):
    """A real process killed with SIGKILL after its first output shard; the rerun finishes it, byte for byte."""
    model = export_model(SIGNATURE)[0]
    write_dataset(tmp_path / "in", shards=6, items=120, mean_log_length=4.3)
    if suffix == ".parquet":
        from tests.batch.test_datasets import write_parquet

        for path in sorted((tmp_path / "in").iterdir()):
            with np.load(path) as arrays:
                write_parquet(
                    path.with_suffix(".parquet"), {k: {"x": arrays[k]} for k in arrays.files}, row_group_size=50
                )
            path.unlink()
    command = [
        *_cli(),
        "infer",
        str(model),
        "--input",
        str(tmp_path / "in"),
        "--threads",
        "1",
        "--batch-size",
        "4",
        "--bucket-window",
        "0",
        "--provider",
        "cpu",
        "--no-progress",
    ]

    reference = subprocess.run([*command, "--output", str(tmp_path / "reference")], capture_output=True, timeout=300)
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "out"
    process = subprocess.Popen([*command, "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.suffix == suffix and not p.name.startswith(".") for p in out.glob("*")):
        assert process.poll() is None and time.monotonic() < deadline, "no output shard before the process ended"
        time.sleep(0.005)
    time.sleep(0.1)  # past the manifest update that follows the rename, into the next shard
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    finished = [p.name for p in out.iterdir() if p.suffix == suffix and not p.name.startswith(".")]
    assert 1 <= len(finished) < 6, f"the kill came after every shard was done: {finished}"

    rerun = subprocess.run([*command, "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    done = int(re.search(r"(\d+) already done", rerun.stdout).group(1))
    assert 1 <= done <= len(finished) and f"{6 - done} written" in rerun.stdout, rerun.stdout
    assert files(out) == files(tmp_path / "reference"), "same shards, same bytes"
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name], "no temporary file left"
