"""Time per token of every backend, one panel per mask mode, as a PNG.

The shapes of a bench mix batch sizes (8x128, 1x1024, 32x64, ...), so no one
axis is "sequence length": each panel groups bars by shape, labelled
``batch x seq``, and shows microseconds per token (median latency / (batch · seq)),
which puts shapes of different sizes on one scale. Lower is faster.
"""

from __future__ import annotations

import math
from pathlib import Path

from mha_deploy.atomic import atomic_path
from mha_deploy.bench.suite import BenchReport
from mha_deploy.errors import MHADeployError


def plot_latency(report: BenchReport, path: str | Path) -> None:
    """Write ``latency_figure(report)`` to ``path`` as a PNG (atomically)."""
    plt = _pyplot()
    fig = latency_figure(report)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _labelled_log_limits(values) -> tuple[float, float]:
    """The 1-2-5 steps just outside the data, at least one step apart.

    Autoscaled limits follow the timings, and bars that all fall between two steps (say 5.5 to 9.5 µs)
    leave a panel with one labelled tick or none; limits on the steps always show two.
    """
    positive = [value for value in values if value > 0]
    if not positive:
        return 1.0, 10.0
    steps = [mantissa * 10.0**exponent
             for exponent in range(math.floor(math.log10(min(positive))) - 1, math.ceil(math.log10(max(positive))) + 2)
             for mantissa in (1.0, 2.0, 5.0)]
    low = max(step for step in steps if step <= min(positive))
    high = min(step for step in steps if step >= max(positive))
    if high <= low:
        high = min(step for step in steps if step > low)
    return low, high


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise MHADeployError("--plot needs matplotlib: pip install 'mha-deploy[bench]'") from None
    return plt


def latency_figure(report: BenchReport):
    """One panel per mask mode, bars grouped by shape; the default export's bars hatched and outlined."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    modes = list(dict.fromkeys(row.mask for row in report.rows))
    backends = list(dict.fromkeys(row.backend for row in report.rows))
    shapes = list(dict.fromkeys((row.batch, row.seq) for row in report.rows))
    us_per_token = {(r.mask, r.backend, r.batch, r.seq): r.median_ms * 1e3 / (r.batch * r.seq) for r in report.rows}
    colors = plt.get_cmap("tab10")
    width = 0.8 / max(1, len(backends))
    height = 3.0 * len(modes) + 0.7  # inches: the panels, and a strip on top for the title and legend
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(max(7.0, 1.4 * len(shapes) + 3), height), sharey=True, squeeze=False
    )
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        default = report.default_export.get(mode)
        for index, backend in enumerate(backends):
            positions, heights = [], []
            for slot, (batch, seq) in enumerate(shapes):
                value = us_per_token.get((mode, backend, batch, seq))
                if value is not None:
                    positions.append(slot + (index - (len(backends) - 1) / 2) * width)
                    heights.append(value)
            marked = {"hatch": "//", "edgecolor": "black", "linewidth": 1.0} if backend == default else {}
            ax.bar(positions, heights, width, label=backend, color=colors(index % 10), **marked)
        ax.set_yscale("log")
        # Labelled ticks at 1, 2 and 5 of every decade, as plain numbers: a bench's bars often span less
        # than a decade, where the default log axis labels no tick at all (or only as 10^k).
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(*_labelled_log_limits(us_per_token.values()))
        ax.set_xticks(range(len(shapes)), [f"{batch}x{seq}" for batch, seq in shapes])
        title = f"mask {mode}" + (f"; hatched: {default}, the default export (--fuse auto)" if default else "")
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel("µs per token")
        ax.grid(True, axis="y", which="major", alpha=0.3)
    axes[-1, 0].set_xlabel("shape (batch x seq)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(
        f"MHA d_model {report.d_model}, {report.heads} heads, {report.threads} threads, {report.provider} "
        f"{report.dtype}: median time per token (lower is faster)",
        fontsize=10, x=0.01, y=1 - 0.08 / height, ha="left", va="top",
    )
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.01, 1 - 0.32 / height), fontsize=8,
               ncol=min(4, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.7 / height))
    return fig
