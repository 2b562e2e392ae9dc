"""The deployment paths a bench compares, each as ``prepare(feeds) -> run()`` for one set of inputs.

Every backend takes the bench's float32 inputs (from ``mha_deploy.inputs``) and
converts them, untimed, to its own device and dtype; ``run()`` returns the
output [batch, q_len, d_model] as float32 numpy, which the suite compares with
the torch reference.
"""

from __future__ import annotations

import copy
import math
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mha_deploy.bench.target import CPU_FP32, BenchTarget
from mha_deploy.errors import ExportError, OptionError
from mha_deploy.exporters import export_mha
from mha_deploy.exporters.graphs import attention_graph, build_attention_mask
from mha_deploy.exporters.own_model import flatten_outputs
from mha_deploy.inputs import cast_floats
from mha_deploy.metadata import Signature
from mha_deploy.models import MultiHeadAttention
from mha_deploy.runtime import MHASession

Feeds = Mapping[str, np.ndarray]
Runner = Callable[[], np.ndarray]  # runs one set of inputs once, returns the output [batch, q_len, d_model]
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Backend:
    name: str
    prepare: Callable[[Feeds], Runner]  # the bench's float32 inputs -> a call that runs them once
    # Which parity tolerance its error is judged by: "fp32", "fp16" or "int8-dynamic" (a relative budget).
    precision: str = "fp32"
    # The inputs it takes; None: whatever the mode's signature says.
    signature: Signature | None = None
    # The ONNX file, for ORT backends (memory is probed on it in a fresh process).
    path: Path | None = None


def _on_target(mha: MultiHeadAttention, target: BenchTarget) -> MultiHeadAttention:
    """A copy of ``mha`` on the target's device and dtype (the exports keep using the fp32 CPU original)."""
    return copy.deepcopy(mha).to(device=target.torch_device, dtype=TORCH_DTYPES[target.dtype]).eval()


def _host_inputs(feeds: Feeds, signature: Signature, target: BenchTarget) -> list[np.ndarray]:
    """The signature's inputs in order, float ones in the target's dtype, still on the host."""
    cast = cast_floats(feeds, target.numpy_dtype)
    return [cast[name] for name in signature.input_names]


def _to_device(arrays: list[np.ndarray], target: BenchTarget) -> list[torch.Tensor]:
    # Timed, like ORT's copy of its feeds: every row starts from host arrays and ends with one.
    return [torch.from_numpy(a).to(target.torch_device) for a in arrays]


def _numpy(output: torch.Tensor) -> np.ndarray:
    # .cpu() waits for a GPU to finish, as ORT's copy of its output back to the host does.
    return output.float().cpu().numpy()


def torch_eager(mha: MultiHeadAttention, signature: Signature, target: BenchTarget = CPU_FP32) -> Backend:
    """The reference module itself on the target's device, always in fp32.

    The reference fills masked scores with -1e9, which fp16 cannot hold (torch
    refuses the masked_fill), so on an fp16 target it stays what users run: fp32.
    """
    target = replace(target, dtype="fp32")
    module = attention_graph(_on_target(mha, target), signature)

    def prepare(feeds: Feeds) -> Runner:
        arrays = _host_inputs(feeds, signature, target)

        def run():
            with torch.inference_mode():
                out = module(*_to_device(arrays, target))
            return _numpy(out[0] if isinstance(out, tuple) else out)

        return run

    return Backend("torch eager", prepare, target.dtype, signature)


