"""One bench run: every backend at every shape, with the machine's GEMM rate as the yardstick."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from mha_deploy.bench.backends import Backend
from mha_deploy.bench.gemm import peak_gemm_gflops
from mha_deploy.bench.memory import MemoryRow, measure_peak_rss
from mha_deploy.bench.timing import mha_flops, time_calls
from mha_deploy.errors import MHADeployError

DEFAULT_SHAPES = ((8, 128), (1, 1024), (32, 64), (1, 4096))
DEFAULT_MEMORY_SHAPES = ((1, 4096), (32, 512))


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'8x128,1x1024' -> ((8, 128), (1, 1024))."""
    shapes = []
    for part in text.split(","):
        try:
            batch, seq = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise MHADeployError(f"shape {part!r} is not BATCHxSEQ (e.g. 8x128)") from None
        if batch < 1 or seq < 1:
            raise MHADeployError(f"shape {part!r} must have batch and seq >= 1")
        shapes.append((batch, seq))
    return tuple(shapes)


@dataclass
class BenchRow:
    backend: str
    batch: int
    seq: int
    median_ms: float
    p90_ms: float
    gflops: float
    vs_torch_eager: float  # torch eager median / this median: > 1 is faster
    efficiency: float  # gflops / the run's ORT MatMul rate
    rel_err: float | None = None


@dataclass
class BenchReport:
    d_model: int
    heads: int
    threads: int
    provider: str
    gemm_gflops: float  # the best ORT fp32 MatMul rate of the run
    gemm_size: int  # ... reached at gemm_size³
    rows: list[BenchRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"d_model {self.d_model}, {self.heads} heads, {self.threads} threads, provider {self.provider}; "
            f"ORT fp32 MatMul peak {self.gemm_gflops:.0f} GFLOP/s (at {self.gemm_size}^3; efficiency = GFLOP/s / this)",
            f"{'shape':>8}  {'backend':<20} {'median ms':>10} {'p90 ms':>9} {'GFLOP/s':>8} "
            f"{'vs eager':>8} {'effic.':>7}  note",
        ]
        for r in self.rows:
            note = f"rel err {r.rel_err:.2%}" if r.rel_err is not None else ""
            lines.append(
                f"{r.batch}x{r.seq:<6}  {r.backend:<20} {r.median_ms:10.2f} {r.p90_ms:9.2f} {r.gflops:8.0f} "
                f"{r.vs_torch_eager:7.2f}x {r.efficiency:7.0%}  {note}"
            )
        if self.memory:
            lines.append("")
            lines.append(f"{'shape':>8}  {'backend':<20} {'peak RSS MB':>11} {'run MB':>8} {'no-arena run MB':>16}")
            by_key = {(m.backend, m.batch, m.seq, m.arena): m for m in self.memory}
            for m in self.memory:
                if m.arena:
                    plain = by_key.get((m.backend, m.batch, m.seq, False))
                    lines.append(
                        f"{m.batch}x{m.seq:<6}  {m.backend:<20} {m.peak_rss_mb:11.0f} {m.run_mb:8.0f} "
                        f"{plain.run_mb if plain else float('nan'):16.0f}"
                    )
        return "\n".join(lines)


def measure_memory(report: BenchReport, backends: list[Backend], shapes, threads: int) -> None:
    """Peak RSS of each ORT backend at each shape, with ORT's CPU arena on and off."""
    for batch, seq in shapes:
        for backend in backends:
            if backend.path is not None:
                for arena in (True, False):
                    report.memory.append(measure_peak_rss(backend.path, backend.name, batch, seq, threads, arena))


def _relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(output - reference) / np.linalg.norm(reference))


def run_bench(
    backends: list[Backend], shapes, d_model: int, heads: int, threads: int, provider: str,
    budget_s: float = 2.0, on_row=None,
) -> BenchReport:
    """Time every backend at every shape (the first backend is the ratios' baseline)."""
    torch.set_num_threads(threads)
    report = BenchReport(d_model, heads, threads, provider, *peak_gemm_gflops(threads))
    for batch, seq in shapes:
        baseline_ms = reference = None
        flops = mha_flops(batch, seq, d_model)
        for backend in backends:
            run = backend.prepare(batch, seq)
            output = run()
            reference = output if reference is None else reference
            timing = time_calls(run, budget_s=budget_s)
            baseline_ms = baseline_ms or timing.median_ms
            gflops = flops / (timing.median_ms * 1e-3) / 1e9
            rel_err = _relative_error(output, reference) if backend.approximate else None
            row = BenchRow(
                backend.name, batch, seq, timing.median_ms, timing.p90_ms, gflops,
                baseline_ms / timing.median_ms, gflops / report.gemm_gflops, rel_err,
            )
            report.rows.append(row)
            if on_row:
                on_row(row)
    return report
