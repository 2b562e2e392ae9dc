"""Denormals flushed to zero around ORT's work on the calling thread, and nowhere else."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from mha_deploy.inputs import InputCase, make_inputs
from mha_deploy.metadata import Signature
from mha_deploy.runtime import denormals
from mha_deploy.runtime.session import MHASession
from tests.conftest import TEST_D_MODEL

needs_fenv = pytest.mark.skipif(not denormals.supported(), reason="the thread's denormal mode is set on glibc x86-64")


def _denormals_survive() -> bool:
    """Whether this thread keeps a denormal result (1e-38 / 10) rather than flushing it to zero."""
    return float(np.float32(1e-38) / np.float32(10)) != 0.0


@needs_fenv
def test_the_block_flushes_this_thread_and_restores_it_after():
    assert _denormals_survive()
    with denormals.flushing_denormals():
        inside = _denormals_survive()
    assert (inside, _denormals_survive()) == (False, True)


@needs_fenv
def test_the_state_is_restored_after_an_exception():
    with pytest.raises(RuntimeError), denormals.flushing_denormals():
        raise RuntimeError("in the block")
    assert _denormals_survive()


def test_a_disabled_block_changes_nothing():
    with denormals.flushing_denormals(enabled=False):
        assert _denormals_survive()


@needs_fenv
def test_the_block_is_per_thread():
    seen = {}
    started, done = threading.Event(), threading.Event()

    def other():
        started.wait()
        seen["other"] = _denormals_survive()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with denormals.flushing_denormals():
        started.set()
        done.wait(10)
    thread.join()
    assert seen["other"] is True


@needs_fenv
def test_loading_and_running_leave_the_callers_thread_as_it_was(export_model):
    # ORT turns flushing on for good on the thread that creates the process's first session: run in a fresh
    # interpreter, so that MHASession's load is that first one.
    path, _ = export_model(Signature("self", "padding-causal"))
    code = (
        "import numpy as np\n"
        "from mha_deploy.runtime.session import MHASession\n"
        "def survive(): return float(np.float32(1e-38) / np.float32(10)) != 0.0\n"
        f"session = MHASession({str(path)!r}, provider='cpu')\n"
        "after_load = survive()\n"
        "x = np.ones((1, 4, session.metadata.d_model), np.float32)\n"
        "session.run({'x': x, 'key_padding_mask': np.ones((1, 4), bool)})\n"
        "print(after_load, survive())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("mask", ["causal", "padding-causal", "padding"])
def test_flushing_changes_no_output(export_model, mask):
    # Masked probabilities below 1.2e-38 are the only values flushed: nothing an fp32 output can show.
    signature = Signature("self", mask)
    path, _ = export_model(signature)
    flushed, kept = (MHASession(path, provider="cpu", flush_denormals=flag) for flag in (True, False))
    for case in (InputCase(2, 40, 40, "mixed"), InputCase(1, 300, 300, "left")):
        feeds = make_inputs(signature, TEST_D_MODEL, case, seed=5)
        np.testing.assert_array_equal(flushed.run(feeds)["output"], kept.run(feeds)["output"])


@pytest.mark.parametrize(
    ("flush", "config", "entry"),
    [(True, {}, "1"), (False, {}, None), (True, {denormals.ORT_CONFIG_ENTRY: "0"}, "0")],
    ids=["flushing", "not-flushing", "caller-entry-wins"],
)
def test_orts_pool_threads_follow_the_option_unless_the_caller_set_the_entry(export_model, flush, config, entry):
    path, _ = export_model(Signature("self", "causal"))
    session = MHASession(path, provider="cpu", flush_denormals=flush, session_config=config)
    options = session._session.get_session_options()
    if entry is None:
        with pytest.raises(RuntimeError):  # ORT's way of saying the entry was never set
            options.get_session_config_entry(denormals.ORT_CONFIG_ENTRY)
    else:
        assert options.get_session_config_entry(denormals.ORT_CONFIG_ENTRY) == entry
