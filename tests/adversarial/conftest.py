"""Shared by the attacks: the CLI as users run it, and checks that a failure is one loud line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner, Result

from mha_deploy.cli import main
from tests.conftest import TEST_D_MODEL

D = TEST_D_MODEL


def infer(model: Path, source: Path, output: Path, *options: object) -> Result:
    """``mha-deploy infer`` in this process, on the CPU provider, without a progress bar."""
    args = ["infer", model, "--input", source, "--output", output, "--provider", "cpu", "--no-progress", *options]
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_loud(result: Result, *fragments: str) -> str:
    """Exit 1 with one ``error:`` line holding every fragment (no traceback, no 'unexpected'); returns that line."""
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    line = lines[-1]
    assert line.startswith("error: ") and "unexpected" not in line and "Traceback" not in result.output, result.stderr
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def sequences(lengths, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal((n, D))).astype(np.float32) for n in lengths]
