"""benchmarks/own_model.py: its quick mode on a tiny classifier prints and writes every figure the target needs.

The structure only (every row at every shape, the ratios against the targets, memory for every row);
timings are never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["ORT fused", "ORT unpacked", "ORT plain", "torch SDPA", "torch eager"]


@pytest.mark.slow
def test_quick_run_reports_every_row(tmp_path):
    figures_path = tmp_path / "figures.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "own_model.py"), "--quick", "--threads", "1",
        "--d-model", "16", "--heads", "2", "--layers", "2", "--vocab", "20", "--max-len", "64",
        "--shapes", "2x8,1x12", "--memory-shape", "1x16", "--budget-s", "0.01", "--json", str(figures_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]

    figures = json.loads(figures_path.read_text())
    assert figures["sizes"] == {"d_model": 16, "heads": 2, "layers": 2, "vocab": 20, "max_len": 64}
    assert figures["threads"] == 1 and figures["gemm_gflops"] > 0
    # Both attentions fused in the auto exports, none in the plain one; the unpacked export packs nothing
    # (the default one does not either at this width: too small to pay, and it says so).
    assert "2 fused" in figures["exports"]["ORT fused"]["fusion"]
    assert "2 fused" in figures["exports"]["ORT unpacked"]["fusion"]
    assert "0 fused" in figures["exports"]["ORT plain"]["fusion"]
    assert "not applied (too small" in figures["exports"]["ORT fused"]["packing"]
    assert figures["exports"]["ORT unpacked"]["packing"] is None
    assert [(s["batch"], s["seq"]) for s in figures["shapes"]] == [(2, 8), (1, 12)]
    for shape in figures["shapes"]:
        # A quarter of every row right-padded: 2x8 keeps 6 real tokens a row, 1x12 keeps 9.
        assert shape["real_tokens"] == shape["batch"] * (shape["seq"] - round(shape["seq"] / 4))
        assert list(shape["rows"]) == ROWS
        for row in shape["rows"].values():
            assert row["median_ms"] > 0 and row["tokens_per_s"] > 0 and row["runs"] >= 2
            assert row["within_parity_tolerance"]  # every row computes the eager module's logits
        assert set(shape["ratios"]) == {f"fused vs {name}" for name in ROWS[1:]}
    assert [(m["backend"], m["batch"], m["seq"]) for m in figures["memory"]] == [(name, 1, 16) for name in ROWS]
    assert all(m["peak_rss_mb"] > 0 and m["run_mb"] >= 0 for m in figures["memory"])

    out = run.stdout
    for shape in ("2x8", "1x12"):
        assert f"  {shape}: vs ORT unpacked" in out and "; vs ORT plain" in out
    assert out.count("target >= 1.3x") == 2 and out.count("target >= 1.0x") == 2
    assert "ORT fp32 MatMul peak" in out and "added by run MB" in out


def test_bench_model_takes_a_users_model(own_model):
    """`mha-deploy bench MODEL --module` on a file exported from a user's model: the file and the module in
    torch, padded as asked, the file's error against the module within the export's tolerance."""
    import json

    from click.testing import CliRunner

    from mha_deploy.cli import main
    from tests.conftest import USER_MODELS

    path = own_model("classifier")[0]
    result = CliRunner().invoke(main, [
        "bench", str(path), "--module", f"{USER_MODELS / 'classifier'}.py:build", "--mask", "padding-25%",
        "--shapes", "2x16", "--budget-s", "0.05", "--gemm-sizes", "128", "--json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    rows = {row["backend"]: row for row in report["rows"]}
    assert set(rows) == {f"ORT {path.name}", "torch eager"}
    assert all(row["mask"] == "padding-25%" and (row["batch"], row["seq"]) == (2, 16) for row in rows.values())
    assert rows[f"ORT {path.name}"]["within_tolerance"] and rows[f"ORT {path.name}"]["max_abs_err"] < 1e-5