def sdpa_mask(
    signature: Signature, key_padding_mask: torch.Tensor | None, q_len: int, kv_len: int
) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for F.scaled_dot_product_attention computing the reference's masking.

    Causal alone uses SDPA's own causal path (it can skip masked blocks). SDPA
    refuses attn_mask together with is_causal, so padding-causal folds both into
    one bool mask, [batch, 1, q_len, kv_len], True = attend, as the reference builds it.
    """
    if key_padding_mask is None:
        return None, signature.is_causal
    mask = build_attention_mask(key_padding_mask, q_len, kv_len, signature.is_causal, key_padding_mask.device)
    return mask, False


def torch_sdpa(mha: MultiHeadAttention, signature: Signature, target: BenchTarget = CPU_FP32) -> Backend:
    """The same weights through F.scaled_dot_product_attention (torch's fused kernels), in the target's dtype."""
    mha = _on_target(mha, target)
    names = signature.input_names

    def attend(*args: torch.Tensor) -> torch.Tensor:
        inputs = dict(zip(names, args, strict=True))
        query = inputs[signature.query_input]
        key, value = (query, query) if signature.attention == "self" else (inputs["key"], inputs["value"])
        padding = next((inputs[name] for name in signature.padding_masks), None)
        mask, is_causal = sdpa_mask(signature, padding, query.shape[1], key.shape[1])
        # [batch, seq, d_model] -> [batch, heads, seq, d_k]
        q, k, v = (mha.split_heads(proj(x)) for proj, x in ((mha.W_q, query), (mha.W_k, key), (mha.W_v, value)))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 scale=1 / math.sqrt(mha.d_k))
        return mha.W_o(mha.merge_heads(context))

    def prepare(feeds: Feeds) -> Runner:
        arrays = _host_inputs(feeds, signature, target)

        def run():
            with torch.inference_mode():
                return _numpy(attend(*_to_device(arrays, target)))

        return run

    return Backend("torch SDPA", prepare, target.dtype, signature)


def torch_module(module: torch.nn.Module, signature: Signature, name: str) -> Backend:
    """A user's own module in torch eager on the CPU, fed the signature's inputs in order as they come
    (int64 ids, bool masks, float32 sequences); its first output is the row's output."""

    def prepare(feeds: Feeds) -> Runner:
        arrays = [feeds[input_name] for input_name in signature.input_names]

        def run():
            with torch.inference_mode():
                out = module(*(torch.from_numpy(a) for a in arrays))
            return _numpy(flatten_outputs(out)[0])

        return run

    return Backend(name, prepare, "fp32", signature)


def ort_file(path: str | Path, target: BenchTarget, threads: int, label: str) -> Backend:
    """An exported file run by ``MHASession`` on the target's provider, fed in the file's own dtype."""
    session = MHASession(path, provider=target.provider, threads=threads)
    metadata = session.metadata

    first = metadata.signature.output_names[0]  # "output", or a user's model's first output

    def prepare(feeds: Feeds) -> Runner:
        cast = cast_floats(feeds, metadata.dtype)
        # copy=False: an fp32 output is returned as it is; a copy would add the same time to every row (a whole
        # logits tensor's) and pull their ratios towards 1
        return lambda: session.run(cast)[first].astype(np.float32, copy=False)

    if metadata.quantization != "none":
        precision = metadata.quantization
    else:
        precision = "fp16" if metadata.dtype == "float16" else "fp32"
    return Backend(label, prepare, precision, metadata.signature, Path(path))


def ort_exported(
    mha: MultiHeadAttention, signature: Signature, target: BenchTarget, threads: int, workdir: Path, fuse: str,
    quantize: str = "none",
) -> Backend:
    """``export_mha`` with ``fuse`` (and ``quantize``) in the target's dtype, then run from the file."""
    path = Path(workdir) / f"{fuse}-{quantize}-{target.dtype}-{signature.mask}.onnx"
    export_mha(mha, path, signature, fuse=fuse, quantize=quantize, dtype=target.dtype)
    return ort_file(path, target, threads, f"ORT {fuse}" + (f" {quantize}" if quantize != "none" else ""))


def ort_packed(
    mha: MultiHeadAttention, signature: Signature, target: BenchTarget, threads: int, workdir: Path
) -> Backend:
    """Self-attention fused into packed-QKV contrib ``Attention``; ``ExportError`` when the rules do not get there.

    Not an export target (it measured no faster than ``mha``), so no parity check
    at export: the bench's error column is its check.
    """
    from mha_deploy.exporters.export import set_metadata, write_model_atomically
    from mha_deploy.exporters.fusion import fuse_attention
    from mha_deploy.exporters.precision import to_float16
    from mha_deploy.exporters.torch_export import export_onnx
    from mha_deploy.metadata import ModelMetadata

    plain = export_onnx(attention_graph(mha.eval(), signature), signature, mha.d_model)
    model, report = fuse_attention(plain, "mha", packed_qkv=True)
    if not report.complete or {op.op_type for op in report.ops} != {"com.microsoft.Attention"}:
        raise ExportError(f"mask {signature.mask}: no packed-QKV Attention ({report.summary()})")
    if target.dtype == "fp16":
        model = to_float16(model)
    metadata = ModelMetadata(mha.d_model, mha.num_heads, signature, dtype=target.numpy_dtype, fusion="mha")
    set_metadata(model, metadata)
    path = Path(workdir) / f"packed-{target.dtype}-{signature.mask}.onnx"
    write_model_atomically(model, path)
    return ort_file(path, target, threads, "ORT packed Attention")


def openvino_file(path: str | Path, signature: Signature, threads: int, label: str = "OpenVINO") -> Backend:
    """An ONNX file compiled by OpenVINO for its CPU plugin, in fp32 (the optional 'openvino' extra).

    OpenVINO's CPU plugin defaults to bf16 inference on CPUs with bf16 units
    (this host reports ``INFERENCE_PRECISION_HINT`` bfloat16), which would time a
    different computation: the hint is pinned to f32, and the error column checks it.
    """
    try:
        import openvino
    except ImportError as exc:
        message = f"the OpenVINO row needs the 'openvino' extra: pip install 'mha-deploy[openvino]' ({exc})"
        raise OptionError(message) from None
    core = openvino.Core()
    compiled = core.compile_model(
        str(path), "CPU", {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    )
    output = compiled.output("output")

    def prepare(feeds: Feeds) -> Runner:
        request = compiled.create_infer_request()
        inputs = {name: feeds[name] for name in signature.input_names}
        return lambda: np.asarray(request.infer(inputs)[output], dtype=np.float32)

    return Backend(label, prepare, "fp32", signature, None)


def openvino_available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


BackendFactory = Callable[[Signature], list[Backend]]


def default_backends(
    mha: MultiHeadAttention, signature: Signature, target: BenchTarget = CPU_FP32, threads: int = 2,
    workdir: str | Path | None = None, packed_qkv: bool = False, openvino: bool = False,
) -> list[Backend]:
    """torch eager (the ratios' baseline) and SDPA, ORT unfused and fused per target, int8-dynamic on CPU fp32.

    ``packed_qkv`` adds the packed-QKV contrib ``Attention`` when its rules fuse this signature;
    ``openvino`` adds OpenVINO on the unfused graph (CPU fp32 only).
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="mha-bench-"))
    ort_paths = [("none", "none"), ("mha", "none"), ("onnx", "none")]
    if target.provider == "cpu" and target.dtype == "fp32":
        ort_paths.append(("mha", "int8-dynamic"))  # dynamic int8 projections: CPU fp32 models only
    backends = [torch_eager(mha, signature, target), torch_sdpa(mha, signature, target)]
    ort = [ort_exported(mha, signature, target, threads, workdir, f, q) for f, q in ort_paths]
    backends += ort
    if openvino and target.provider == "cpu" and target.dtype == "fp32":
        # OpenVINO compiles the unfused graph (ort_paths[0]; its own fusions replace ours): what many pick for CPU.
        backends.append(openvino_file(ort[0].path, signature, threads))
    if packed_qkv:
        try:
            backends.append(ort_packed(mha, signature, target, threads, workdir))
        except ExportError as exc:
            warnings.warn(f"bench: packed-QKV row skipped: {exc}", stacklevel=2)
    return backends
