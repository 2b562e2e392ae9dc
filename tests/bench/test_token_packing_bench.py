"""benchmarks/token_packing.py: a tiny run per model prints and writes a packed and an unpacked timing for every
width, shape and padding (the structure only; timings are never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["classifier", "encoder"])
def test_tiny_run_reports_every_case(tmp_path, model):
    figures_path = tmp_path / "packing.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "token_packing.py"), "--model", model, "--widths", "32",
               "--layers", "1", "--shapes", "2x8", "--budget-s", "0.01", "--threads", "1",
               # the yardstick at one small size: 512 to 4096 cubed cost ~10 s of this test, and its rate is
               # only printed
               "--gemm-sizes", "256", "--json", str(figures_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(figures_path.read_text())
    assert figures["model"] == model and figures["gemm_gflops"] > 0
    assert [(row["d_model"], row["batch"], row["seq"], row["padded_pct"]) for row in figures["rows"]] == [
        (32, 2, 8, 25.0), (32, 2, 8, 0.0)]
    for row in figures["rows"]:
        # packed whatever its size: the bound is lifted for the packed export
        assert "run on the real tokens of" in row["packing"]
        assert row["packed_ms"] > 0 and row["unpacked_ms"] > 0 and row["macs_per_copied_element"] > 0
    assert "packed over unpacked" in run.stdout
