"""Timing a callable the way latency is reported: warm-up, then median and p90 of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p90_ms: float
    runs: int


def time_calls(fn: Callable[[], object], warmup: int = 2, min_runs: int = 5, max_runs: int = 50,
               budget_s: float = 2.0) -> Timing:
    """Call ``fn`` ``warmup`` times, then at least ``min_runs`` and at most ``max_runs`` times within ``budget_s``."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_runs and (len(samples) < min_runs or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    ms = np.array(samples) * 1e3
    return Timing(float(np.median(ms)), float(np.percentile(ms, 90)), len(samples))


def mha_flops(batch: int, seq: int, d_model: int) -> float:
    """FLOPs of one self-attention MHA: 4 projections (8·B·S·d²) + QK^T and PV (4·B·S²·d)."""
    return 8.0 * batch * seq * d_model**2 + 4.0 * batch * seq**2 * d_model
