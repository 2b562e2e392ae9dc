"""mha-deploy bench: shapes, FLOP counting, a tiny real run, the plot, and the memory probe."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mha_deploy.bench import parse_shapes, run_bench
from mha_deploy.bench.backends import default_backends
from mha_deploy.bench.memory import measure_peak_rss
from mha_deploy.bench.timing import mha_flops
from mha_deploy.cli import main
from mha_deploy.errors import MHADeployError
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention
from tests.conftest import TEST_D_MODEL, TEST_HEADS


def test_parse_shapes():
    assert parse_shapes("8x128, 1X1024") == ((8, 128), (1, 1024))


@pytest.mark.parametrize("text", ["8", "8x", "ax1", "0x5", "2x3x4"])
def test_bad_shapes(text):
    with pytest.raises(MHADeployError, match="shape"):
        parse_shapes(text)


def test_mha_flops_counts_projections_and_attention():
    # 4 projections of [B*S, d] x [d, d] at 2 FLOPs per MAC, plus QK^T and PV at 2·B·S²·d each.
    assert mha_flops(8, 128, 512) == 4 * 2 * 8 * 128 * 512**2 + 2 * 2 * 8 * 128**2 * 512


@pytest.fixture(scope="module")
def tiny_backends(tmp_path_factory):
    torch.manual_seed(0)
    mha = MultiHeadAttention(TEST_D_MODEL, TEST_HEADS).eval()
    workdir = tmp_path_factory.mktemp("bench")
    return default_backends(mha, Signature(), threads=1, provider="cpu", workdir=workdir)


def test_bench_compares_every_path(tiny_backends):
    report = run_bench(tiny_backends, ((2, 16), (1, 33)), TEST_D_MODEL, TEST_HEADS, 1, "cpu", budget_s=0.05)
    names = [r.backend for r in report.rows[: len(tiny_backends)]]
    assert names == ["torch eager", "torch SDPA", "ORT none", "ORT mha", "ORT onnx", "ORT mha int8",
                     "ORT mha causal", "ORT onnx causal"]
    assert len(report.rows) == 2 * len(tiny_backends) and report.gemm_gflops > 0
    for row in report.rows:
        assert row.median_ms > 0 and row.p90_ms >= row.median_ms and row.gflops > 0
    eager = [r for r in report.rows if r.backend == "torch eager"]
    assert all(r.vs_torch_eager == 1.0 for r in eager)
    int8 = [r for r in report.rows if r.backend == "ORT mha int8"]
    assert all(0 < r.rel_err < 0.05 for r in int8), "int8 error is measured against torch at each shape"
    assert all(r.rel_err is None for r in report.rows if "int8" not in r.backend)
    assert "GFLOP/s" in report.table()


def test_memory_probe_sees_the_attention_matrix(tiny_backends):
    """Unfused, the scores [1, heads, 2048, 2048] fp32 (64 MiB at 4 heads) must show up in the run's peak."""
    unfused = next(b for b in tiny_backends if b.name == "ORT none")
    small = measure_peak_rss(unfused.path, unfused.name, 1, 64, threads=1, arena=False)
    large = measure_peak_rss(unfused.path, unfused.name, 1, 2048, threads=1, arena=False)
    assert large.run_mb - small.run_mb > 60


def test_cli_bench_json_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(main, [
        "bench", "--d-model", str(TEST_D_MODEL), "--heads", str(TEST_HEADS), "--shapes", "1x8", "--budget-s",
        "0.02", "--threads", "1", "--memory-shapes", "", "--json", "--plot", str(plot),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {r["backend"] for r in report["rows"]} >= {"torch eager", "ORT mha", "ORT onnx"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
