"""``mha-deploy bench``: latency, GFLOP/s and efficiency of every deployment path, in one run.

Needs the ``export`` extra (torch is one of the backends compared).
"""

from mha_deploy.bench.suite import BenchReport, BenchRow, parse_shapes, run_bench

__all__ = ["BenchReport", "BenchRow", "parse_shapes", "run_bench"]
