"""``mha-deploy bench``: latency, GFLOP/s, efficiency and error against torch of every deployment path, in one run.

Needs the ``export`` extra (torch is one of the backends compared, and the reference).
"""

from mha_deploy.bench.backends import Backend, default_backends
from mha_deploy.bench.cases import DEFAULT_MASK_MODES, MaskMode, parse_mask_modes, parse_shapes, parse_sizes
from mha_deploy.bench.suite import BenchReport, BenchRow, run_bench, run_model_bench, settings_from_file
from mha_deploy.bench.target import BenchTarget, resolve_target
from mha_deploy.bench.timing import QuietGate

__all__ = [
    "DEFAULT_MASK_MODES", "Backend", "BenchReport", "BenchRow", "BenchTarget", "MaskMode", "QuietGate",
    "default_backends", "parse_mask_modes", "parse_shapes", "parse_sizes", "resolve_target", "run_bench",
    "run_model_bench", "settings_from_file",
]
