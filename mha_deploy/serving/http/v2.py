"""The Open Inference Protocol (KServe v2), without a transport: what REST and gRPC share.

- ``server_metadata`` / ``model_metadata``: the documents both transports answer,
  every tensor described from the model's ``Signature`` (-1 for dynamic axes).
- ``check_declared`` and ``array_from_bytes`` / ``array_from_list``: one input
  tensor as a request declares it (name, datatype, shape) and its data, checked
  before anything is allocated from the declared shape.
- ``plan_request`` and ``run_plan``: a request carries a batch ([batch, seq,
  d_model] plus the key_padding_mask a padding model requires, as MHASession and
  Triton's config do). Its feeds are checked by the
  runtime's validator, and each row is cut to its real tokens and checked as an
  item. When every mask row is right padding (or the model has no mask), the rows go
  to the micro-batcher as items, so requests from different clients share ORT
  runs, and come back padded to the request's shape. Any other padding (left or
  mixed) runs as the request's own batch with its own mask, exactly as
  ``MHASession.run`` would run it: the planner only re-pads on the right.
  Either way, positions the mask marks as padding are zeros in every output.

Errors are ``RequestError``s: 400 for anything wrong with the request, 503 when
the server cannot take it now.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mha_deploy import __version__
from mha_deploy.batch.base import Item, Result
from mha_deploy.errors import InputError
from mha_deploy.inputs import right_padding_mask
from mha_deploy.metadata import ModelMetadata
from mha_deploy.runtime.validation import (
    item_problem,
    padding_by_axis,
    shape_problem,
    validate_inputs,
    zero_padding,
)
from mha_deploy.serving.http.batcher import MicroBatcher
from mha_deploy.serving.http.parsing import RequestError, holds_json_boolean
from mha_deploy.signature import BATCH_AXIS, PADDING_MASK, TensorSpec

SERVER_NAME = "mha-deploy"
MODEL_VERSION = "1"
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ("binary_tensor_data",)
# numpy dtype name -> protocol datatype, for the element types an exported model's tensors have.
DATATYPES = {"float32": "FP32", "float16": "FP16", "bool": "BOOL", "int64": "INT64"}


def bad_request(kind: str, message: str) -> RequestError:
    return RequestError(400, kind, message)


def server_metadata() -> dict:
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def datatype(spec: TensorSpec, metadata: ModelMetadata) -> str:
    return DATATYPES[spec.numpy_dtype(metadata.dtype)]


def tensor_shape(spec: TensorSpec, metadata: ModelMetadata) -> list[int]:
    """The tensor's shape with -1 for every dynamic axis."""
    return list(spec.dims(metadata.fixed_sizes))


def model_metadata(name: str, metadata: ModelMetadata) -> dict:
    def describe(spec: TensorSpec) -> dict:
        return {"name": spec.name, "datatype": datatype(spec, metadata), "shape": tensor_shape(spec, metadata)}

    signature = metadata.signature
    return {
        "name": name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [describe(spec) for spec in signature.inputs],
        "outputs": [describe(spec) for spec in signature.outputs],
    }


# --- one input tensor ----------------------------------------------------------------------------


