"""A Triton Inference Server model repository entry for an exported model (onnxruntime backend).

Writes ``REPO/NAME/config.pbtxt`` and ``REPO/NAME/<version>/model.onnx``
(version 1 unless told; its graph with the validator's bounds on ids and lengths written in,
``serving.triton_guards``). The whole ``NAME/`` directory is built beside its
destination and renamed into place, so the repository never holds a
half-written model (Triton may be polling it). Replacing an existing entry
(``overwrite``) replaces the config and the version written, nothing else: the
new ``NAME/`` is staged with hard links to every other file and version
directory the old one held (copies where the filesystem has no hard links),
then swapped in with one rename. A lock beside the entry (``.NAME.mha-deploy.lock``,
``mha_deploy.batch.lock``) keeps a second writer of the same entry out meanwhile.

Batching choice: with ``max_batch_size > 0`` Triton owns the batch axis (dims
omit it) and its dynamic batcher concatenates requests along it, which works
only for requests of the same shape: requests with different sequence lengths
are never batched together. Ragged batching (``allow_ragged_batch``) would lift
that, but it hands the model a flat [total_tokens, d_model] tensor plus offsets,
which this model does not take. So the config keeps plain dynamic batching:
under traffic of mixed lengths Triton batches only the requests that happen to
share a length, and clients that want more batching pad to a few bucket lengths
(with a key_padding_mask model, mark the padding in the mask; a causal-only
model is unaffected by right padding). The mha-deploy HTTP server pads across
lengths by itself.

A KV-cache model (``--kv-cache``) is stateful: its config uses Triton's
sequence batcher with implicit state instead (``_kv_cache_config``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import onnx.external_data_helper

from mha_deploy.batch.lock import OutputLock, lock_path
from mha_deploy.errors import MHADeployError, ModelFileError
from mha_deploy.metadata import TRITON_KINDS as KINDS  # re-exported: defined without onnx for the CLI
from mha_deploy.metadata import ModelMetadata
from mha_deploy.serving.triton_guards import bound_inputs

# ONNX element types -> Triton data types, for the types this project's models use.
TRITON_DTYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT64: "TYPE_INT64",
}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# File names take 255 bytes; the staging directory adds a dot and ".<12 hex>.tmp" (and the lock more).
MAX_NAME_LENGTH = 200
CONFIG_NAME = "config.pbtxt"


class TritonExportError(MHADeployError):
    """The model cannot be written as a Triton repository entry."""


@dataclass(frozen=True)
class TritonConfig:
    name: str | None = None  # default: the model file's stem
    instances: int = 1
    kind: str = "cpu"
    max_batch_size: int = 32  # 0: no batching, dims carry the batch axis
    max_queue_delay_us: int = 500
    version: int = 1  # the version directory written


@dataclass(frozen=True)
class TritonTensor:
    name: str
    data_type: str
    dims: tuple[int, ...]  # without the batch axis when max_batch_size > 0


def write_triton_model(
    model: str | os.PathLike, repo: str | os.PathLike, config: TritonConfig | None = None, overwrite: bool = False
) -> Path:
    """Write ``repo/NAME/{config.pbtxt,VERSION/model.onnx}`` and return ``repo/NAME``.

    With ``overwrite``, an existing ``NAME/`` keeps every other version and file it holds.
    """
    config = config or TritonConfig()
    model, repo = Path(model), Path(repo)
    name = config.name or re.sub(r"[^A-Za-z0-9_.-]", "_", model.stem)
    _check_config(config, name)
    proto = _load(model)
    # The check every session makes on load: a file infer and serve refuse gets no repository entry either.
    from mha_deploy.runtime.session import check_model_file

    metadata = check_model_file(model)
    if config.kind == "gpu":
        _check_runs_on_cuda(proto, model)
    text = config_pbtxt(proto, metadata, config, name)
    # Triton runs the file without the validator: the copy it gets checks ids and lengths itself.
    bounded = bound_inputs(proto, metadata)

    target = repo / name
    # One writer per entry: two `--overwrite` runs would swap the directory out from under each other.
    with OutputLock(lock_path(target, output_is_directory=False), target):
        _write_entry(model, proto if bounded else None, target, text, str(config.version), overwrite)
    return target


def _write_entry(model: Path, bounded: onnx.ModelProto | None, target: Path, text: str, version: str,
                 overwrite: bool) -> None:
    """The entry for ``model``, or for ``bounded`` (the model with its inputs' bounds checked) when given."""
    repo = target.parent
    if target.exists() and not overwrite:
        raise TritonExportError(f"{target} already exists; pass --overwrite to replace it")
    if target.exists() and not target.is_dir():
        raise TritonExportError(f"{target} exists and is not a directory; remove it or choose another --name")
    staging = repo / f".{target.name}.{secrets.token_hex(6)}.tmp"
    try:
        repo.mkdir(parents=True, exist_ok=True)
        try:
            if target.exists():
                _link_tree(target, staging, skip={version, CONFIG_NAME})
            (staging / version).mkdir(parents=True)
            if bounded is None:
                shutil.copyfile(model, staging / version / "model.onnx")
            else:
                # The weights read here, and only here: Triton's copy is one file, its weights inline as the
                # source's were (read_graph left them in the source, which this entry must not depend on).
                onnx.external_data_helper.load_external_data_for_model(bounded, str(model.resolve().parent))
                (staging / version / "model.onnx").write_bytes(bounded.SerializeToString())
            (staging / CONFIG_NAME).write_text(text)
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise TritonExportError(f"{target}: cannot write the model repository entry ({exc.strerror or exc})") from exc


def other_versions(target: Path, version: int) -> list[str]:
    """Version directories of ``target`` besides ``version``: Triton serves the latest one by default."""
    with contextlib.suppress(FileNotFoundError):  # another writer is swapping the entry in: it says so itself
        return _version_dirs(target, version)
    return []


def _version_dirs(target: Path, version: int) -> list[str]:
    return sorted(
        (p.name for p in target.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) != version), key=int
    )


