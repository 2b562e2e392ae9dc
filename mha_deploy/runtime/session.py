"""``MHASession``: an exported model, ready to run, with inputs checked against its metadata."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mha_deploy.atomic import atomic_path, same_file
from mha_deploy.errors import InputError, ModelFileError, OptionError, OutputError, ProviderUnavailableError
from mha_deploy.inputs import placeholder_inputs
from mha_deploy.metadata import CACHE_RAGGED, METADATA_KEY, ModelMetadata
from mha_deploy.runtime.cuda_support import cuda_graph_unsupported, cuda_unsupported
from mha_deploy.runtime.decoding import IncrementalDecoder
from mha_deploy.runtime.denormals import ORT_CONFIG_ENTRY, flushing_denormals
from mha_deploy.runtime.digest import sha256_digest
from mha_deploy.runtime.model_check import (
    check_batching,
    check_branch_ranks,
    check_cache_behaviour,
    check_causal_behaviour,
    check_causality,
    check_declared_io,
    check_heads,
    with_graph_vocabularies,
)
from mha_deploy.runtime.providers import CUDA_EP, check_providers, plan_providers, without_cuda
from mha_deploy.runtime.session_file import FileGraph, read_file_graph, read_graph
from mha_deploy.runtime.validation import output_shape_problem, validate_inputs

# Per thread: inside ``MHASession.flushing`` (depth 1), where this thread already flushes denormals.
_FLUSHED = threading.local()

# metadata_props entry of an optimized-model cache: what it was built from (see ``_cache_key``).
CACHE_KEY_PROP = "mha_deploy.optimized_from"

OPTIMIZATION_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class MHASession:
    """One ONNX Runtime session over an mha-deploy model.

    ``run`` is safe to call from many threads at once: it keeps no state between
    calls and ORT's ``InferenceSession.run`` is thread-safe (it releases the GIL,
    so concurrent calls overlap). The one exception is CUDA graph mode, where
    calls are serialised by a lock (see ``cuda_graph``).

    >>> session = MHASession("mha.onnx", provider="cpu")
    >>> session.run({"x": x})["output"]   # x: float32 [batch, seq, d_model]

    Keyword options (all optional):

    - ``threads``: ORT intra-op threads (default: one per core).
      ``inter_op_threads``: threads running independent graph nodes at once;
      setting it switches ORT to parallel execution mode, the only mode that uses them.
    - ``optimization``: ORT graph optimization level, one of ``OPTIMIZATION_LEVELS``.
    - ``optimized_model_path``: cache of the ORT-optimized graph. It records what it was
      built from: the SHA-256 of ``model``'s bytes, the ORT version, the optimization
      level and the providers. Loaded with optimizations off when all of these match,
      which makes later starts faster (``loaded_from`` says which file ORT loaded);
      rebuilt (atomically) when it is missing, unreadable or built from anything else,
      such as a model replaced with ``cp -p`` (same mtime, other bytes). ORT's "all"
      level can bake in optimizations for this machine's CPU or GPU: keep one cache per
      model, provider and machine type.
    - ``session_config``: raw ORT session config entries, e.g.
      ``{"session.intra_op.allow_spinning": "0"}`` to stop idle ORT threads spinning.
    - ``warmup``: run one tiny batch on load, so the first real request does not pay
      for ORT's lazy initialisation.
    - ``io_binding``: run through an ``IOBinding`` (a new one per call, so still
      thread-safe), with outputs allocated on the session's device and copied back
      once. Works on CPU too; it matters on CUDA.
    - ``flush_denormals`` (default True): flush denormal floats to zero while ORT runs,
      on its pool threads and on the calling thread for the extent of each call (its
      floating-point state is restored after): masked attention ops run 1.4-1.8x
      faster (``mha_deploy.runtime.denormals``). False leaves ORT's default, which keeps them.
    - ``graph``: the file's graph as ``session_file.read_file_graph`` read it, for a caller that read it already
      (``kv_stepper.open_decoder`` reads the metadata first): the file's graph is then read once. The graph the
      load check read, weights left in the file, stays as ``graph_proto`` (None for in-memory models) for what
      reads the graph after the load (a stepper's ports and cache layout).
    - ``cuda_graph``: the fixed input shape, ``(batch, seq)`` for self-attention or
      ``(batch, q_seq, kv_seq)`` for cross-attention, to capture a CUDA graph for
      (ORT's ``enable_cuda_graph``). Needs ``provider="cuda"``. The graph replays
      on fixed device buffers, so every call must have exactly that shape (else
      ``InputError``) and calls are serialised on one thread of the session's own,
      where the graph is captured on load and replayed (ORT keeps a graph per thread).

    Models ORT's CUDA provider cannot run as deployed (``mha_deploy.runtime.cuda_support``:
    int8, weights returned through ONNX Attention, fp32 GroupQueryAttention; control
    flow under ``cuda_graph``) are refused on ``provider="cuda"`` and run on the CPU
    with a note on ``"auto"``.

    A model file's metadata is checked against its graph on load
    (``mha_deploy.runtime.model_check``): declared inputs and outputs, heads and
    causality where the graph states them, and probe batches that must give the
    same outputs padded as alone (skipped in CUDA graph mode, whose shape is
    fixed). A file that fails is refused with ``ModelFileError``. In-memory models
    (bytes, what the exporter checks parity on) get the input and output names
    check only.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        provider: str = "auto",
        threads: int | None = None,
        optimization: str = "all",
        *,
        inter_op_threads: int | None = None,
        optimized_model_path: str | os.PathLike | None = None,
        session_config: Mapping[str, str] | None = None,
        warmup: bool = False,
        io_binding: bool = False,
        cuda_graph: tuple[int, ...] | None = None,
        flush_denormals: bool = True,
        graph: FileGraph | None = None,
    ):
        self.source = "<in-memory model>" if isinstance(model, bytes) else str(model)
        if not isinstance(model, bytes):
            _check_model_path(Path(model))
        if optimization not in OPTIMIZATION_LEVELS:
            raise OptionError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        if cuda_graph is not None and provider != "cuda":
            raise ProviderUnavailableError(
                f"cuda_graph needs provider='cuda' (got {provider!r}): CUDA graphs exist only on the CUDA provider"
            )
        self.flush_denormals = flush_denormals
        options = _session_options(threads, inter_op_threads, optimization, session_config, flush_denormals)
        # The file's graph without its weights' bytes, read and parsed once (or as the caller read it, ``graph``):
        # what ORT loads, what the load check reads, what is kept as ``graph_proto``.
        if graph is None and not isinstance(model, bytes):
            graph = _graph_of(Path(model))
        self.graph_proto: onnx.ModelProto | None = None
        if graph is not None and _shapes_change_every_call(graph.proto):
            # ORT's memory pattern plans one block per input shape set; a decoder's past grows every call, so
            # each step plans anew and the arena keeps every block it ever gave: 894 against 638 MB peak for
            # a 189 MB Llama decoding 16 rows (prompt 128, 128 new tokens), measured.
            options.enable_mem_pattern = False
        plan = plan_providers(provider)
        if CUDA_EP in plan.ort_providers:
            reason = _cuda_refusal(graph.proto if graph is not None and graph.proto is not None else model,
                                   cuda_graph is not None)
            if reason:
                plan = without_cuda(plan, f"{self.source}: {reason}")
        providers = plan.session_providers(**({"enable_cuda_graph": "1"} if cuda_graph is not None else {}))
        # ORT sets the loading thread's denormal mode for good on the process's first load: scoped here too.
        with flushing_denormals(flush_denormals):
            self._session = self._load(model, options, providers, optimized_model_path, graph)
        self.provider = check_providers(plan, self._session)
        self.provider_note = plan.note
        self.metadata = ModelMetadata.from_props(self._session.get_modelmeta().custom_metadata_map, self.source)
        if cuda_graph is not None and self.signature.kv_cache:
            raise OptionError("cuda_graph replays fixed shapes; a KV-cache model's cache grows every call")
        self._check_io_names()
        if not isinstance(model, bytes):
            self._check_against_graph(Path(model), graph, probe=cuda_graph is None)
        self._io_binding = io_binding
        self._graph = _CudaGraph(self._session, self.metadata, cuda_graph) if cuda_graph is not None else None
        if warmup:
            self.warmup()

    def _load(self, model, options: ort.SessionOptions, providers: list, optimized_model_path,
              graph: FileGraph | None) -> ort.InferenceSession:
        """The ORT session, through the optimized-model cache when there is one; ``graph``: ``_graph_of`` the file."""
        source = model if isinstance(model, bytes) else str(model)
        self.loaded_from = self.source
        try:
            if optimized_model_path is None:
                return ort.InferenceSession(_weights_apart(source, graph, options), options, providers=providers)
            cache = Path(optimized_model_path)
            if not isinstance(model, bytes) and same_file(cache, Path(model)):
                raise OptionError(
                    f"optimized_model_path {cache} is the model itself, which the optimized graph would replace: "
                    "give the cache a path of its own"
                )
            key = _cache_key(model, options, providers)
            cached = _load_cache(cache, key, options, providers)
            if cached is not None:
                self.loaded_from = str(cache)
                return cached
            try:
                # atomic_path creates the temporary first: ORT's own failure to write it says only
                # "SystemError : 13", as if the model were at fault.
                with atomic_path(cache) as tmp:
                    options.optimized_model_filepath = str(tmp)
                    session = ort.InferenceSession(source, options, providers=providers)
                    _append_metadata_prop(tmp, CACHE_KEY_PROP, key)
            except (OSError, OutputError) as exc:
                cause = exc.__cause__ if isinstance(exc, OutputError) else exc
                reason = getattr(cause, "strerror", None) or cause
                raise ModelFileError(f"{cache}: cannot write the optimized-model cache ({reason})") from exc
            return session
        except (ModelFileError, OptionError):
            raise
        except Exception as exc:  # ORT raises its own Fail/InvalidProtobuf/... types
            raise ModelFileError(f"{self.loaded_from}: ONNX Runtime cannot load it: {exc}") from exc

    def _check_against_graph(self, path: Path, graph: FileGraph | None, probe: bool) -> None:
        """Refuse a file whose metadata does not describe its graph (see ``mha_deploy.runtime.model_check``); keep the
        graph checked as ``graph_proto``."""
        proto = graph.proto if graph is not None else None
        if proto is None:
            try:
                # Not onnx.load: the weights' bytes twice beside the session's copy (session_file).
                proto = read_graph(path)
            except Exception as exc:  # DecodeError and friends; ORT read it, so this is a race with a writer
                raise ModelFileError(f"{path}: not a readable ONNX file: {exc}") from exc
        self.graph_proto = proto
        self._check_against_proto(proto, probe)

    def _check_against_proto(self, proto: onnx.ModelProto, probe: bool) -> None:
        check_declared_io(proto, self.metadata, self.source)
        check_branch_ranks(proto, self.source)
        check_heads(proto, self.metadata, self.source)
        check_causality(proto, self.metadata, self.source)
        self.metadata = with_graph_vocabularies(proto, self.metadata, self.source)
        del proto
        if not probe:
            return

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            try:
                with flushing_denormals(self.flush_denormals):
                    outputs = self._session.run(list(self.output_names), feeds)
            except Exception as exc:  # ORT's own types
                raise ModelFileError(f"{self.source}: a probe batch of 1-2 items fails to run: {exc}") from exc
            return dict(zip(self.output_names, outputs, strict=True))

        check_batching(run, self.metadata, self.source)
        check_causal_behaviour(run, self.metadata, self.source)
        check_cache_behaviour(run, self.metadata, self.source)

    @property
    def signature(self):
        return self.metadata.signature

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.signature.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.signature.output_names

    def run(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Validate ``inputs`` (name -> array) and return the outputs by name."""
        feeds = validate_inputs(self.metadata, inputs)
        if self._graph is not None:
            return self._graph.run(feeds)
        # Within ``flushing`` this thread flushes already: not set and restored again.
        with flushing_denormals(self.flush_denormals and not getattr(_FLUSHED, "depth", 0)):
            if self._io_binding:
                outputs = self._run_with_binding(feeds)
            else:
                outputs = dict(zip(self.output_names, self._session.run(list(self.output_names), feeds), strict=True))
        problem = output_shape_problem(self.signature, feeds, outputs, self.metadata.fixed_sizes,
                                       ragged=self.metadata.cache_layout == CACHE_RAGGED)
        if problem:
            raise ModelFileError(f"{self.source}: {problem}")
        return outputs

    def run_into(self, inputs: Mapping[str, object], outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``run``, with the outputs named in ``outputs`` written by ORT straight into those caller-owned arrays
        (C-contiguous, the model's dtype, exactly the output's shape) through an IOBinding: no allocation and
        no copy for them. ORT allocates the other outputs. CPU provider only: the arrays are host memory.

        What a KV-cache decoder uses to keep its cache in preallocated buffers (``decoder``).
        """
        if self.provider != "cpu" or self._graph is not None:
            raise OptionError(f"run_into writes host arrays: it needs the CPU provider (this session: {self.provider})")
        feeds = validate_inputs(self.metadata, inputs)
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        dtype = np.dtype(self.metadata.dtype)
        for name in self.output_names:
            target = outputs.get(name)
            if target is None:
                binding.bind_output(name, "cpu")
                continue
            if target.dtype != dtype or not target.flags.c_contiguous or not target.flags.writeable:
                raise InputError(f"{name}: run_into needs a writable C-contiguous {dtype.name} array")
            binding.bind_output(name, "cpu", 0, dtype.type, list(target.shape), target.ctypes.data)
        try:
            with flushing_denormals(self.flush_denormals):
                self._session.run_with_iobinding(binding)
        except Exception as exc:  # ORT's own types; a wrong output shape is the caller's mistake
            raise InputError(f"run_into failed (is every output array exactly its output's shape?): {exc}") from exc
        values = binding.get_outputs()
        return {
            name: outputs[name] if name in outputs else value.numpy()
            for name, value in zip(self.output_names, values, strict=True)
        }

    def run_in_place(
        self, inputs: Mapping[str, np.ndarray], in_place: Mapping[str, str], wanted: tuple[str, ...],
        kept: KeptBinding | None = None, into: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run with every output in ``in_place`` (output name -> input name) written by ORT into the very array that
        input reads (a KV cache updated in place, ``run_in_place``); returns the ``wanted`` outputs, allocated by
        ORT, and the ``into`` ones, written into the caller's arrays. The inputs are bound as given, not validated on
        the signature: the caller checks them (a ragged cache is wider than the tokens it holds, which
        ``validate_inputs`` would refuse). CPU provider only. ``kept``: a binding of this session kept across one
        thread's calls (``KeptBinding``)."""
        if self.provider != "cpu" or self._graph is not None:
            raise OptionError(f"run_in_place writes host arrays: it needs the CPU provider (this session: "
                              f"{self.provider})")
        if self.flush_denormals and getattr(_FLUSHED, "depth", 0):
            return run_in_place(self._session, inputs, in_place, wanted, kept, into)  # flushed by ``flushing``
        with flushing_denormals(self.flush_denormals):
            return run_in_place(self._session, inputs, in_place, wanted, kept, into)

    @property
    def flushed_here(self) -> bool:
        """Whether a call on this thread now runs as ``run_in_place`` would run it: inside a ``flushing`` block, or
        with no denormal flushing asked for."""
        return not self.flush_denormals or bool(getattr(_FLUSHED, "depth", 0))

    @contextmanager
    def flushing(self) -> Iterator[None]:
        """One denormal scope (``flush_denormals``) for every ``run_in_place`` this thread makes within the block,
        instead of one per call (about 5-15 us each: two ``fesetenv`` calls through ctypes and a context manager).
        A caller that runs numpy between calls (a generation loop choosing tokens) runs it flushed too: see
        ``generation.generate`` for why that changes no token. The thread's floating-point state is restored when
        the block ends; nested blocks are one scope."""
        if not self.flush_denormals or getattr(_FLUSHED, "depth", 0):
            yield
            return
        with flushing_denormals(True):
            _FLUSHED.depth = 1
            try:
                yield
            finally:
                _FLUSHED.depth = 0

    def kept_binding(self) -> KeptBinding:
        """A binding for ``run_in_place`` to keep across one thread's calls."""
        return KeptBinding(self._session)

    def decoder(self, capacity: int | None = None) -> IncrementalDecoder:
        """Incremental decoding over this KV-cache model: ``prefill`` then ``step`` (see ``IncrementalDecoder``)."""
        return IncrementalDecoder(self, capacity)

    def warmup(self) -> None:
        """Run one tiny batch (or, in CUDA graph mode, one batch of the graph's shape)."""
        self.run(_placeholders(self.metadata, self._graph.shape if self._graph else None))

    def _run_with_binding(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A binding per call: IOBinding objects are not safe to share between threads.
        binding = self._session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for name in self.output_names:
            binding.bind_output(name, self.provider)  # "cpu" or "cuda": ORT allocates with the right shape
        self._session.run_with_iobinding(binding)
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu(), strict=True))

    def __call__(self, **inputs) -> dict[str, np.ndarray]:
        return self.run(inputs)

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"MHASession({self.source!r}, provider={self.provider!r}, d_model={m.d_model}, heads={m.num_heads}, "
            f"attention={m.signature.attention!r}, mask={m.signature.mask!r})"
        )

    def _check_io_names(self) -> None:
        actual_in = tuple(i.name for i in self._session.get_inputs())
        actual_out = tuple(o.name for o in self._session.get_outputs())
        if set(actual_in) != set(self.input_names) or not set(self.output_names) <= set(actual_out):
            raise ModelFileError(
                f"{self.source}: graph inputs {actual_in} / outputs {actual_out} do not match its metadata "
                f"({self.input_names} / {self.output_names}); was the file edited after export?"
            )


