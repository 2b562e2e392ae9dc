"""Choosing an execution provider, and refusing ORT's silent fallback to CPU."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import io
import os
import shutil
from dataclasses import dataclass

import onnxruntime as ort

from mha_deploy.errors import ProviderUnavailableError
from mha_deploy.metadata import PROVIDER_CHOICES  # re-exported: defined without onnxruntime for the CLI

CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"

# Options of every CUDA session this project creates.
# use_tf32 "0": ORT's CUDA provider defaults to TF32 for fp32 MatMul/GEMM on Ampere
# and newer (provider option ``use_tf32``, default 1: ORT's CUDA-ExecutionProvider
# docs, onnxruntime/core/providers/cuda/cuda_execution_provider_info.h). TF32 keeps
# 10 mantissa bits, so an fp32 model would no longer hold the parity it was exported
# with (atol 1e-4 / rtol 1e-3 against torch fp32; emulating TF32 rounding breaks it
# in most cases). fp32 models are what users pick for accuracy; fp16 models, what
# CUDA deployments run, are unaffected (TF32 concerns fp32 math only).
CUDA_OPTIONS = {"use_tf32": "0"}
# cuDNN 9's library, which ORT's CUDA provider opens only when it first needs it.
CUDNN_LIBRARY = "libcudnn.so.9"


@dataclass(frozen=True)
class ProviderPlan:
    requested: str
    ort_providers: tuple[str, ...]
    # Why CUDA was not tried, when it was not.
    note: str = ""

    def session_providers(self, **cuda_options: str) -> list:
        """The ``providers`` argument of ``InferenceSession``: CUDA with ``CUDA_OPTIONS`` (and these) first."""
        options = {**CUDA_OPTIONS, **cuda_options}
        return [(name, options) if name == CUDA_EP else name for name in self.ort_providers]


@functools.cache
def preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN from the nvidia-* wheels (``onnxruntime-gpu[cuda,cudnn]``), once per process.

    ORT's loader looks only in the system's library paths, so CUDA installed from
    pip is invisible to it (and to the probe below) until ``onnxruntime.preload_dlls``
    (ORT >= 1.21) loads it. It prints what it cannot find on stdout, which may be
    carrying ``--json``: swallowed, since ``cuda_unavailable_reason`` names the
    missing library itself. Older ORT versions lack it: nothing to do then.
    """
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
        preload()


def _missing_library(library: str) -> str | None:
    """The loader's message if ``library`` (or one it needs) cannot be found, else None."""
    try:
        ctypes.CDLL(library)
    except OSError as exc:
        if "cannot open shared object file" in str(exc):
            return str(exc)
    return None


def cuda_unavailable_reason() -> str | None:
    """Why ORT's CUDA provider cannot load here, or None if nothing obvious stops it.

    ORT only logs this and falls back to CPU; loading the provider library
    ourselves surfaces the missing dependency (e.g. libcublasLt.so.13) by name.
    cuDNN is not a link-time dependency of the provider library (ORT opens it when
    a kernel first needs it), so it is looked for by name on its own.
    """
    if CUDA_EP not in ort.get_available_providers():
        return (
            f"this onnxruntime build ({ort.__version__}) has no CUDA provider: "
            "install onnxruntime-gpu instead of onnxruntime"
        )
    library = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
    if not os.path.exists(library):
        return None  # not Linux, or a layout we do not know: let ORT try
    preload_cuda_libraries()
    missing = _missing_library(library)
    if missing:
        return f"CUDA libraries are missing ({missing}); onnxruntime-gpu {ort.__version__} needs CUDA 13 and cuDNN 9"
    missing = _missing_library(CUDNN_LIBRARY)
    if missing:
        return (
            f"cuDNN 9 is missing ({missing}); onnxruntime-gpu {ort.__version__} needs it: "
            "pip install onnxruntime-gpu[cuda,cudnn], or install cuDNN 9 system-wide"
        )
    return None


@functools.cache
def gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU at all: a /dev/nvidia* device, or nvidia-smi on the PATH.

    Where it shows none, ``auto`` means the CPU without a word: a note that CUDA
    libraries are missing would only puzzle a user who has no GPU.
    """
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def plan_providers(requested: str) -> ProviderPlan:
    if requested not in PROVIDER_CHOICES:
        raise ProviderUnavailableError(f"provider must be one of {', '.join(PROVIDER_CHOICES)}, got {requested!r}")
    if requested == "cpu":
        return ProviderPlan(requested, (CPU_EP,))
    reason = cuda_unavailable_reason()
    if reason is None:
        return ProviderPlan(requested, (CUDA_EP, CPU_EP))
    if requested == "cuda":
        raise ProviderUnavailableError(f"provider 'cuda' requested but {reason}")
    return ProviderPlan(requested, (CPU_EP,), note=cpu_fallback_note(reason))


def without_cuda(plan: ProviderPlan, reason: str) -> ProviderPlan:
    """``plan`` for a model CUDA must not run (``reason``): the CPU for ``auto``, an error for ``cuda``."""
    if plan.requested == "cuda":
        raise ProviderUnavailableError(f"provider 'cuda' requested but {reason}")
    return ProviderPlan(plan.requested, (CPU_EP,), note=cpu_fallback_note(reason))


def cpu_fallback_note(reason: str) -> str:
    """What ``auto`` says when it lands on the CPU: why, where a GPU exists; nothing where none does."""
    return f"using CPU: {reason}" if gpu_present() else ""


def check_providers(plan: ProviderPlan, session: ort.InferenceSession) -> str:
    """The provider the session really runs on; raises if CUDA was required and ORT fell back."""
    active = session.get_providers()
    if CUDA_EP in active:
        return "cuda"
    if plan.requested == "cuda":
        raise ProviderUnavailableError(
            "provider 'cuda' requested but ONNX Runtime fell back to CPU "
            "(no usable GPU, or CUDA 13 / cuDNN 9 could not be initialised; ORT's log above says which)"
        )
    return "cpu"
