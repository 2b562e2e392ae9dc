"""scripts/gpu-check.sh where there is no GPU (here, and CI): one clear line, exit 0, nothing set up or written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"
NO_GPU = "gpu-check: no GPU here"


def run(tmp_path: Path, nvidia_smi: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "NVIDIA_SMI": nvidia_smi, "GPU_CHECK_OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("driver", ["missing", "no devices"])
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, driver):
    # Never the real nvidia-smi: on a GPU runner that would start the whole check.
    smi = tmp_path / "nvidia-smi"
    if driver == "no devices":  # a driver without a device answers like this, with a non-zero status
        smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
        smi.chmod(0o755)
    result = run(tmp_path, str(smi))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(NO_GPU) and result.stdout.count("\n") == 1, result.stdout
    assert not (tmp_path / "out").exists()


def test_the_kernel_census_compiles():
    """scripts/cuda_kernels.py runs only on a GPU host: here, at least its code and its child's must parse."""
    source = SCRIPT.with_name("cuda_kernels.py")
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # defines, runs nothing (__name__ differs)
    compile(namespace["_CHILD"], "cuda_kernels child", "exec")