def run_in_place(
    session: ort.InferenceSession, inputs: Mapping[str, np.ndarray], in_place: Mapping[str, str],
    wanted: tuple[str, ...], kept: KeptBinding | None = None, into: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """One call through an IOBinding: each output named in ``in_place`` is bound to the memory of the input it names
    (same pointer, same shape), so ORT writes it there and nothing is allocated or copied for it; each output named
    in ``into`` is written into the caller's array given (exactly the output's shape and type; returned as it is);
    the ``wanted`` outputs are allocated by ORT and returned by name. The arrays must be C-contiguous host arrays.
    ``kept``: a binding kept across one thread's calls (``KeptBinding``), else a binding for this call.

    With every output bound to the caller's memory, no output is read back at all: ``get_outputs`` wraps every
    output of the binding in an OrtValue (13 for a 6-layer decoder), 0.1 ms of a decoding step's host time."""
    kept = kept or KeptBinding(session)
    kept.owner = None
    for name, array in inputs.items():
        kept.bind(name, array, output=False)
    for output, source in in_place.items():
        kept.bind(output, inputs[source], output=True)
    if into:
        for name, array in into.items():
            kept.bind(name, array, output=True)
    for name in wanted:
        kept.allocate(name)
    session.run_with_iobinding(kept.binding)
    result = dict(into) if into else {}
    if wanted:
        values = kept.binding.get_outputs()
        for name in wanted:
            result[name] = values[kept.outputs[name]].numpy()
    return result


class KeptBinding:
    """An IOBinding kept across the calls of one thread (IOBinding objects are not safe to share between threads):
    an input or in-place output bound to the same memory, shape and type as on the previous call is not bound again.
    A ragged KV cache's buffers, two per layer and as many present outputs written into them, are the same arrays
    step after step; binding each anew cost most of a decoding step's host time (about 0.6 ms of 3.3 at batch 1 on
    a 6-layer Llama, measured). ORT keeps an output's place in the binding when it is bound again by name."""

    def __init__(self, session: ort.InferenceSession):
        self.binding = session.io_binding()
        self._bound: dict[tuple[str, bool], tuple[int, tuple[int, ...], np.dtype]] = {}
        # The array each name was last bound to, held so that its memory stays its own: the same object again is
        # the same memory, known without asking numpy for its address.
        self._held: dict[tuple[str, bool], np.ndarray] = {}
        self.outputs: dict[str, int] = {}  # output name -> its place in get_outputs(), in first-bound order
        # What the caller said stands for the in-place arrays bound last (kv_stepper._Graph.run_in_place): the same
        # token again means they are bound still. A caller binding other in-place arrays resets it.
        self.caches_token: object | None = None
        # The prepared decode step (kv_stepper._DecodeStep) whose arrays are all this binding holds, else None: any
        # call through run_in_place binds others.
        self.owner: object | None = None

    def bind(self, name: str, array: np.ndarray, output: bool) -> None:
        key = (name, output)
        held = self._held.get(key)
        if held is array:
            return  # checked when it was bound; the binding reads its memory as it is now
        if not array.flags.c_contiguous:
            raise InputError(f"{name}: run_in_place binds memory as it is and needs a C-contiguous array")
        self._held[key] = array
        if not output and held is not None and held.shape != array.shape:
            # Another shape is bound anew wherever it lies (a ragged decoder's mask grows a column every step):
            # ORT's own numpy binding wraps the array's memory as the pointer binding does, at half its cost.
            self.binding.bind_cpu_input(name, array)
            self._bound.pop(key, None)
            return
        where = (array.ctypes.data, array.shape, array.dtype)
        if self._bound.get(key) == where:
            return  # another array over the same memory: it holds this call's values all the same
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, array.dtype.type, list(array.shape), where[0])
        self._bound[key] = where
        if output:
            self.outputs.setdefault(name, len(self.outputs))

    def forget(self, name: str) -> None:
        """Input ``name`` is bound again by the next ``bind``, whatever it was bound to (someone else binds it in
        between)."""
        self._held.pop((name, False), None)
        self._bound.pop((name, False), None)

    def allocate(self, name: str) -> None:
        """Output ``name`` allocated by ORT on the next call. Bound anew every call: ORT keeps an output it
        allocated in the binding and reuses it (its shape then fixed) unless bound again."""
        self.binding.bind_output(name, "cpu")
        key = (name, True)
        self._held.pop(key, None)  # no longer bound to that array: binding it again must bind it
        self._bound.pop(key, None)
        self.outputs.setdefault(name, len(self.outputs))


