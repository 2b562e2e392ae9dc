"""torch -> ONNX with dynamic batch and sequence axes."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import warnings

import onnx
import torch
from torch.export import Dim

from mha_deploy.errors import ExportError
from mha_deploy.onnx_nodes import all_nodes
from mha_deploy.signature import ENCODER_PAST_AXIS, ID_ROLES, PADDING_MASK, TOTAL_AXIS, Signature, TensorSpec

# Tracing sizes: all >= 2 and pairwise different, so that torch.export cannot
# specialise a dynamic axis to a constant or unify two axes that are independent.
# (A KV-cache decoder's memory gets its own: its cache length is past_seq, not memory's.)
TRACE_BATCH, TRACE_Q_LEN, TRACE_KV_LEN, TRACE_MEM_LEN = 2, 3, 5, 7
DEFAULT_OPSET = 23
# ORT 1.31 rejects IR version 14; 10 is what it accepts for opset 23.
MAX_IR_VERSION = 10


def sample_inputs(signature: Signature, d_model: int, heads: int = 1) -> tuple[torch.Tensor, ...]:
    """Tracing inputs, one per input of the signature, at the tracing sizes (a KV cache of TRACE_KV_LEN)."""
    gen = torch.Generator().manual_seed(0)
    mem_len = TRACE_MEM_LEN if signature.kv_cache else None
    sizes = signature.axis_sizes(TRACE_BATCH, TRACE_Q_LEN, TRACE_KV_LEN, mem_len, d_model=d_model, heads=heads)
    return tuple(_sample(spec, spec.shape(sizes), gen) for spec in signature.inputs)


def _sample(spec: TensorSpec, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if spec.role == PADDING_MASK:
        return torch.ones(shape, dtype=torch.bool)
    if spec.role in ID_ROLES:
        return torch.randint(0, spec.vocab or 2, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def dynamic_shapes(signature: Signature) -> tuple[dict[int, Dim], ...]:
    """One ``Dim`` per named axis of the signature, shared by every input that has that axis."""
    # total_seq is past_seq + seq, a sum torch.export cannot declare: AUTO lets it derive the relation. A
    # decoder's cross-attention cache is memory-long where the graph reads it: AUTO lets torch.export see so.
    dims: dict[str, Dim] = {TOTAL_AXIS: Dim.AUTO, ENCODER_PAST_AXIS: Dim.AUTO}
    return tuple(
        {index: dims.setdefault(axis, Dim(axis)) for index, axis in spec.dynamic_axes.items()}
        for spec in signature.inputs
    )


def name_dynamic_axes(model: onnx.ModelProto, signature: Signature) -> None:
    """Give every dynamic axis of the graph's inputs and outputs its Signature name (the exporter names a
    derived axis by its expression, e.g. ``past_seq + seq``, or ``s46``), so that inspect and Triton agree."""
    specs = signature.tensors
    renamed: dict[str, set[str]] = {}
    for value in (*model.graph.input, *model.graph.output):
        spec = specs.get(value.name)
        if spec is None:
            continue
        for index, axis in spec.dynamic_axes.items():
            dim = value.type.tensor_type.shape.dim[index]
            if dim.dim_param:
                renamed.setdefault(dim.dim_param, set()).add(axis)
            dim.dim_param = axis
    # The values inside carry the exporter's symbols too (``s21``): the fusion rules match an op's dims against
    # the inputs' (a padding mask is [batch, seq]), so each symbol that became one axis is renamed there as well.
    renamed = {symbol: axes.pop() for symbol, axes in renamed.items() if len(axes) == 1 and symbol.isidentifier()}
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renamed:
                dim.dim_param = renamed[dim.dim_param]


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx.export talks a lot (progress lines, torchvision notices, failed graphs); keep stdout for our
    report and stderr for our errors."""
    # torch.fx's symbolic shapes log the whole FX graph (hundreds of lines) before a data-dependent guard fails.
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        # stderr too: torch.export prints the partial FX graph of a failed trace there (hundreds of lines) before
        # raising the error that says what failed.
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def not_dynamic(signature: Signature, axis: str, why: str) -> ExportError:
    """The one-line error for a module whose graph does not hold for every size of a dynamic ``axis``."""
    inputs = ", ".join(spec.name for spec in signature.inputs if axis in spec.axes)
    return ExportError(f"the module does not trace with a dynamic {axis!r} axis (inputs {inputs}): {why}")


def _check_dynamic(program, signature: Signature, max_length: int | None = None) -> None:
    """Refuse a graph that holds only for some sizes of an axis declared dynamic.

    When strict capture fails, torch.onnx.export falls back to capture strategies that accept the module's
    guards: a Python branch on a length (``if x.size(1) > 4``) then leaves a graph valid up to 4 only,
    recorded as a bounded range of that axis's symbol. A range that reaches ``max_length`` is no loss: the file
    refuses longer sequences anyway (CLIP's text model checks its length against its 77 positions; M2M100 rebuilds its
    sinusoidal table past its size).
    """
    exported = getattr(program, "exported_program", None)
    if exported is None:
        return
    bounded = {str(symbol): (r.lower, r.upper) for symbol, r in exported.range_constraints.items()
               if not str(r.upper).endswith("oo")}
    placeholders = [node for node in exported.graph.nodes if node.op == "placeholder" and "val" in node.meta]
    user_inputs = placeholders[-len(signature.inputs):]
    for spec, node in zip(signature.inputs, user_inputs, strict=False):
        for position, axis in spec.dynamic_axes.items():
            size = node.meta["val"].shape[position] if position < node.meta["val"].dim() else None
            if isinstance(size, int) and axis not in (TOTAL_AXIS, ENCODER_PAST_AXIS):
                # Specialised outright (the AUTO axes may be derived): e.g. a Python loop over the length.
                raise not_dynamic(
                    signature, axis,
                    f"the traced graph holds only for {axis} = {size}, the length it was traced at; its code fixes "
                    "that size (a Python loop over it, a view or shape built from it as a number): compute it "
                    "with tensor ops",
                )
            symbol = str(size) if size is not None else None
            if symbol in bounded:
                low, high = bounded[symbol]
                if max_length is not None and high >= max_length:
                    continue
                raise not_dynamic(
                    signature, axis,
                    f"the traced graph holds only for {axis} in {low}..{high}; its code decides something on that "
                    f"size (e.g. `if x.size(1) > {high}`), which a graph cannot: compute it with tensor ops, or, if "
                    f"the module takes no longer sequence, say so with --max-length {high}"
                    + ("" if max_length is None else f" (the max length now is {max_length})"),
                )



