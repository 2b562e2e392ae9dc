"""Request bodies -> one checked item, or a ``RequestError`` saying what is wrong.

One request is one item: ``x`` [seq, d_model] for self-attention, or
``query`` [q_seq, d_model] with ``key`` and ``value`` [kv_seq, d_model] for
cross-attention. Three body formats:

- ``application/json``: ``{"x": [[...d_model numbers] × seq]}`` (or query/key/value).
- ``application/x-npy``: one ``.npy`` array [seq, d_model]; self-attention only.
- ``application/x-npz``: an ``.npz`` archive with one array per input name
  (``x``, or ``query``/``key``/``value``); the binary form for cross-attention.

Binary arrays may be any float or integer type and are cast to float32. Array
headers are read before any data, so a small compressed .npz that would unpack
to gigabytes is refused without unpacking it.

Nothing here imports starlette: the HTTP layer passes bytes in and gets an item out.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mha_deploy.batch.base import Item
from mha_deploy.errors import InputError
from mha_deploy.metadata import ModelMetadata
from mha_deploy.runtime.validation import in_model_dtype, item_problem, name_problem, shape_problem

try:  # orjson parses a body of floats ~6x faster than the stdlib (part of the 'serve' extra)
    from orjson import loads as _fast_json_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_json_loads = json.loads

JSON, NPY, NPZ = "application/json", "application/x-npy", "application/x-npz"
CONTENT_TYPES = (JSON, NPY, NPZ)


class RequestError(InputError):
    """A request the server refuses: ``status`` is the HTTP code, ``kind`` a stable label for clients and metrics."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message

    def to_json(self) -> dict:
        return {"error": {"kind": self.kind, "message": self.message}}

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers its response carries: when to retry, and closing a connection whose body was not all read."""
        headers = {}
        if self.status == 503:
            headers["Retry-After"] = "1"
        if self.status in (408, 413):
            headers["Connection"] = "close"
        return headers


class FieldError(RequestError):
    """A ``RequestError`` that names the request field at fault (OpenAI's ``param``; the message names it too, for
    the protocols whose errors are a message only)."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(status, kind, message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold."""

    max_body_bytes: int = 64 * 2**20
    # Longest sequence accepted in one request (each of query and key/value for cross-attention).
    max_item_tokens: int = 1024
    # Longest a request body may take to arrive: a slow or stalled upload is cut off with 408 after this.
    body_timeout_s: float = 10.0


def is_decimal(text: str) -> bool:
    """Whether ``text`` is a non-negative integer in ASCII digits (``str.isdigit`` takes "²" and "٣" too)."""
    return text.isascii() and text.isdigit()


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, lower-cased and without parameters (JSON when absent)."""
    if not content_type:
        return JSON
    return content_type.split(";", 1)[0].strip().lower()


def parse_request(body: bytes, content_type: str | None, metadata: ModelMetadata, limits: RequestLimits) -> Item:
    """The item in ``body``: input name -> float32 [seq, d_model], checked against the model and ``limits``."""
    kind = media_type(content_type)
    if kind == JSON:
        arrays = _from_json(body, metadata)
    elif kind == NPY:
        arrays = _from_npy(body, metadata, limits)
    elif kind == NPZ:
        arrays = _from_npz(body, metadata, limits)
    else:
        raise RequestError(
            415, "unsupported_media_type", f"Content-Type {kind!r} is not one of {', '.join(CONTENT_TYPES)}"
        )
    return check_item(arrays, metadata, limits)


def check_item(arrays: dict[str, np.ndarray], metadata: ModelMetadata, limits: RequestLimits) -> Item:
    """One item's arrays cast to the model's dtype and checked by the runtime's validator; problems are 422s."""
    for name in metadata.signature.item_inputs:
        check_shape(name, arrays[name].shape, metadata, limits)
    item = in_model_dtype(metadata, {name: arrays[name] for name in metadata.signature.item_inputs})
    problem = item_problem(metadata, item, limits.max_item_tokens)
    if problem:
        raise RequestError(422, problem.kind, problem.message)
    return item


def check_shape(name: str, shape: tuple[int, ...], metadata: ModelMetadata, limits: RequestLimits) -> None:
    """One input's shape, checked before its data is cast (or, for .npy bodies, even read)."""
    problem = shape_problem(metadata, name, shape, limits.max_item_tokens)
    if problem:
        raise RequestError(422, problem.kind, problem.message)


def _check_names(names: set[str], metadata: ModelMetadata, kind: str) -> None:
    problem = name_problem(names, metadata.signature.item_inputs)
    if problem:
        # {"inputs": [...]} is an Open Inference Protocol body, sent to /v1 by mistake.
        hint = "; a v2 request goes to /v2/models/NAME/infer" if "inputs" in names else ""
        raise RequestError(422, problem.kind, f"{kind} {problem.message}{hint}")