def check_model_file(path: str | os.PathLike) -> ModelMetadata:
    """A model file's metadata, checked against its graph as every session checks it on load (see
    ``mha_deploy.runtime.model_check``), or ``ModelFileError``. What ``triton`` and ``inspect`` check
    with, so that they refuse or flag exactly the files ``infer`` and ``serve`` refuse."""
    return MHASession(path, provider="cpu", threads=1, optimization="disabled", flush_denormals=False).metadata


def check_model_before_writing(model: onnx.ModelProto, destination: str | os.PathLike) -> None:
    """The check every session runs on loading a file (``mha_deploy.runtime.model_check``), run on ``model``
    before it is written to ``destination``: what ``export`` and ``optimize`` run, so that every file they
    write loads in ``MHASession``, ``infer``, ``serve`` and ``triton``. ``ModelFileError`` as a load gives, its
    ``problem`` in the same words."""
    session = MHASession(
        model.SerializeToString(), provider="cpu", threads=1, optimization="disabled", flush_denormals=False
    )
    session.source = str(destination)
    session._check_against_proto(model, probe=True)


def _cuda_refusal(model: str | os.PathLike | bytes | onnx.ModelProto, cuda_graph: bool) -> str | None:
    """Why ORT's CUDA provider (in a CUDA graph if ``cuda_graph``) cannot run ``model`` as deployed, or None.

    ``model`` is best the graph the session already read (ops and shapes, no weights' bytes); a path or bytes are
    parsed here. None too when the model cannot be parsed: ORT's own load then says why, with the file name.
    """
    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, bytes):
            proto = onnx.load_from_string(model)
        else:
            proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # DecodeError and friends
        return None
    return cuda_unsupported(proto) or (cuda_graph_unsupported(proto) if cuda_graph else None)


