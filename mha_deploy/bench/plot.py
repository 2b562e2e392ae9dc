"""Latency vs sequence length per backend, log axes, as a PNG.

Shapes sharing a sequence length (e.g. 8x64 and 1x64) would share an x position:
pass shapes with distinct lengths, as the default set has.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from mha_deploy.atomic import atomic_path
from mha_deploy.bench.suite import BenchReport
from mha_deploy.errors import MHADeployError


def plot_latency(report: BenchReport, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise MHADeployError("--plot needs matplotlib: pip install 'mha-deploy[bench]'") from None
    series: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    for row in report.rows:
        series[row.backend].append((row.seq, row.median_ms, f"{row.batch}x{row.seq}"))
    fig, ax = plt.subplots(figsize=(8, 5))
    for backend, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=backend)
    labels = sorted({(p[0], p[2]) for points in series.values() for p in points})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([n for n, _ in labels], [label for _, label in labels])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (labels: batch x seq)")
    ax.set_ylabel("median latency (ms)")
    ax.set_title(f"MHA d_model {report.d_model}, {report.heads} heads, {report.threads} threads, {report.provider}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
