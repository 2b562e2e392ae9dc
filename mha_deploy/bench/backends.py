"""The deployment paths a bench compares, each as ``prepare(batch, seq) -> run()`` for one shape."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mha_deploy.exporters import export_mha
from mha_deploy.exporters.graphs import attention_graph, build_attention_mask
from mha_deploy.exporters.parity import ParityCase, make_inputs
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention
from mha_deploy.runtime import MHASession

Runner = Callable[[], np.ndarray]  # runs one shape once, returns the output [batch, seq, d_model]


@dataclass
class Backend:
    name: str
    prepare: Callable[[int, int], Runner]  # (batch, seq) -> a call that runs that shape once
    # Not exact by design (int8): the bench reports its relative error vs torch at each shape.
    approximate: bool = False
    # The ONNX file, for ORT backends (memory is probed on it in a fresh process).
    path: Path | None = None


def _inputs(batch: int, seq: int, d_model: int, signature: Signature) -> dict[str, np.ndarray]:
    """Self-attention inputs of one shape, every position real (no padding to skew the timing)."""
    return make_inputs(signature, d_model, ParityCase(batch, seq, seq, "none"))


def torch_eager(mha: MultiHeadAttention, signature: Signature) -> Backend:
    module = attention_graph(mha, signature)

    def prepare(batch: int, seq: int) -> Runner:
        args = [torch.from_numpy(a) for a in _inputs(batch, seq, mha.d_model, signature).values()]

        def run():
            with torch.inference_mode():
                out = module(*args)
            return (out[0] if isinstance(out, tuple) else out).numpy()

        return run

    return Backend("torch eager", prepare)


def torch_sdpa(mha: MultiHeadAttention, signature: Signature) -> Backend:
    """The same weights through F.scaled_dot_product_attention (torch's fused kernels)."""

    def prepare(batch: int, seq: int) -> Runner:
        feeds = _inputs(batch, seq, mha.d_model, signature)
        x = torch.from_numpy(feeds["x"])
        padding = torch.from_numpy(feeds["key_padding_mask"]) if "key_padding_mask" in feeds else None
        mask = build_attention_mask(padding, seq, seq, causal=False)

        def run():
            with torch.inference_mode():
                q, k, v = (mha.split_heads(proj(x)) for proj in (mha.W_q, mha.W_k, mha.W_v))
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=signature.is_causal and mask is None,
                    scale=1 / math.sqrt(mha.d_k),
                )
                return mha.W_o(mha.merge_heads(context)).numpy()

        return run

    return Backend("torch SDPA", prepare)


def ort_exported(
    mha: MultiHeadAttention, signature: Signature, fuse: str, threads: int, provider: str, workdir: Path,
    quantize: str = "none", label: str | None = None,
) -> Backend:
    path = workdir / f"{fuse}-{quantize}-{signature.mask}.onnx"
    # fp16 is what one deploys on CUDA; on the CPU it measured no faster than fp32 (README).
    dtype = "fp16" if provider == "cuda" else "fp32"
    export_mha(mha, path, signature, fuse=fuse, quantize=quantize, dtype=dtype)
    backend = ort_file(path, threads, provider, label or f"ORT {fuse}" + (f" {quantize}" if quantize != "none" else ""))
    backend.approximate = quantize != "none"
    return backend


def ort_file(path: Path, threads: int, provider: str, label: str) -> Backend:
    session = MHASession(path, provider=provider, threads=threads)

    def prepare(batch: int, seq: int) -> Runner:
        feeds = _inputs(batch, seq, session.metadata.d_model, session.signature)
        dtype = np.dtype(session.metadata.dtype)
        feeds = {name: a.astype(dtype) if a.dtype.kind == "f" else a for name, a in feeds.items()}
        return lambda: session.run(feeds)["output"].astype(np.float32)

    return Backend(label, prepare, path=Path(path))


def default_backends(mha: MultiHeadAttention, signature: Signature, threads: int, provider: str,
                     workdir: str | Path | None = None) -> list[Backend]:
    """torch eager and SDPA, ORT unfused, ORT fused per target, ORT int8 (CPU), and causal when unmasked."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="mha-bench-"))
    ort_paths = [("none", "none"), ("mha", "none"), ("onnx", "none")]
    if provider != "cuda":
        ort_paths.append(("mha", "int8"))
    backends = [torch_eager(mha, signature), torch_sdpa(mha, signature)]
    backends += [ort_exported(mha, signature, f, threads, provider, workdir, q) for f, q in ort_paths]
    if signature.mask == "none":
        causal = Signature(signature.attention, "causal")
        backends += [
            ort_exported(mha, causal, f, threads, provider, workdir, label=f"ORT {f} causal") for f in ("mha", "onnx")
        ]
    return backends