class _CudaGraph:
    """Replays one captured CUDA graph on fixed device buffers, always from the same thread.

    ORT captures the graph on a ``run_with_iobinding`` and replays it on later
    ones, reading inputs from and writing outputs to the device addresses bound
    at capture time. So the shapes can never change, new inputs are copied into
    the bound buffers (``update_inplace``), and runs must not interleave: one
    thread's copy would overwrite another's inputs mid-replay.

    ORT's CUDA provider keeps its CUDA graph, and its count of warm-up runs, per
    thread: they live in ``PerThreadContext`` (onnxruntime/core/providers/cuda/
    cuda_execution_provider.h, "Cuda graph with multi threads will be supported in
    the future"). Called from a new thread, it would warm up and capture again
    and keep one more graph alive per thread. So every run, the
    capture included, goes through one worker thread owned by this object, which
    also serialises them.
    """

    def __init__(
        self, session: ort.InferenceSession, metadata: ModelMetadata, shape: tuple[int, ...], device: str = "cuda"
    ):
        # ``device`` is "cuda" in use; tests drive the same buffers and locking on "cpu", where no graph exists.
        signature = metadata.signature
        self.shape = tuple(int(n) for n in shape)
        if len(self.shape) != 1 + len(signature.sequence_axes) or min(self.shape) < 1:
            raise InputError(
                f"cuda_graph shape must be (batch, seq) for self-attention or (batch, q_seq, kv_seq) for "
                f"cross-attention, all >= 1; got {shape}"
            )
        tiny = _placeholders(metadata, self.shape)
        self.feed_shapes = {name: array.shape for name, array in tiny.items()}
        self._session = session
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mha-cuda-graph")
        self._output_names = signature.output_names
        # Device buffers live as long as the session: the captured graph points at them.
        self._inputs = {name: ort.OrtValue.ortvalue_from_numpy(tiny[name], device, 0) for name in tiny}
        sizes = signature.axis_sizes(
            self.shape[0], self.shape[1], self.shape[-1], d_model=metadata.d_model, heads=metadata.num_heads
        )
        self._outputs = {
            spec.name: ort.OrtValue.ortvalue_from_shape_and_type(
                spec.shape(sizes), np.dtype(spec.numpy_dtype(metadata.dtype)), device, 0
            )
            for spec in signature.outputs
        }
        self._binding = session.io_binding()
        for name, value in self._inputs.items():
            self._binding.bind_ortvalue_input(name, value)
        for name, value in self._outputs.items():
            self._binding.bind_ortvalue_output(name, value)
        # ORT runs a graph-enabled session normally once before it captures, to make
        # its allocations (min_num_runs_before_cuda_graph_capture_ = 1 in the same
        # header): two runs on load, so that no user call pays for the capture.
        for _ in range(2):
            self._worker.submit(self._session.run_with_iobinding, self._binding).result()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        wrong = {name: array.shape for name, array in feeds.items() if array.shape != self.feed_shapes[name]}
        if wrong:
            raise InputError(
                f"this session replays a CUDA graph captured for shapes {self.feed_shapes}; got {wrong}. "
                "Pad inputs to the captured shape, or use a session without cuda_graph for other shapes"
            )
        return self._worker.submit(self._replay, feeds).result()

    def _replay(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, array in feeds.items():
            self._inputs[name].update_inplace(array)
        self._session.run_with_iobinding(self._binding)
        return dict(zip(self._output_names, self._binding.copy_outputs_to_cpu(), strict=True))


def _placeholders(metadata: ModelMetadata, shape: tuple[int, ...] | None) -> dict[str, np.ndarray]:
    """Zeros with masks that hide nothing, for ``shape`` = (batch, seq) or (batch, q_seq, kv_seq); default 1 x 1."""
    batch, q_len, kv_len = (shape[0], shape[1], shape[-1]) if shape else (1, 1, 1)
    return placeholder_inputs(
        metadata.signature, metadata.d_model, metadata.dtype, batch, q_len, kv_len, heads=metadata.num_heads
    )


def _session_options(
    threads: int | None,
    inter_op_threads: int | None,
    optimization: str,
    session_config: Mapping[str, str] | None,
    flush_denormals: bool,
) -> ort.SessionOptions:
    options = ort.SessionOptions()
    # Errors only: ORT 1.31 infers a last dim of 0 for ONNX Attention's
    # qk_matmul_output and warns on every run of a --return-weights model,
    # although the declared output shape is right and the values are checked.
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = threads
    if inter_op_threads is not None:
        options.inter_op_num_threads = inter_op_threads
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization]
    if flush_denormals and ORT_CONFIG_ENTRY not in (session_config or {}):
        # ORT's pool threads; the calling thread is flushed around each call. An entry of the caller's wins
        # (ORT warns when one is set twice).
        options.add_session_config_entry(ORT_CONFIG_ENTRY, "1")
    for key, value in (session_config or {}).items():
        options.add_session_config_entry(key, str(value))
    return options


