"""The decode bench runs end to end at tiny sizes and reports every figure (no timing is asserted)."""

from __future__ import annotations

import math

import torch

from mha_deploy.bench.decode import STEP_LABELS, run_decode_bench
from mha_deploy.models import MultiHeadAttention
from tests.conftest import TEST_D_MODEL, TEST_HEADS


def test_decode_bench_reports_every_figure(tmp_path):
    torch.manual_seed(0)
    report = run_decode_bench(
        MultiHeadAttention(TEST_D_MODEL, TEST_HEADS), contexts=(8, 16), batches=(1, 2), prefill_seqs=(16,),
        rss_steps=20, rss_context=8, threads=1, budget_s=0.01, workdir=tmp_path,
    )
    assert [(row.context, row.batch) for row in report.steps] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    assert all(set(row.ms) == set(STEP_LABELS) and min(row.ms.values()) > 0 for row in report.steps)
    assert set(report.prefill) == {(1, 16)}
    assert {kind: len(samples) for kind, samples in report.rss_mb.items()} == {
        "preallocated cache": 11, "ORT-allocated cache": 11
    }
    assert all(not math.isnan(mb) for samples in report.rss_mb.values() for mb in samples)
    text = report.table()
    assert "recompute/step" in text and "prefill" in text and "growth" in text
    assert not report.verdicts() or "target" in report.verdicts()[0]


def test_the_bench_packages_timing_helpers_come_without_torch():
    """A benchmark's measuring process imports mha_deploy.bench's quiet gate and load line: torch (a few hundred MB
    of resident memory) must not come with them, or every peak RSS it reports carries torch's."""
    import subprocess
    import sys

    code = ("import sys\nfrom mha_deploy.bench import QuietGate\nfrom mha_deploy.bench.timing import load_line\n"
            "import mha_deploy.bench as bench\nassert 'run_bench' in dir(bench)\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
