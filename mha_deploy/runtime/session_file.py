"""A model file's graph without its weights' bytes: what the session's checks, the stepper and the metadata
readers need, at a fraction of the memory ``onnx.load`` takes.

An exported file keeps its weights inline (``raw_data`` of each initializer). ``onnx.load`` then holds the file's
bytes and the parsed message at once: about twice the weights (433 MB peak for a 189 MB Llama, measured), which
is most of a decoder's peak memory when it happens beside the session's own copy. ORT itself holds an inline
weight longer than one it reads from external data (a 189 MB Llama: 253 MB resident after loading the inline
file, 181 MB loading the same weights as external data, as onnxruntime-genai's builder writes them).

``read_graph`` walks the protobuf wire format over a memory map and copies everything except each large inline
``raw_data``, which it replaces by an external-data reference to the same bytes in the same file (``location`` the
file's name, ``offset`` and ``length`` of the bytes). The message it returns is the same model: a weight read
through ``onnx.numpy_helper.to_array(tensor, base_dir)`` gives the same array, and ORT loads it (as bytes, with
the file's folder as its external-data folder) to the same session, reading the weights as it reads external
data. Pages of the skipped bytes are never touched, so they never count as this process's memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import NamedTuple

import onnx

# Inline weights smaller than this stay inline: shapes, axes and scalars that the checks read as constants.
STRIP_BYTES = 4096

# Field numbers of onnx.proto3 on the way from a model to its tensors.
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER = 1, 5
_NODE_ATTRIBUTE = 5
_ATTRIBUTE_T, _ATTRIBUTE_G, _ATTRIBUTE_TENSORS, _ATTRIBUTE_GRAPHS = 5, 6, 10, 11
_TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 9, 13, 14
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5

# Which length-delimited fields of a message of each kind hold a message that may hold a weight, and its kind.
_CHILDREN = {
    "model": {_MODEL_GRAPH: "graph"},
    "graph": {_GRAPH_NODE: "node", _GRAPH_INITIALIZER: "tensor"},
    "node": {_NODE_ATTRIBUTE: "attribute"},
    "attribute": {_ATTRIBUTE_T: "tensor", _ATTRIBUTE_G: "graph", _ATTRIBUTE_TENSORS: "tensor",
                  _ATTRIBUTE_GRAPHS: "graph"},
    "tensor": {},
}


def read_graph(path: str | os.PathLike) -> onnx.ModelProto:
    """The model in ``path`` with each inline weight of ``STRIP_BYTES`` or more left in the file (an external-data
    reference to its own bytes there): graph, metadata, small constants and weights' names, types and shapes as
    ``onnx.load`` gives them. ``onnx.load``'s own errors for a file that is not ONNX."""
    return onnx.load_from_string(graph_bytes(path)[0])


class FileGraph(NamedTuple):
    """A file's graph as ``graph_bytes`` reads it, parsed once: what a session loads (``data``, the weights read from
    the file by ORT when ``weights_left``), checks and keeps (``proto``), and what a stepper reads its ports and a
    loader the file's metadata from, so that opening a decoder reads its graph once."""

    data: bytes
    weights_left: int
    proto: onnx.ModelProto | None  # None: not ONNX (ORT's load says what is wrong with it)


def read_file_graph(path: str | os.PathLike) -> FileGraph:
    """``graph_bytes`` of ``path`` and the message they hold (None when they are not ONNX). ``OSError`` when the file
    cannot be read."""
    data, left = graph_bytes(path)
    try:
        proto = onnx.load_from_string(data)
    except Exception:  # DecodeError and friends: the caller's load reports the file
        proto = None
    return FileGraph(data, left, proto)


def graph_bytes(path: str | os.PathLike) -> tuple[bytes, int]:
    """``read_graph``'s message serialized (what ORT loads with ``path``'s folder as its external-data folder), and
    the bytes of weights it left in the file: 0 when there were none (loading the file by its path is the same)."""
    # Resolved: a link's own name is no file in its target's folder, where ORT reads the weights (a Hugging Face
    # cache holds its files as links to blobs).
    path = Path(path).resolve()
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b"", 0
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            left = [0]
            try:
                return _rewrite(data, 0, len(data), "model", path.name, left), left[0]
            except _NotProtobuf:
                return bytes(data), 0  # let onnx or ORT say what is wrong with it


class _NotProtobuf(ValueError):
    pass


def _rewrite(data, start: int, end: int, kind: str, location: str, left: list[int]) -> bytes:
    """The message in ``data[start:end]`` with large inline weights turned into references to their bytes (their
    sizes added to ``left[0]``)."""
    children = _CHILDREN[kind]
    out = bytearray()
    stripped = None  # (offset, length) of the raw_data a tensor leaves in the file
    position = start
    while position < end:
        field_start = position
        tag, position = _varint(data, position, end)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, position = _varint(data, position, end)
        elif wire == _FIXED64:
            position += 8
        elif wire == _FIXED32:
            position += 4
        elif wire == _LENGTH:
            length, body = _varint(data, position, end)
            position = body + length
            if position > end:
                raise _NotProtobuf("a field runs past its message")
            if kind == "tensor" and field == _TENSOR_RAW_DATA and length >= STRIP_BYTES:
                stripped = (body, length)
                continue
            if kind == "tensor" and field in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
                return bytes(data[start:end])  # already external somewhere: left exactly as it is
            if field in children and length >= STRIP_BYTES:
                out += _key(field, _LENGTH) + _length_delimited(_rewrite(data, body, position, children[field],
                                                                         location, left))
                continue
        else:
            raise _NotProtobuf(f"wire type {wire}")
        if position > end:
            raise _NotProtobuf("a field runs past its message")
        out += data[field_start:position]
    if stripped is not None:
        offset, length = stripped
        left[0] += length
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = _key(1, _LENGTH) + _length_delimited(key.encode()) + _key(2, _LENGTH) + _length_delimited(
                value.encode())
            out += _key(_TENSOR_EXTERNAL_DATA, _LENGTH) + _length_delimited(entry)
        out += _key(_TENSOR_DATA_LOCATION, _VARINT) + _encode_varint(onnx.TensorProto.EXTERNAL)
    return bytes(out)


def _varint(data, position: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= end or shift > 63:
            raise _NotProtobuf("a varint runs past its message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def _length_delimited(payload: bytes) -> bytes:
    return _encode_varint(len(payload)) + payload