def _graph_of(path: Path) -> FileGraph | None:
    """``session_file.read_file_graph`` of ``path``; None when it cannot be read here (ORT then says why)."""
    try:
        return read_file_graph(path)
    except OSError:
        return None


def _shapes_change_every_call(graph: onnx.ModelProto | None) -> bool:
    """Whether the file's metadata says it is a KV-cache decoder (its past input grows every call)."""
    if graph is None:
        return False
    try:
        props = {p.key: p.value for p in graph.metadata_props}
        return METADATA_KEY in props and ModelMetadata.from_props(props).signature.kv_cache
    except Exception:  # not ONNX, or not an mha-deploy file: the load and its check say what is wrong
        return False


def _weights_apart(source: str | bytes, graph: FileGraph | None, options: ort.SessionOptions) -> str | bytes:
    """What ORT loads for ``source``: a file with large inline weights as its graph alone, the weights read from the
    file as external data (``session_file``: ORT keeps an inline weight's bytes longer; 253 against 181 MB resident
    after loading a 189 MB Llama, measured); bytes, and any other file by its path, as they are."""
    if isinstance(source, bytes) or graph is None or not graph[1]:
        return source
    options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                     str(Path(source).resolve().parent))
    return graph[0]


def _cache_key(model: str | os.PathLike | bytes, options: ort.SessionOptions, providers: list) -> str:
    """What an optimized graph depends on: the source's bytes (not its mtime), ORT, the level, the providers."""
    return json.dumps(
        {
            "source": sha256_digest(model if isinstance(model, bytes) else Path(model)),
            "onnxruntime": ort.__version__,
            "optimization": int(options.graph_optimization_level),
            "providers": [str(p) for p in providers],
        },
        sort_keys=True,
    )


