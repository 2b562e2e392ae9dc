"""Choosing an execution provider, and refusing ORT's silent fallback to CPU."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import onnxruntime as ort

from mha_deploy.errors import ProviderUnavailableError
from mha_deploy.metadata import PROVIDER_CHOICES  # re-exported: defined without onnxruntime for the CLI

CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"


@dataclass(frozen=True)
class ProviderPlan:
    requested: str
    ort_providers: tuple[str, ...]
    # Why CUDA was not tried, when it was not.
    note: str = ""


def cuda_unavailable_reason() -> str | None:
    """Why ORT's CUDA provider cannot load here, or None if nothing obvious stops it.

    ORT only logs this and falls back to CPU; loading the provider library
    ourselves surfaces the missing dependency (e.g. libcublasLt.so.13) by name.
    """
    if CUDA_EP not in ort.get_available_providers():
        return (
            f"this onnxruntime build ({ort.__version__}) has no CUDA provider: "
            "install onnxruntime-gpu instead of onnxruntime"
        )
    library = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
    if not os.path.exists(library):
        return None  # not Linux, or a layout we do not know: let ORT try
    try:
        ctypes.CDLL(library)
    except OSError as exc:
        if "cannot open shared object file" in str(exc):
            return f"CUDA libraries are missing ({exc}); onnxruntime-gpu {ort.__version__} needs CUDA 13 and cuDNN 9"
    return None


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
    return ProviderPlan(requested, (CPU_EP,), note=f"using CPU: {reason}")


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
