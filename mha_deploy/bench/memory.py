"""Peak memory of one inference, measured in a fresh process so that earlier runs cannot inflate it.

The probe knows the model only through its file: it reads the mha-deploy
metadata (signature, d_model, dtype) and draws its inputs from the one data
loader, so self- and cross-attention, padding masks and fp16 models all work.
It runs on the bench's provider; on CUDA the figure is the host's RSS only.
A torch module is probed the same way (``measure_module_peak_rss``): rebuilt in
the fresh process from its factory and checkpoint, fed what the probe of its
exported file is fed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mha_deploy.errors import MHADeployError
from mha_deploy.metadata import ModelMetadata

# What both probes share: the peak reading, and the bench's inputs from a model's metadata. torch-free
# (mha_deploy.inputs, metadata and runtime.providers import numpy and onnxruntime only), so that the ORT
# probe's process holds no torch.
_COMMON = textwrap.dedent("""
    import json, resource, sys
    from mha_deploy.inputs import InputCase, make_inputs

    def peak_kb():
        # VmHWM belongs to this address space; ru_maxrss would carry the parent's peak across fork+exec.
        try:
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def bench_feeds(metadata, batch, seq, padded_pct):
        # The bench's inputs (MaskMode.inputs: every key real, or the last padded_pct of them padded) in the
        # model's dtype, built here without importing mha_deploy.bench, which imports torch.
        signature = metadata.signature
        feeds = make_inputs(signature, metadata.d_model, InputCase(batch, seq, seq, "none"), dtype=metadata.dtype)
        for name in signature.padding_masks:
            length = feeds[name].shape[1]
            feeds[name][:, max(1, length - round(length * padded_pct / 100)):] = False
            feeds[name] = feeds[name].astype(signature.tensors[name].dtype)  # ORT as is: bool, or int64 1/0
        return feeds

    def report(before, after, signature, padded_pct):
        label = f"{signature.mask}-{padded_pct:g}%" if padded_pct else signature.mask
        print(json.dumps({"before_kb": before, "peak_kb": after, "mask": label}))
""")

_PROBE = _COMMON + textwrap.dedent("""
    import onnxruntime as ort
    from mha_deploy.metadata import ModelMetadata
    from mha_deploy.runtime.providers import check_providers, plan_providers

    path, provider = sys.argv[1], sys.argv[2]
    batch, seq, threads, arena = map(int, sys.argv[3:7])
    padded_pct = float(sys.argv[7])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = bool(arena)
    plan = plan_providers(provider)
    session = ort.InferenceSession(path, options, providers=plan.session_providers())
    check_providers(plan, session)
    metadata = ModelMetadata.from_props(session.get_modelmeta().custom_metadata_map, path)
    feeds = bench_feeds(metadata, batch, seq, padded_pct)
    before = peak_kb()
    session.run(None, feeds)
    report(before, peak_kb(), metadata.signature, padded_pct)
""")

# A torch module in the same process layout: built by FACTORY(**kwargs) from a Python file, its weights
# loaded strictly from a checkpoint (weights_only for torch files), run once on the inputs its exported
# file's metadata describes, so that torch and ORT rows see the same feeds.
_TORCH_PROBE = _COMMON + textwrap.dedent("""
    import importlib.util
    import torch
    from mha_deploy.metadata import ModelMetadata
    from mha_deploy.models.checkpoint import read_state_dict

    factory, kwargs, checkpoint, metadata_json = sys.argv[1:5]
    batch, seq, threads = map(int, sys.argv[5:8])
    padded_pct = float(sys.argv[8])
    torch.set_num_threads(threads)
    file, _, name = factory.rpartition(":")
    spec = importlib.util.spec_from_file_location("_mha_deploy_memory_probe", file)
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    module = getattr(source, name)(**json.loads(kwargs)).eval()
    # Kept alive to the end: memory freed before the mark could be reused by the run without raising the peak.
    state, _ = read_state_dict(checkpoint)
    module.load_state_dict(state, strict=True)
    metadata = ModelMetadata.from_json(metadata_json, factory)
    feeds = bench_feeds(metadata, batch, seq, padded_pct)
    args = [torch.from_numpy(feeds[name]) for name in metadata.signature.input_names]
    before = peak_kb()
    with torch.inference_mode():
        module(*args)
    report(before, peak_kb(), metadata.signature, padded_pct)
""")


@dataclass
class MemoryRow:
    backend: str
    mask: str
    batch: int
    seq: int
    arena: bool
    peak_rss_mb: float  # whole process, model and inputs included
    run_mb: float  # growth of the peak during the one run: what inference itself allocated


def measure_peak_rss(
    path: Path, backend: str, batch: int, seq: int, threads: int, arena: bool, provider: str = "cpu",
    padded_pct: float = 0.0,
) -> MemoryRow:
    """Peak RSS of loading a model file and running it once at (batch, seq), in a subprocess on ``provider``,
    with the last ``padded_pct`` percent of the keys padded (padding masks only)."""
    args = [str(path), provider, str(batch), str(seq), str(threads), str(int(arena)), str(padded_pct)]
    return _run_probe(_PROBE, args, backend, batch, seq, arena)


def measure_module_peak_rss(
    factory: str, kwargs: dict, checkpoint: Path, metadata: ModelMetadata, backend: str, batch: int, seq: int,
    threads: int, padded_pct: float = 0.0,
) -> MemoryRow:
    """Peak RSS of running a torch module once at (batch, seq) on the CPU, in a subprocess, on the inputs that
    ``measure_peak_rss`` gives the exported file of ``metadata``.

    ``factory`` is ``FILE.py:FACTORY``: ``FACTORY(**kwargs)`` builds the module in the fresh process, and
    ``checkpoint`` (safetensors, or a torch file read with ``weights_only``) holds its weights.
    """
    args = [factory, json.dumps(kwargs), str(checkpoint), metadata.to_json(), str(batch), str(seq), str(threads),
            str(padded_pct)]
    return _run_probe(_TORCH_PROBE, args, backend, batch, seq, arena=False)


def _run_probe(probe: str, args: list[str], backend: str, batch: int, seq: int, arena: bool) -> MemoryRow:
    result = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise MHADeployError(f"memory probe failed for {backend} at {batch}x{seq}: {result.stderr.strip()[-500:]}")
    probe_out = json.loads(result.stdout.strip().splitlines()[-1])
    peak_mb, before_mb = probe_out["peak_kb"] / 1024, probe_out["before_kb"] / 1024
    return MemoryRow(backend, probe_out["mask"], batch, seq, arena, peak_mb, peak_mb - before_mb)