def _load_cache(
    cache: Path, key: str, options: ort.SessionOptions, providers: list
) -> ort.InferenceSession | None:
    """A session on the cached graph if it was built from exactly ``key``, else None (it is then rebuilt)."""
    if not cache.is_file():
        return None
    level = options.graph_optimization_level
    options.graph_optimization_level = OPTIMIZATION_LEVELS["disabled"]  # done once, when it was saved
    try:
        session = ort.InferenceSession(str(cache), options, providers=providers)
    except Exception:  # unreadable cache (another ORT version wrote it?): rebuild it from the model
        return None
    finally:
        options.graph_optimization_level = level
    if session.get_modelmeta().custom_metadata_map.get(CACHE_KEY_PROP) != key:
        return None
    return session


def _append_metadata_prop(path: Path, key: str, value: str) -> None:
    """Add a metadata_props entry to the ONNX file ORT just wrote, without parsing it.

    A protobuf message followed by more encoded fields parses as the message with
    those fields merged in, and a repeated field appends: so appending one encoded
    ``metadata_props`` entry (ModelProto field 14; StringStringEntryProto key 1,
    value 2) adds it. The cache then carries its own key: no sidecar to keep in step.
    """
    entry = length_delimited(1, key.encode()) + length_delimited(2, value.encode())
    with open(path, "ab") as f:
        f.write(length_delimited(14, entry))


def length_delimited(field: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (tag, length, payload), written without a protobuf library."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _check_model_path(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, expected an .onnx file")