def check_declared(
    metadata: ModelMetadata, name: object, dtype_name: object, shape: object, max_item_tokens: int
) -> np.dtype:
    """The numpy dtype of an input declared as (name, datatype, shape), or a 400 saying what is wrong."""
    specs = {spec.name: spec for spec in metadata.signature.inputs}
    if not isinstance(name, str) or name not in specs:
        raise bad_request("unknown_input", f"unknown input {name!r}: this model takes {', '.join(specs)}")
    spec = specs[name]
    expected = datatype(spec, metadata)
    if spec.role == PADDING_MASK and dtype_name == "BOOL" and expected == "INT64":
        expected = "BOOL"  # True/False means what 1/0 does: a client of a bool-mask file keeps working (validated)
    if dtype_name != expected:
        raise bad_request("wrong_datatype", f"input {name} has datatype {dtype_name!r}, this model takes {expected}")
    if not isinstance(shape, list | tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad_request("bad_shape", f"input {name}: shape must be a list of non-negative integers, got {shape!r}")
    dims = tensor_shape(spec, metadata)
    if len(shape) != len(dims):
        raise bad_request("wrong_shape", f"input {name} has shape {list(shape)}, this model takes {dims} (-1: any)")
    if shape[0] == 0:
        raise bad_request("empty_batch", f"input {name} has an empty batch: shape {list(shape)}")
    if name in metadata.signature.item_inputs:  # a length input's item, or an image's or audio input's sizes
        problem = shape_problem(metadata, name, tuple(shape[1:]), max_item_tokens)
        if problem:
            raise bad_request(problem.kind, f"input {problem.message} (shape {list(shape)}, expected {dims})")
    elif any(d != -1 and n != d for n, d in zip(shape, dims, strict=True)):
        raise bad_request("wrong_shape", f"input {name} has shape {list(shape)}, this model takes {dims} (-1: any)")
    return np.dtype(bool) if expected == "BOOL" else np.dtype(spec.numpy_dtype(metadata.dtype))


def array_from_bytes(name: str, dtype: np.dtype, shape: list[int], raw: bytes | memoryview) -> np.ndarray:
    """Raw little-endian, row-major tensor data (the binary extension, gRPC's raw contents)."""
    needed = math.prod(shape) * dtype.itemsize
    if len(raw) != needed:
        raise bad_request(
            "wrong_data_size", f"input {name}: {len(raw)} bytes of data, shape {list(shape)} needs {needed}"
        )
    if dtype == np.bool_:
        # One byte per element, 0 or 1: any other byte would be a bool numpy cannot negate correctly.
        flags = np.frombuffer(raw, dtype=np.uint8)
        if flags.size and flags.max() > 1:
            raise bad_request("not_boolean", f"input {name}: BOOL data must be bytes 0 or 1")
        return flags.view(np.bool_).reshape(shape)
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype, copy=False)


def array_from_list(name: str, dtype: np.dtype, shape: list[int], data: object) -> np.ndarray:
    """JSON tensor data: a flat (row-major) or nested list."""
    if not isinstance(data, list):
        raise bad_request("bad_data", f"input {name}: data must be a list, got {type(data).__name__}")
    try:
        array = np.asarray(data)
    except (ValueError, TypeError):  # ragged, or nested beyond numpy's 64 dimensions
        raise bad_request("bad_data", f"input {name}: data is ragged or nested too deeply") from None
    if array.size != math.prod(shape):
        raise bad_request("wrong_data_size", f"input {name}: {array.size} values, shape {list(shape)} needs "
                                             f"{math.prod(shape)}")
    # JSON true/false for BOOL only; numbers (not booleans, strings or null) for the rest.
    # Integer tensors (token ids) take integers only: 1.5 would otherwise be truncated to an id.
    wanted = "b" if dtype == np.bool_ else "iu" if dtype.kind in "iu" else "fiu"
    if array.size and wanted != "b" and holds_json_boolean(data):
        raise bad_request("bad_data", f"input {name}: data holds true/false, expected "
                                      f"{'integers' if wanted == 'iu' else 'numbers'}")
    if array.size and array.dtype.kind not in wanted:
        what = "true/false" if dtype == np.bool_ else "integers" if wanted == "iu" else "numbers"
        raise bad_request("bad_data", f"input {name}: data holds {array.dtype.kind!r}-kind values, expected {what}")
    with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype's range becomes inf, refused later
        return array.astype(dtype).reshape(shape)


def check_outputs(metadata: ModelMetadata, requested: list[str] | None) -> list[str]:
    """The outputs to return, in the request's order (all of them when it names none)."""
    names = metadata.signature.output_names
    if requested is None:
        return list(names)
    for name in requested:
        if name not in names:
            raise bad_request("unknown_output", f"unknown output {name!r}: this model returns {', '.join(names)}")
    return list(dict.fromkeys(requested))


# --- a batch request through the micro-batcher ---------------------------------------------------


