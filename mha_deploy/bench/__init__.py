"""``mha-deploy bench``: latency, GFLOP/s, efficiency and error against torch of every deployment path, in one run.

Needs the ``export`` extra (torch is one of the backends compared, and the reference). The names below are
imported when first used, so that ``mha_deploy.bench.timing`` (the quiet gate, the load average) and the other
torch-free modules serve a benchmark's measuring process without torch's few hundred MB in it.
"""

from __future__ import annotations

from importlib import import_module

# name -> the module that defines it
_HOMES = {
    "Backend": "backends", "default_backends": "backends",
    "DEFAULT_MASK_MODES": "cases", "MaskMode": "cases", "parse_mask_modes": "cases", "parse_shapes": "cases",
    "parse_sizes": "cases",
    "BenchReport": "suite", "BenchRow": "suite", "run_bench": "suite", "run_model_bench": "suite",
    "settings_from_file": "suite",
    "BenchTarget": "target", "resolve_target": "target",
    "QuietGate": "timing",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
