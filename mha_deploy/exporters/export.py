"""``export_mha``: reference module in, checked ONNX file out (or nothing at all)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from mha_deploy.atomic import atomic_path
from mha_deploy.errors import ExportError, ParityError
from mha_deploy.exporters.graphs import attention_graph
from mha_deploy.exporters.parity import DEFAULT_ATOL, DEFAULT_RTOL, ParityCase, check_parity
from mha_deploy.exporters.torch_export import DEFAULT_OPSET, export_onnx
from mha_deploy.metadata import METADATA_KEY, ModelMetadata, ParityReport, Signature
from mha_deploy.models.attention import MultiHeadAttention
from mha_deploy.serving.session import MHASession

_RECORDED_PACKAGES = ("mha-deploy", "torch", "onnx", "onnxscript", "onnxruntime-gpu", "onnxruntime")


@dataclass
class ExportResult:
    path: Path
    metadata: ModelMetadata
    parity: ParityReport


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _RECORDED_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def set_metadata(model: onnx.ModelProto, metadata: ModelMetadata) -> None:
    for prop in list(model.metadata_props):
        if prop.key == METADATA_KEY:
            model.metadata_props.remove(prop)
    model.metadata_props.add(key=METADATA_KEY, value=metadata.to_json())


def write_model_atomically(model: onnx.ModelProto, path: Path) -> None:
    with atomic_path(path) as tmp:
        onnx.save_model(model, tmp)


def export_mha(
    mha: MultiHeadAttention,
    output: str | os.PathLike,
    signature: Signature | None = None,
    opset: int = DEFAULT_OPSET,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    parity_cases: tuple[ParityCase, ...] | None = None,
) -> ExportResult:
    """Export ``mha`` for ``signature``, check parity against torch, and write ``output``.

    Raises ``ParityError`` (and writes nothing) when ORT and torch disagree
    beyond ``atol + rtol * |reference|`` on any real query position.
    """
    signature = signature or Signature()
    output = Path(output)
    if output.suffix != ".onnx":
        raise ExportError(f"output path must end in .onnx, got {output}")
    if output.is_dir():
        raise ExportError(f"output path {output} is a directory")
    module = attention_graph(mha.eval(), signature)
    model = export_onnx(module, signature, mha.d_model, opset)
    metadata = ModelMetadata(
        d_model=mha.d_model,
        num_heads=mha.num_heads,
        signature=signature,
        opset=opset,
        versions=package_versions(),
    )
    set_metadata(model, metadata)
    # Parity runs on the in-memory model on the CPU provider, which every
    # machine has, so that a failed check never leaves a file behind.
    session = MHASession(model.SerializeToString(), provider="cpu")
    report = check_parity(module, session, parity_cases, atol=atol, rtol=rtol)
    if not report.passed:
        raise ParityError(f"{report.summary()}; failures: {'; '.join(report.failures[:5])}; nothing written")
    metadata.parity = report
    set_metadata(model, metadata)
    write_model_atomically(model, output)
    return ExportResult(output, metadata, report)
