"""Timing callables the way latency is reported: blocks of calls over several passes, median and p90.

Block timing, not single interleaved calls: ORT's intra-op threads spin for a
while after a run and would steal the cores from the next backend's call. Several
passes over every backend: load from other processes then hits all of them alike.
``QuietGate`` can also hold each block until the rest of the machine is idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

# Per label and pass: one untimed call, then a block of at least MIN_CALLS and at
# most MAX_CALLS timed calls, more while under its share of the budget.
PASSES, MIN_CALLS, MAX_CALLS = 3, 2, 20


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p90_ms: float
    runs: int
    # The fastest call: other processes only ever slow a call down, so on a shared machine it is the figure
    # they disturb least (but no typical latency).
    best_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        ms = np.array(seconds) * 1e3
        return cls(float(np.median(ms)), float(np.percentile(ms, 90)), len(ms), float(ms.min()))


class QuietGate:
    """Waits, before each timed block, until other processes leave the CPUs alone (Linux ``/proc/stat``).

    torch's OpenMP threads suffer badly from sharing 2 cores (x10 slower when
    another process is busy, ORT x3-4), so a block only starts once the rest of
    the machine used less than ``quiet_fraction`` of the CPUs over a short
    probe, or after ``wait_s``; the blocks that had to start anyway are counted.
    Without ``/proc/stat`` it never waits.
    """

    def __init__(self, wait_s: float = 15.0, total_wait_s: float = 360.0, quiet_fraction: float = 0.1,
                 probe_s: float = 0.3):
        self.wait_s, self.total_wait_s = wait_s, total_wait_s
        self.quiet_fraction, self.probe_s = quiet_fraction, probe_s
        self.blocks = self.noisy = 0
        self.waited_s = 0.0

    @staticmethod
    def others_busy_fraction(interval: float) -> float | None:
        """Fraction of all CPUs that other processes kept busy over ``interval`` seconds (None if unknown)."""

        def busy_and_own():
            try:
                with open("/proc/stat") as stat:
                    fields = [int(v) for v in stat.readline().split()[1:]]
            except OSError:
                return None
            idle = fields[3] + fields[4]  # idle + iowait
            return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time()

        before = busy_and_own()
        time.sleep(interval)
        after = busy_and_own()
        if before is None or after is None:
            return None
        others = (after[0] - before[0]) - (after[1] - before[1])
        return max(0.0, others) / (interval * (os.cpu_count() or 1))

    def wait(self) -> None:
        self.blocks += 1
        started = time.perf_counter()
        budget = min(self.wait_s, max(0.0, self.total_wait_s - self.waited_s))
        try:
            while True:
                fraction = self.others_busy_fraction(self.probe_s)
                if fraction is None or fraction < self.quiet_fraction:
                    return
                if time.perf_counter() - started >= budget:
                    self.noisy += 1
                    return
        finally:
            self.waited_s += time.perf_counter() - started

    def summary(self) -> str:
        return (
            f"{self.noisy} of {self.blocks} timed blocks started while other processes used more than "
            f"{self.quiet_fraction:.0%} of the CPUs (waited {self.waited_s:.0f} s in all for quiet moments)"
        )


def time_blocks(
    calls: Mapping[str, Callable[[], object]], budget_s: float, passes: int = PASSES, gate: QuietGate | None = None,
    min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS,
) -> dict[str, Timing]:
    """label -> timing of ``call()``, over ``passes`` passes of one block per label (``budget_s`` per label in all)."""
    samples: dict[str, list[float]] = {label: [] for label in calls}
    block_s = budget_s / passes
    for _ in range(passes):
        for label, call in calls.items():
            if gate is not None:
                gate.wait()
            call()  # untimed: allocations, kernel selection, the previous backend's threads winding down
            started = time.perf_counter()
            block = samples[label]
            count = 0
            while count < min_calls or (count < max_calls and time.perf_counter() - started < block_s):
                t0 = time.perf_counter()
                call()
                block.append(time.perf_counter() - t0)
                count += 1
    return {label: Timing.of(seconds) for label, seconds in samples.items()}


def time_calls(fn: Callable[[], object], budget_s: float = 2.0, min_calls: int = 5) -> Timing:
    """One callable timed alone: an untimed call, then at least ``min_calls`` calls within ``budget_s``."""
    return time_blocks({"call": fn}, budget_s, passes=1, min_calls=min_calls, max_calls=50)["call"]


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def load_line(before, after, threads: int) -> str:
    """The load averages before and after a run, in the words every bench report ends with."""
    if before is None or after is None:
        return "load average: unknown on this OS"
    text = [" ".join(f"{v:.2f}" for v in load) for load in (before, after)]
    return (f"load average {text[0]} before, {text[1]} after (1/5/15 min; above {threads} means the cores were "
            "shared)")


def mha_flops(batch: int, seq: int, d_model: int) -> float:
    """FLOPs of one self-attention MHA: 4 projections (8·B·S·d²) + QK^T and PV (4·B·S²·d).

    Causal or padded rows count in full: the figure is a unit of work shared by every row, not what a kernel skips.
    """
    return 8.0 * batch * seq * d_model**2 + 4.0 * batch * seq**2 * d_model