def _link_tree(source: Path, destination: Path, skip: set[str]) -> None:
    """Recreate ``source`` at ``destination`` (but its top-level entries in ``skip``) with hard links to its files."""
    destination.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name in skip:
            continue
        copy = destination / entry.name
        if entry.is_symlink():
            copy.symlink_to(os.readlink(entry))
        elif entry.is_dir():
            _link_tree(entry, copy, skip=set())
        else:
            try:
                os.link(entry, copy)
            except OSError:  # a filesystem without hard links
                shutil.copy2(entry, copy)


def tensor_specs(
    proto: onnx.ModelProto, metadata: ModelMetadata, max_batch_size: int
) -> tuple[list[TritonTensor], list[TritonTensor]]:
    """Inputs and outputs as Triton sees them, from the graph's types and the recorded metadata.

    Shapes come from the metadata (sequence axes are -1, d_model and heads fixed)
    rather than the graph's value_info, which an exporter may leave incomplete.
    """
    signature = metadata.signature
    sizes = metadata.fixed_sizes
    # -1 for every dynamic axis; the batch axis is Triton's when it batches.
    shapes = {spec.name: spec.dims(sizes) for spec in (*signature.inputs, *signature.outputs)}
    types = {v.name: v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)}

    def spec(name: str) -> TritonTensor:
        if name not in types:
            raise ModelFileError(f"the graph has no {name!r}, which its metadata lists; was it edited after export?")
        if types[name] not in TRITON_DTYPES:
            raise TritonExportError(f"{name}: ONNX element type {types[name]} has no Triton mapping here")
        dims = shapes[name][1:] if max_batch_size > 0 else shapes[name]
        return TritonTensor(name, TRITON_DTYPES[types[name]], dims)

    return [spec(n) for n in signature.input_names], [spec(n) for n in signature.output_names]


def config_pbtxt(proto: onnx.ModelProto, metadata: ModelMetadata, config: TritonConfig, name: str) -> str:
    """The text of config.pbtxt (protobuf text format of Triton's ModelConfig)."""
    if metadata.signature.kv_cache:
        return _kv_cache_config(proto, metadata, config, name)
    sig = metadata.signature
    spanning = []
    if sig.batch_outputs and config.max_batch_size > 0:
        # Triton's dynamic batcher would concatenate requests and hand each its rows of an output that spans the
        # batch, every one computed against the other clients' items: no batching, each request its own batch.
        config = replace(config, max_batch_size=0)
        spanning = [f"# max_batch_size 0: {', '.join(sig.batch_outputs)} span the request's whole batch, so Triton "
                    "must not batch requests together (each request is one batch; the batch axis is in dims)."]
    inputs, outputs = tensor_specs(proto, metadata, config.max_batch_size)
    described = (
        f"your own model ({', '.join(sig.input_names)} -> {', '.join(sig.output_names)})"
        if sig.model == "custom" else f"{sig.attention}-attention, mask {sig.mask}"
    )
    lines = [
        f"# Written by mha-deploy: d_model {metadata.d_model}, {metadata.num_heads} heads, {described}.",
        "# Triton batches only requests of equal shape (same sequence lengths); see mha_deploy/serving/triton.py.",
        *spanning,
        f'name: "{name}"',
        'backend: "onnxruntime"',
        f"max_batch_size: {config.max_batch_size}",
        _tensors("input", inputs),
        _tensors("output", outputs),
    ]
    if config.max_batch_size > 0:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {config.max_queue_delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: {config.instances}\n    kind: {KINDS[config.kind]}\n  }}\n]")
    return "\n".join(lines) + "\n"


