"""torch -> ONNX with dynamic batch and sequence axes."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import onnx
import torch
from torch.export import Dim

from mha_deploy.errors import ExportError
from mha_deploy.metadata import Signature

# Tracing sizes: all >= 2 and pairwise different, so that torch.export cannot
# specialise a dynamic axis to a constant or unify two axes that are independent.
TRACE_BATCH, TRACE_Q_LEN, TRACE_KV_LEN = 2, 3, 5
DEFAULT_OPSET = 23
# ORT 1.31 rejects IR version 14; 10 is what it accepts for opset 23.
MAX_IR_VERSION = 10


def sample_inputs(signature: Signature, d_model: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    kv_len = TRACE_Q_LEN if signature.attention == "self" else TRACE_KV_LEN
    q = torch.randn(TRACE_BATCH, TRACE_Q_LEN, d_model, generator=gen)
    if signature.attention == "self":
        inputs = [q]
    else:
        kv = torch.randn(TRACE_BATCH, kv_len, d_model, generator=gen)
        inputs = [q, kv, kv.clone()]
    if signature.has_padding_mask:
        inputs.append(torch.ones(TRACE_BATCH, kv_len, dtype=torch.bool))
    return tuple(inputs)


def dynamic_shapes(signature: Signature) -> tuple[dict[int, Dim], ...]:
    batch = Dim("batch")
    if signature.attention == "self":
        seq = Dim("seq")
        shapes = [{0: batch, 1: seq}]
        kv = seq
    else:
        q_seq, kv = Dim("q_seq"), Dim("kv_seq")
        shapes = [{0: batch, 1: q_seq}, {0: batch, 1: kv}, {0: batch, 1: kv}]
    if signature.has_padding_mask:
        shapes.append({0: batch, 1: kv})
    return tuple(shapes)


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx.export talks a lot (progress lines, torchvision notices); keep stdout for our report."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def export_onnx(
    module: torch.nn.Module, signature: Signature, d_model: int, opset: int = DEFAULT_OPSET
) -> onnx.ModelProto:
    """Export ``module`` (an eval-mode graph from ``attention_graph``) to an in-memory ONNX model."""
    return export_traced(
        module,
        sample_inputs(signature, d_model),
        dynamic_shapes(signature),
        signature.input_names,
        signature.output_names,
        opset,
    )


def export_traced(
    module: torch.nn.Module, args: tuple, shapes: tuple, input_names, output_names, opset: int = DEFAULT_OPSET
) -> onnx.ModelProto:
    """torch.onnx.export (dynamo) of ``module`` traced on ``args``, quietly, with an IR version ORT accepts."""
    if opset < 18:
        raise ExportError(f"opset {opset} is too old: torch's ONNX exporter needs opset >= 18")
    try:
        with _quiet_exporter(), torch.no_grad():
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                dynamic_shapes=shapes,
                input_names=list(input_names),
                output_names=list(output_names),
                opset_version=opset,
                verbose=False,
            )
    except Exception as exc:  # the exporter raises many unrelated types
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    model = program.model_proto
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model