@dataclass
class RequestPlan:
    """A checked request: its feeds, one item per row (real tokens only), and how to run it."""

    feeds: dict[str, np.ndarray]
    items: list[Item]
    masks: dict[str, np.ndarray]  # length axis -> [batch, length] bool, True = real
    right_padded: bool


def plan_request(metadata: ModelMetadata, inputs: Mapping[str, np.ndarray], max_item_tokens: int) -> RequestPlan:
    signature = metadata.signature
    try:
        feeds = validate_inputs(metadata, inputs)
    except InputError as exc:
        raise bad_request("invalid_input", str(exc)) from None
    masks = padding_by_axis(signature, feeds)
    lengths = {axis: mask.sum(axis=1) for axis, mask in masks.items()}
    # Items get one mask per axis when batched: masks of one axis that differ keep the request's own batch.
    right_padded = all(
        np.array_equal(mask, right_padding_mask(lengths[axis], mask.shape[1])) for axis, mask in masks.items()
    ) and all(np.array_equal(feeds[name], masks[signature.axis_of(name)]) for name in signature.padding_masks)
    items = []
    for row in range(feeds[signature.query_input].shape[0]):
        item = {}
        for name in signature.sequence_inputs:
            axis = signature.axis_of(name)
            if axis not in masks:
                item[name] = feeds[name][row]
            elif right_padded:
                item[name] = feeds[name][row, : lengths[axis][row]]
            else:
                item[name] = feeds[name][row, masks[axis][row]]
        for name in signature.fixed_shape_inputs:  # images, audio: nothing to cut
            item[name] = feeds[name][row]
        problem = item_problem(metadata, item, max_item_tokens)
        if problem:
            raise bad_request(problem.kind, f"row {row}: {problem.message}")
        items.append(item)
    return RequestPlan(feeds, items, masks, right_padded)


async def run_plan(plan: RequestPlan, batcher: MicroBatcher, metadata: ModelMetadata) -> dict[str, np.ndarray]:
    """Every output, shaped as the request's batch, zero at padded positions."""
    signature = metadata.signature
    if signature.batch_outputs:
        # An output spanning the batch (CLIP's logits_per_image) is the request's own batch's: it runs as given, in
        # one run, never cut by the token budget nor batched with another client's items (which would mix theirs
        # into it).
        outputs = await batcher.run_formed(plan.feeds)
        return {spec.name: outputs[spec.name] if spec.spans_batch
                else zero_padding(outputs[spec.name], spec, plan.masks) for spec in signature.outputs}
    if plan.right_padded:
        results = await batcher.submit_many(plan.items)
        return {spec.name: _assemble(spec, results, plan, metadata) for spec in signature.outputs}
    # Left or mixed padding: the request's own batch (in runs of whole rows within the batcher's token budget);
    # validate_inputs zeroed its padded positions, so whatever the client put there cannot reach a real one.
    feeds = plan.feeds
    rows = feeds[signature.query_input].shape[0]
    longest = max(array.shape[1] for name, array in feeds.items() if name in signature.sequence_inputs)
    step = max(1, batcher.max_batch_tokens // longest)
    runs = [{name: array[start : start + step] for name, array in feeds.items()} for start in range(0, rows, step)]
    outputs = await asyncio.gather(*(batcher.run_formed(run) for run in runs))
    return {
        spec.name: zero_padding(np.concatenate([out[spec.name] for out in outputs]), spec, plan.masks, in_place=True)
        for spec in signature.outputs
    }


def _assemble(spec: TensorSpec, results: list[Result], plan: RequestPlan, metadata: ModelMetadata) -> np.ndarray:
    """Per-row results (real lengths) placed at the start of each row of a zero tensor of the request's shape."""
    signature = metadata.signature
    sizes = {**metadata.fixed_sizes, BATCH_AXIS: len(results)}
    for name in signature.sequence_inputs:
        sizes[signature.axis_of(name)] = plan.feeds[name].shape[1]
    out = np.zeros(spec.shape(sizes), dtype=results[0][spec.name].dtype)
    for row, result in enumerate(results):
        value = result[spec.name]
        out[(row, *(slice(0, n) for n in value.shape))] = value
    return out