def _kv_cache_config(proto: onnx.ModelProto, metadata: ModelMetadata, config: TritonConfig, name: str) -> str:
    """A KV-cache model under Triton's sequence batcher with implicit state: past_* <- present_* of the
    sequence's previous request, held by Triton (clients send x, and key_padding_mask over every token the
    sequence has sent, with sequence_id/start/end; a decoder's clients send its memory with every request,
    and memory's keys/values are state too, computed on the first request). max_batch_size is 1 whatever
    ``config`` asks: each sequence's cache has its own length, and one ORT run takes one past_seq, so
    sequences are never batched together; instances run sequences side by side. The first request of a
    sequence gets empty caches (past_seq 0), the prefill. Checked against Triton's ModelConfig schema, not
    run against a server here."""
    signature = metadata.signature
    inputs, outputs = tensor_specs(proto, metadata, max_batch_size=1)
    states = signature.cache_pairs
    inputs = [t for t in inputs if t.name not in states]
    outputs = [t for t in outputs if t.name not in states.values()]
    data_type = TRITON_DTYPES[onnx.TensorProto.FLOAT16 if metadata.dtype == "float16" else onnx.TensorProto.FLOAT]
    heads, d_k = metadata.num_heads, metadata.d_model // metadata.num_heads
    blocks = [
        f'    {{\n      input_name: "{past}"\n      output_name: "{present}"\n      data_type: {data_type}\n'
        f"      dims: [ {heads}, -1, {d_k} ]\n      initial_state: {{\n        data_type: {data_type}\n"
        f'        dims: [ {heads}, 0, {d_k} ]\n        zero_data: true\n        name: "empty {past}"\n'
        "      }\n    }"
        for past, present in states.items()
    ]
    lines = [
        f"# Written by mha-deploy: d_model {metadata.d_model}, {metadata.num_heads} heads, "
        + (f"{metadata.layers}-layer decoder" if signature.model == "decoder" else "self-attention")
        + f", mask {signature.mask}, KV cache.",
        "# Sequence batching with implicit state (past <- present); one sequence per run: see "
        "mha_deploy/serving/triton.py.",
        f'name: "{name}"',
        'backend: "onnxruntime"',
        "max_batch_size: 1",
        _tensors("input", inputs),
        _tensors("output", outputs),
        "sequence_batching {\n  state [\n" + ",\n".join(blocks) + "\n  ]\n}",
        f"instance_group [\n  {{\n    count: {config.instances}\n    kind: {KINDS[config.kind]}\n  }}\n]",
    ]
    return "\n".join(lines) + "\n"


def _tensors(field: str, specs: list[TritonTensor]) -> str:
    blocks = [
        f'  {{\n    name: "{s.name}"\n    data_type: {s.data_type}\n    dims: [ {", ".join(map(str, s.dims))} ]\n  }}'
        for s in specs
    ]
    return f"{field} [\n" + ",\n".join(blocks) + "\n]"


def _check_config(config: TritonConfig, name: str) -> None:
    if not _NAME.match(name) or name.startswith("."):
        raise TritonExportError(f"model name {name!r}: use letters, digits, '_', '-' and '.' (not first)")
    if len(name) > MAX_NAME_LENGTH:
        raise TritonExportError(
            f"model name {name[:20]}... is {len(name)} characters; at most {MAX_NAME_LENGTH} fit a file name "
            "(with the staging directory's suffix)"
        )
    if config.kind not in KINDS:
        raise TritonExportError(f"kind must be one of {', '.join(KINDS)}, got {config.kind!r}")
    if config.instances < 1 or config.max_batch_size < 0 or config.max_queue_delay_us < 0:
        raise TritonExportError("instances must be >= 1, max_batch_size and max_queue_delay_us >= 0")
    if config.version < 1:
        raise TritonExportError(f"version must be >= 1 (Triton numbers versions 1, 2, ...), got {config.version}")


def _check_runs_on_cuda(proto: onnx.ModelProto, model: Path) -> None:
    """KIND_GPU puts the instances on Triton's ORT backend with the CUDA provider: refuse what it cannot run."""
    # Imported here: the rest of the writer needs no onnxruntime, which mha_deploy.runtime loads.
    from mha_deploy.runtime.cuda_support import cuda_unsupported

    reason = cuda_unsupported(proto)
    if reason:
        raise TritonExportError(f"--kind gpu: {model}: {reason}")


def _load(model: Path) -> onnx.ModelProto:
    """``model``'s graph, its weights' bytes left in the file (``session_file.read_graph``: each large weight an
    external-data reference to its own bytes there); what the config, the checks and the bounds read."""
    # Imported here: mha_deploy.runtime's package loads onnxruntime, which importing this writer should not.
    from mha_deploy.runtime.session_file import read_graph

    if not model.is_file():
        raise ModelFileError(f"model file not found: {model}")
    try:
        proto = read_graph(model)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ModelFileError(f"{model}: not a readable ONNX file: {exc}") from exc
    own = model.resolve().name  # where read_graph points the weights it leaves in the file
    if any(t.data_location == onnx.TensorProto.EXTERNAL and _location(t) != own for t in proto.graph.initializer):
        raise TritonExportError(f"{model} keeps weights in external data files; only single-file models are copied")
    return proto


def _location(tensor: onnx.TensorProto) -> str | None:
    return next((entry.value for entry in tensor.external_data if entry.key == "location"), None)


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` onto ``target``; an existing ``target`` is swapped out, then deleted."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = target.with_name(f".{target.name}.{secrets.token_hex(6)}.old")
    os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
