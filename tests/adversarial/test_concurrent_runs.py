"""Tracker #4: two runs on one output, and temporaries that another job's cleanup could take for its own.

Nothing locked an output: two ``infer`` runs on it deleted each other's
temporary files (the stale-temporary glob also matched name prefixes, so ``a``
took ``a.b``'s, and glob metacharacters), or, with different inputs, both
exited 0 and left the second run's outputs under the first one's manifest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from mha_deploy.atomic import atomic_path, temporary_name
from mha_deploy.batch import BatchRunner
from mha_deploy.batch.items import read_arrays
from mha_deploy.batch.job import DatasetJob, OutputInUseError, run_dataset
from mha_deploy.metadata import Signature
from mha_deploy.runtime import MHASession
from tests.adversarial.conftest import assert_loud, infer, sequences
from tests.batch.test_resume import files, write_dataset

SIGNATURE = Signature("self", "padding")
TIMEOUT_S = 120


@pytest.fixture
def session(export_model):
    return MHASession(export_model(SIGNATURE)[0], provider="cpu")


def test_a_second_run_is_refused_while_the_first_holds_the_output(tmp_path, session):
    """Run A pauses after its first batch (threads, one process); run B on the same output fails at once."""
    write_dataset(tmp_path / "a", shards=2, items=6)
    write_dataset(tmp_path / "b", shards=2, items=6, seed=1)
    paused, resume = threading.Event(), threading.Event()
    outcome = {}

    def on_batch(items: int, tokens: int) -> None:
        paused.set()
        resume.wait(TIMEOUT_S)

    def run_a():
        job = DatasetJob(tmp_path / "a", tmp_path / "out", session.source)
        outcome["a"] = run_dataset(job, BatchRunner(session, batch_size=2), on_batch=on_batch)

    first = threading.Thread(target=run_a)
    first.start()
    try:
        assert paused.wait(TIMEOUT_S), "run A never started"
        with pytest.raises(OutputInUseError, match=rf"out is in use by pid {os.getpid()} \(another mha-deploy job"):
            run_dataset(DatasetJob(tmp_path / "b", tmp_path / "out", session.source), BatchRunner(session))
    finally:
        resume.set()
        first.join(TIMEOUT_S)
    assert outcome["a"].shards_written == 2
    run_dataset(DatasetJob(tmp_path / "a", tmp_path / "reference", session.source), BatchRunner(session, batch_size=2))
    assert files(tmp_path / "out") == files(tmp_path / "reference"), "run A's outputs, whole"
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith((".", "_"))) == [
        "_mha_deploy_manifest.json"
    ], "no lock file or temporary left"


def _hold_lock(output: Path, is_directory: bool) -> subprocess.Popen:
    """Another process holding ``output``'s lock until it is killed."""
    code = (
        "import sys, pathlib\n"
        "from mha_deploy.batch.lock import OutputLock, lock_path\n"
        f"out = pathlib.Path({str(output)!r})\n"
        f"lock = OutputLock(lock_path(out, {is_directory}), out)\n"
        "lock.acquire()\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_another_process_holding_the_output_is_named_and_sigkill_frees_it(tmp_path, export_model, layout):
    model = export_model(SIGNATURE)[0]
    if layout == "file":
        np.savez(tmp_path / "in.npz", a=sequences((3,))[0])
        source, out = tmp_path / "in.npz", tmp_path / "out.npz"
    else:
        write_dataset(tmp_path / "in", shards=2, items=3)
        source, out = tmp_path / "in", tmp_path / "out"
    holder = _hold_lock(out, layout == "directory")
    try:
        assert_loud(infer(model, source, out), f"{out} is in use by pid {holder.pid}")
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a killed holder leaves its lock file; the kernel drops the lock
        holder.wait(TIMEOUT_S)
    result = infer(model, source, out)
    assert result.exit_code == 0, result.output


def test_two_real_processes_with_different_inputs_never_both_write(tmp_path, export_model):
    """Started together: one wins; the other is refused (in use, or holding the winner's outputs), nothing mixed."""
    model = export_model(SIGNATURE)[0]
    for name, seed in (("a", 0), ("b", 1)):
        write_dataset(tmp_path / name, shards=3, items=20, seed=seed)
    script = Path(sys.executable).with_name("mha-deploy")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mha_deploy.cli"]
    runs = {
        name: subprocess.Popen(
            [*command, "infer", str(model), "--input", str(tmp_path / name), "--output", str(tmp_path / "out"),
             "--threads", "1", "--provider", "cpu", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name in ("a", "b")
    }
    results = {name: (run.wait(TIMEOUT_S), run.stderr.read()) for name, run in runs.items()}
    winners = [name for name, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    code, stderr = results[loser]
    # "in use by pid N", or "by another process" when the loser looked between the winner's lock and its pid.
    assert code == 1 and ("is in use by" in stderr or "holds the outputs of --input" in stderr), stderr

    session = MHASession(model, provider="cpu")
    run_dataset(DatasetJob(tmp_path / winners[0], tmp_path / "reference", model), BatchRunner(session))
    for name in files(tmp_path / "reference"):
        got, want = read_arrays(tmp_path / "out" / name), read_arrays(tmp_path / "reference" / name)
        assert sorted(got) == sorted(want), name
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-6, err_msg=f"{name}:{key}")


@pytest.mark.parametrize("names", [("a.npz", "a.b.npz"), ("[ab].npz", "a.npz"), ("a*.npz", "ab.npz")])
def test_cleanup_removes_only_its_own_stale_temporaries(tmp_path, session, names):
    """A job writing ``names[0]`` beside another job's live temporary of ``names[1]`` leaves that one alone."""
    mine, theirs = names
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / mine, item=sequences((3,))[0])
    out = tmp_path / "out"
    out.mkdir()
    stale = temporary_name(out / mine)
    stale.write_bytes(b"left by a killed run of this job")
    with atomic_path(out / theirs) as live:  # another job, writing out/<theirs> right now
        live.write_bytes(b"another job's half-written output")
        job = DatasetJob(tmp_path / "in", out, session.source)
        stats = run_dataset(job, BatchRunner(session))
        assert stats.shards_written == 1
        assert live.read_bytes() == b"another job's half-written output", "another job's temporary survives"
        assert not stale.exists(), "this job's own stale temporary is removed"
    assert (out / theirs).read_bytes() == b"another job's half-written output"
    assert set(read_arrays(out / mine)) == {"item"}