# An integer literal of 20 digits or more: orjson reads one past 64 bits as a float (2**64 + 1 ->
# 1.8446744073709552e+19), which would then be refused or used as a number it is not; the stdlib keeps it exact.
_LONG_DIGITS = re.compile(rb"[0-9]{20}")


def load_json(body: bytes | memoryview, what: str = "body") -> object:
    """Parsed JSON, integers as exact as sent, or a 400 (also for nesting too deep to parse, which must not become a
    500)."""
    if _fast_json_loads is not json.loads and _LONG_DIGITS.search(body) is None:
        try:
            return _fast_json_loads(body)
        except ValueError:
            pass
    # The stdlib parser takes NaN and Infinity (refused later with a clear message) and words errors well.
    try:
        return json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, "malformed_json", f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, "malformed_json", f"{what} is nested too deeply") from None


def _from_json(body: bytes, metadata: ModelMetadata) -> dict[str, np.ndarray]:
    payload = load_json(body)
    if not isinstance(payload, dict):
        raise RequestError(400, "malformed_json", f"body must be a JSON object, got {type(payload).__name__}")
    _check_names(set(payload), metadata, "JSON body:")
    return {name: _json_array(name, payload[name]) for name in metadata.signature.item_inputs}


def _json_array(name: str, value: object) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # numpy >= 1.24 refuses ragged nested lists
        raise RequestError(422, "ragged", f"{name} is ragged: every row must have the same length") from None
    # JSON true/false would become 1/0 and strings like "1.5" would convert: refuse both, and null.
    if array.dtype.kind not in "fiu" or holds_json_boolean(value):
        kind = "b" if array.dtype.kind in "fiu" else array.dtype.kind  # true among numbers: numpy made it 1
        what = {"b": "booleans", "U": "strings", "O": "null or non-numbers"}.get(kind, str(array.dtype))
        raise RequestError(422, "not_numeric", f"{name} holds {what}: expected rows of numbers")
    return array


def holds_json_boolean(data: object) -> bool:
    """Whether parsed JSON ``data`` (a list, nested or not) holds true or false anywhere: among numbers numpy
    reads them as 1 and 0, so a token id ``true`` would silently become id 1."""
    pending = [data] if isinstance(data, list) else []
    while pending:
        items = pending.pop()
        kinds = set(map(type, items))
        if bool in kinds:
            return True
        if list in kinds:
            pending.extend(item for item in items if type(item) is list)
    return False


def _from_npy(body: bytes, metadata: ModelMetadata, limits: RequestLimits) -> dict[str, np.ndarray]:
    names = metadata.signature.item_inputs
    if len(names) != 1:
        raise RequestError(
            415,
            "unsupported_media_type",
            f"{NPY} carries one array; this model takes {', '.join(names)}: send them as {NPZ}",
        )
    return {names[0]: _read_npy(io.BytesIO(body), names[0], metadata, limits)}


def _from_npz(body: bytes, metadata: ModelMetadata, limits: RequestLimits) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        names = [m for m in archive.namelist() if m.endswith(".npy")]
    except (zipfile.BadZipFile, ValueError) as exc:
        raise RequestError(400, "malformed_npz", f"body is not an .npz archive: {exc}") from None
    # A hand-made zip can hold one name twice; which copy is meant is unknown (infer refuses it too).
    twice = sorted(name for name, count in Counter(names).items() if count > 1)
    if twice:
        raise RequestError(
            400, "duplicate_member", f".npz archive holds {twice[0]} twice: which copy is meant is unknown"
        )
    members = {m[: -len(".npy")]: m for m in names}
    _check_names(set(members), metadata, ".npz archive:")
    arrays = {}
    for name in metadata.signature.item_inputs:
        try:
            with archive.open(members[name]) as stream:
                arrays[name] = _read_npy(stream, name, metadata, limits)
        except (zipfile.BadZipFile, zlib.error) as exc:
            raise RequestError(400, "malformed_npz", f"{name}: damaged .npz member: {exc}") from None
    return arrays


def _read_npy(stream, name: str, metadata: ModelMetadata, limits: RequestLimits) -> np.ndarray:
    start = stream.tell() if stream.seekable() else None
    _check_header(stream, name, metadata, limits)
    if start is not None:
        stream.seek(start)
    try:
        return np.lib.format.read_array(stream, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise RequestError(400, "malformed_npy", f"{name}: not a readable .npy array: {exc}") from None


def _check_header(stream, name: str, metadata: ModelMetadata, limits: RequestLimits) -> None:
    """Refuse an array by its .npy header (shape, dtype) before reading its data."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(stream)
        read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"unsupported .npy version {version}")
        shape, _fortran, dtype = read_header(stream)
    except (ValueError, OSError, EOFError) as exc:
        raise RequestError(400, "malformed_npy", f"{name}: not a readable .npy array: {exc}") from None
    if dtype.kind not in "fiu" or dtype.hasobject:
        raise RequestError(422, "not_numeric", f"{name} has dtype {dtype}: expected a float or integer array")
    # Checked before the data is read, so an oversized array costs nothing.
    check_shape(name, shape, metadata, limits)
