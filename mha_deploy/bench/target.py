"""Where and in which precision every row of a bench runs: one device for torch, ORT and the GEMM yardstick."""

from __future__ import annotations

from dataclasses import dataclass

from mha_deploy.errors import OptionError, ProviderUnavailableError
from mha_deploy.metadata import DTYPES, PROVIDER_CHOICES


@dataclass(frozen=True)
class BenchTarget:
    """ORT's provider, torch's device and the dtype of every model, input and the GEMM yardstick.

    On CUDA everything runs in fp16, what one deploys there; on the CPU in fp32
    (fp16 runs on ORT's CPU provider too, no faster: a CPU fp16 target exists to
    test the CUDA path's dtype handling on machines without a GPU).
    """

    provider: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "fp32"  # "fp32" or "fp16"
    # Why the target is not what was asked for (``auto`` without a usable GPU).
    note: str = ""

    def __post_init__(self):
        if self.provider not in ("cpu", "cuda"):
            raise OptionError(f"bench provider must be cpu or cuda, got {self.provider!r}")
        if self.dtype not in DTYPES:
            raise OptionError(f"bench dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_device(self) -> str:
        return self.provider

    @property
    def numpy_dtype(self) -> str:
        return DTYPES[self.dtype]


# The default: what ``--provider cpu`` benches.
CPU_FP32 = BenchTarget("cpu", "fp32")


def _torch_cuda_reason() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA: install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch sees no usable CUDA device"
    return None


def resolve_target(provider: str) -> BenchTarget:
    """The target for ``--provider``: refuses ``cuda`` up front, before any export, if ORT or torch cannot use it.

    The bench compares torch and ORT on one device, so CUDA needs both ORT's CUDA
    provider and a CUDA build of torch; ``auto`` falls back to the CPU, with a note where a GPU exists.
    """
    from mha_deploy.runtime.providers import cpu_fallback_note, cuda_unavailable_reason

    if provider not in PROVIDER_CHOICES:
        raise OptionError(f"provider must be one of {', '.join(PROVIDER_CHOICES)}, got {provider!r}")
    if provider == "cpu":
        return CPU_FP32
    reason = cuda_unavailable_reason() or _torch_cuda_reason()
    if reason is None:
        return BenchTarget("cuda", "fp16")
    if provider == "cuda":
        raise ProviderUnavailableError(
            f"bench --provider cuda runs torch and ONNX Runtime on the GPU, but {reason}; use --provider cpu"
        )
    return BenchTarget("cpu", "fp32", note=cpu_fallback_note(reason))
