"""benchmarks/hf_models.py at a tiny config: every model gets every row, timed or with the reason it is not.

The structure only (rows, ratios against the targets, what ORT's optimizer fused, errors against torch);
timings are never asserted. Which exports succeed depends on what the exporter handles: a row that fails
must say why, and the run must go on. DistilBERT (an encoder, right-padded) and GPT-2 (a decoder, left-padded)
stand for the script's paths; BART, the third model of a real run, exports as the others do (its export and fusion
are tested in tests/exporters) and would double this test's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORT_ROWS = ["ORT default", "ORT plain", "ORT optimizer"]
TORCH_ROWS = ["torch SDPA", "torch eager"]
SHAPES = [(2, 8), (1, 12)]


@pytest.mark.slow
def test_tiny_run_reports_every_row_of_each_model(tmp_path):
    figures_path = tmp_path / "figures.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "hf_models.py"), "--quick", "--threads", "1",
        "--models", "distilbert,gpt2", "--layers", "1", "--d-model", "32", "--heads", "4", "--ffn", "64",
        "--vocab", "96", "--max-positions", "64",
        "--shapes", "2x8,1x12", "--budget-s", "0.01", "--json", str(figures_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]

    figures = json.loads(figures_path.read_text())
    assert figures["sizes"] == {"layers": 1, "d_model": 32, "heads": 4, "ffn": 64, "vocab": 96, "max_positions": 64}
    assert figures["threads"] == 1 and figures["gemm_gflops"] > 0
    assert list(figures["models"]) == ["distilbert", "gpt2"]
    sides = {name: model["padding_side"] for name, model in figures["models"].items()}
    assert sides == {"distilbert": "right", "gpt2": "left"}
    for name, model in figures["models"].items():
        assert "error" not in model, f"{name}: {model.get('error')}"  # the test models' inputs declare
        assert list(model["exports"]) == ORT_ROWS
        for shape, (batch, seq) in zip(model["shapes"], SHAPES, strict=True):
            assert (shape["batch"], shape["seq"]) == (batch, seq)
            timed = {row["backend"]: row for row in model["report"]["rows"]
                     if (row["batch"], row["seq"]) == (batch, seq)}
            # Every row is timed or says why not, never both; torch always runs.
            assert set(TORCH_ROWS) <= set(timed)
            for row in ORT_ROWS:
                assert (row in timed) != (row in model["not_timed"]), (name, row)
                if row not in timed:
                    assert model["not_timed"][row]
            # Every row computes the eager module's output: the exports passed parity, and torch's SDPA is exact.
            assert all(row["within_tolerance"] and row["median_ms"] > 0 for row in timed.values()), timed
            expected = {f"default vs {row}" for row in [*ORT_ROWS[1:], *TORCH_ROWS] if row in timed}
            assert set(shape["ratios"]) == (expected if "ORT default" in timed else set())
    # DistilBERT's plain graph exports as it comes, and ORT's optimizer fuses its layer norms (not its attention).
    distilbert = figures["models"]["distilbert"]
    assert "0 fused" in distilbert["exports"]["ORT plain"]["fusion"]
    optimizer = distilbert["exports"]["ORT optimizer"]
    assert optimizer["fused_ops"]["SkipLayerNormalization"] == 2 and optimizer["softmax_left"] + optimizer[
        "attentions"] == 1
    assert "ORT plain" not in distilbert["not_timed"] and "ORT optimizer" not in distilbert["not_timed"]

    out = run.stdout
    assert "ORT fp32 MatMul peak" in out and "default export's throughput over each row's" in out
    for name in figures["models"]:
        assert f"\n{name} (" in out
        for batch, seq in SHAPES:
            assert f"\n{name:<11} {f'{batch}x{seq}':<7} " in out