def list_torchlib_ops_once() -> None:
    """torch.onnx.export builds its op registry afresh on every call, and most of that (0.8-1.8 s here, a tenth of
    a small model's export) is onnxscript parsing the source of every torchlib function for its signature: the same
    list on every call in one process, while a ``--kv-cache`` export traces two or three times and an
    encoder-decoder pair more. The list is made once per process; the registry is still built from it per export
    (what an export registers stays its own), and the graphs are the same. Another torch's layout: each export
    lists them, as before."""
    try:
        from torch.onnx._internal import _lazy_import

        apis = importlib.import_module(_lazy_import.onnxscript_apis._name)  # the module torch's registry asks
        listing = apis.get_torchlib_ops
    except (ImportError, AttributeError):
        return
    if getattr(listing, "listed_once", False):
        return
    cached = functools.cache(listing)

    def listed_once():
        return list(cached())

    listed_once.listed_once = True
    apis.get_torchlib_ops = listed_once


def export_onnx(
    module: torch.nn.Module,
    signature: Signature,
    d_model: int,
    opset: int = DEFAULT_OPSET,
    heads: int = 1,
    output_names: tuple[str, ...] | None = None,
    plain_rotary: bool = False,
    max_length: int | None = None,
) -> onnx.ModelProto:
    """torch.onnx.export (dynamo) of ``module``, an eval-mode graph whose forward takes ``signature``'s
    inputs in order, traced at the tracing sizes, quietly, with an IR version ORT accepts.

    ``output_names``: what the outputs are called when they are not ``signature``'s (a KV-cache model's
    prefill: its cache-free signature's output, then the present caches). A module whose forward takes
    its trailing inputs as ``*args`` says from which input on with ``variadic_from``.
    ``plain_rotary``: where the graph at ``opset`` holds ONNX RotaryEmbedding, translate the same trace again at
    ``ROTARY_OPSET`` (see ``writes_onnx_rotary``; the returned model's opset says which was written).
    ``max_length``: the longest sequence the module takes (recorded in the file, longer ones refused): a graph that
    holds for every length up to it is accepted, as a guard in the module's code on its position table's size.
    """
    if opset < 18:
        raise ExportError(f"opset {opset} is too old: torch's ONNX exporter needs opset >= 18")
    shapes = dynamic_shapes(signature)
    variadic_from = getattr(module, "variadic_from", None)
    if variadic_from is not None:
        # torch.export matches dynamic_shapes to forward's parameters: *args takes one tuple.
        shapes = (*shapes[:variadic_from], shapes[variadic_from:])
    names = {"input_names": list(signature.input_names), "output_names": list(output_names or signature.output_names)}
    samples = sample_inputs(signature, d_model, heads)
    list_torchlib_ops_once()
    try:
        with _quiet_exporter(), torch.no_grad():
            program = torch.onnx.export(module, samples, dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                                        verbose=False, **names)
    except Exception as exc:  # the exporter raises many unrelated types
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    _check_dynamic(program, signature, max_length)
    model = program.model_proto
    if plain_rotary and opset > ROTARY_OPSET and writes_onnx_rotary(model):
        # The trace (torch.export) is most of an export's time; translating the program it made again at the older
        # opset keeps its dynamic dims and costs about half a fresh export.
        try:
            with _quiet_exporter(), torch.no_grad():
                program = torch.onnx.export(program.exported_program, samples, dynamo=True, opset_version=ROTARY_OPSET,
                                            verbose=False, **names)
        except Exception as exc:
            raise ExportError(f"torch.onnx.export at opset {ROTARY_OPSET} failed: {type(exc).__name__}: {exc}") from exc
        model = program.model_proto
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    if signature.kv_cache or signature.model == "custom":
        name_dynamic_axes(model, signature)
    return model


# The newest opset at which torch writes a rotary embedding as plain ops (Sin, Cos, Mul, Concat): from opset 23 it
# writes ONNX RotaryEmbedding with cos/sin of one row, [1, seq, d/2], which ONNX Runtime 1.31's kernel rejects for an
# input of more rows ("Inputs 'cos_cache' and 'sin_cache' are expected to have the same shape as input 'x'").
ROTARY_OPSET = 22


def writes_onnx_rotary(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds the standard RotaryEmbedding op (in its graph or its local functions)."""
    nodes = [*all_nodes(model.graph), *(node for function in model.functions for node in function.node)]
    return any(node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx") for node in nodes)
