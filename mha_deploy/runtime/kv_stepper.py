"""``KVCacheStepper``: the generation loop's ``TokenStepper`` over an ONNX decoder with a KV cache. No torch.

The file's inputs and outputs follow Optimum's names, which onnxruntime-genai and Optimum's own
runtime read too, so that an mha-deploy KV-cache export and an Optimum-style decoder both run:

| input | shape | |
| --- | --- | --- |
| ``input_ids`` int64 | [batch, seq] | the new tokens |
| ``attention_mask`` (optional) | [batch, past + seq] | 1 = real token, over the cache and the new tokens |
| ``position_ids`` (optional) | [batch, seq] | each token's position among its row's real tokens |
| ``past_key_values.{i}.key`` / ``.value`` | [batch, heads, past, head_dim] | self-attention (or ``.decoder.key``) |
| ``past_key_values.{i}.encoder.key`` / ``.value`` | [batch, heads, source, head_dim] | cross-attention cache |
| ``encoder_hidden_states``, ``encoder_attention_mask`` (optional) | [batch, source(, d)] | the encoder's output |
| ``use_cache_branch`` (optional) | [1] bool | Optimum's merged decoders: False on the first call |

Outputs: ``logits`` [batch, seq, vocab] and ``present.{i}.key|value`` = past ++ the new tokens' keys
and values (``present.{i}.encoder.key|value``: the encoder's keys and values, read from the first
call and passed back unchanged after it). A file whose logits are [batch, 1, vocab] (``export --kv-cache --logits
last``; onnxruntime-genai's builder with ``prune_lm_head``) computes them at each row's last real token of the call
only: that column is every call's answer, and what needs every position's logits (``every_position``) is refused.

Two cache layouts (``cache_layout``, from the file's metadata or read off its graph, or given):

- "ragged": the attentions are ORT's contrib GroupQueryAttention reading ``past_key_values.*``: each row's cache
  is its first n positions, ``attention_mask`` is 1 on a row's first n tokens (no holes), and present is past with
  the new keys and values written at each row's length. The stepper keeps one buffer per cache input [row
  capacity, heads, capacity, head_dim], bound as past and present of every call (written in place: no copy per
  step), prompts right-padded; ``reserve`` sizes it once, else it doubles; ``keep`` moves only the rows that change
  place, ``join`` fills spare rows. Decoder-only files.
- "holes" (every other file), below.

Every row shares one cache width; a row padded in the prompt (either side) keeps its padding as masked
holes, zeroed once after the prompt, so positions come from the mask (each row's count of real tokens),
not from the width. When rows
leave (``keep``), their cache rows go, and so do leading columns that no remaining row uses.

An encoder-decoder (``encoder=``, ``decoder_start_token_id=``): ``prefill`` runs the encoder once on
the prompts (its inputs ``input_ids``, ``attention_mask``; output ``last_hidden_state`` or its
first), then the decoder from the start id with empty caches; the first call's encoder caches are
fed back on every later call. An encoder whose outputs are the cross caches themselves
(``present.{i}.encoder.key|value``, as ``export --kv-cache`` writes an encoder-decoder's pair) gives
them at once, and the decoder only reads them. A decoder of such a pair names its encoder in its
metadata (``metadata.ENCODER_DECODER_KEY``): given as a path alone, it opens with it and its recorded
start id. Tested (tests/runtime/test_generation.py) on a hand-written GPT and a hand-written
encoder-decoder (two files), each exported by torch with its cache in these names; the pair on
tests/exporters/test_own_seq2seq_cache.py.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import threading
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from mha_deploy.errors import InputError, ModelFileError, OptionError
from mha_deploy.inputs import right_padding_mask
from mha_deploy.metadata import (
    CACHE_HOLES,
    CACHE_RAGGED,
    ENCODER_DECODER_KEY,
    METADATA_KEY,
    POSITIONS_NONE,
    POSITIONS_PADDED_WIDTH,
    EncoderDecoderRecord,
)
from mha_deploy.runtime.cache_layout import SELF_CACHE, read_cache_layout
from mha_deploy.runtime.session import KeptBinding, run_in_place
from mha_deploy.runtime.session_file import FileGraph, read_file_graph, read_graph
from mha_deploy.signature import AUDIO, IMAGE, TensorSpec

CROSS_CACHE = re.compile(r"^past_key_values\.(\d+)\.encoder\.(key|value)$")
DECODER_INPUTS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "encoder_hidden_states", "encoder_attention_mask",
     "use_cache_branch"}
)
ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class _Port:
    """One graph input as the stepper needs it: its name, numpy dtype and declared shape (ints or axis names)."""

    name: str
    dtype: np.dtype
    shape: tuple


class _Graph:
    """A model to run, whatever holds it: an ``MHASession`` (inputs checked against its metadata), an ORT
    ``InferenceSession``, or a file path (an mha-deploy file opens as an MHASession, any other as an ORT session,
    both on ``provider``)."""

    def __init__(self, model, threads: int | None, provider: str = "cpu", graph: FileGraph | None = None):
        if isinstance(model, str | os.PathLike):
            model = open_decoder(model, threads, provider, graph=graph)
        self.session = model
        self.source = getattr(model, "source", None) or "<onnxruntime session>"
        self._kept = threading.local()  # each thread's binding for run_in_place
        metadata = getattr(model, "metadata", None)
        # One file of an encoder-decoder pair that mha-deploy exported (its part, its companion, its ids).
        self.pair: EncoderDecoderRecord | None = getattr(model, "pair", None)
        # The ids an mha-deploy file recorded at export (metadata.GenerationIds), generate's defaults.
        self.generation_ids = getattr(metadata, "generation", None) or (self.pair.generation if self.pair else None)
        self.provider_note = getattr(model, "provider_note", "")
        # How an mha-deploy KV-cache file numbers its tokens (metadata.POSITIONS_KINDS), None when it does not say.
        self.positions: str | None = getattr(metadata, "positions", None)
        graph = None
        if isinstance(model, ort.InferenceSession):
            # open_decoder's session keeps the graph it read (no mha-deploy metadata, so the layout is read off it).
            graph = getattr(getattr(model, "graph_proto", None), "graph", None)
            self._run = lambda feeds: dict(zip(self.outputs, model.run(list(self.outputs), feeds), strict=True))
            self.inputs, outputs = ({p.name: _Port(p.name, np.dtype(ORT_TYPES.get(p.type, np.float32)), tuple(p.shape))
                                     for p in ports} for ports in (model.get_inputs(), model.get_outputs()))
        elif hasattr(model, "run") and hasattr(model, "source") and hasattr(model, "output_names"):
            self._run = model.run  # an MHASession: validated on its signature
            # The graph the session read on load (weights left in the file), else read here.
            proto = getattr(model, "graph_proto", None) or read_graph(model.source)
            graph = proto.graph
            self.inputs, outputs = _ports(graph.input), _ports(graph.output)
        else:
            raise OptionError(
                f"a KVCacheStepper runs an MHASession, an onnxruntime.InferenceSession or a file path, not "
                f"{type(model).__name__}"
            )

        self.outputs = tuple(outputs)
        # An InferenceSession that does not say where it came from has no graph to read: holes (give cache_layout=).
        self.cache_layout = read_cache_layout(metadata, self.source if graph is None else graph)
        logits = outputs.get("logits")
        self.logits_dtype = logits.dtype if logits is not None else np.dtype(np.float32)
        vocab = logits.shape[-1] if logits is not None and logits.shape else None
        self.vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else None  # None: the file leaves it open
        # [batch, 1, vocab]: each row's last real token's logits only (exporters.last_token_logits)
        self.last_token_only = logits is not None and len(logits.shape) == 3 and logits.shape[1] == 1

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._run(feeds)

    def run_in_place(self, feeds: dict[str, np.ndarray], caches: dict[str, np.ndarray], in_place: dict[str, str],
                     logits: np.ndarray | None = None, caches_token: object | None = None) -> np.ndarray:
        """The logits of one call whose outputs in ``in_place`` (present -> past) are written into the ``caches``
        arrays (past name -> array), through a binding this thread keeps; written into ``logits`` when given
        (exactly the output's shape and type), else allocated by ORT. ``caches_token``: an object that stands for
        these very cache arrays (the caller makes a new one whenever one of them changes): when this thread's
        binding last bound the caches with it, they are still bound and are not looked at again (24 names for a
        6-layer decoder, checked one by one, were a sixth of a batch-1 step's host time)."""
        kept = getattr(self._kept, "binding", None)
        if kept is None:
            kept = self._kept.binding = (KeptBinding(self.session) if isinstance(self.session, ort.InferenceSession)
                                         else self.session.kept_binding())
        wanted, into = ((), {"logits": logits}) if logits is not None else (("logits",), None)
        if caches_token is not None and kept.caches_token is caches_token:
            in_place = {}  # the caches and their presents are bound as the last call left them
        else:
            feeds = {**feeds, **caches}
            kept.caches_token = None  # until this call has bound them all
        if isinstance(self.session, ort.InferenceSession):
            logits = run_in_place(self.session, feeds, in_place, wanted, kept, into)["logits"]
        else:
            logits = self.session.run_in_place(feeds, in_place, wanted, kept, into)["logits"]
        if in_place:
            kept.caches_token = caches_token
        return logits

    def flushing(self):
        """One denormal scope for many calls of this thread (``MHASession.flushing``); nothing for an ORT session,
        which runs with ORT's own setting."""
        flushing = getattr(self.session, "flushing", None)
        return flushing() if flushing is not None else contextlib.nullcontext()


def open_decoder(path, threads: int | None = None, provider: str = "cpu", session_config: dict | None = None, *,
                 graph: FileGraph | None = None):
    """An mha-deploy file as an ``MHASession`` (its metadata checked), any other ONNX file as an ORT session; both on
    ``provider`` (``providers.PROVIDER_CHOICES``; "cuda" fails loudly where CUDA cannot run, never falls back).
    ``session_config``: ORT session config entries (the server turns thread spinning off). ``graph``: the file's
    graph as ``session_file.read_file_graph`` read it, else read here. The session keeps it (``graph_proto``), where
    a stepper reads its ports: the file's graph is read once."""
    from mha_deploy.runtime.providers import check_providers, plan_providers
    from mha_deploy.runtime.session import MHASession

    graph = graph if graph is not None else _file_graph(path)
    props = {p.key: p.value for p in graph.proto.metadata_props}
    if METADATA_KEY in props:
        return MHASession(path, provider=provider, threads=threads, session_config=session_config, graph=graph)
    pair = EncoderDecoderRecord.from_json(props[ENCODER_DECODER_KEY], str(path)) if ENCODER_DECODER_KEY in props \
        else None
    plan = plan_providers(provider)
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    for key, value in (session_config or {}).items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), options, providers=plan.session_providers())
    check_providers(plan, session)
    session.source, session.provider_note, session.pair = str(path), plan.note, pair
    session.graph_proto = graph.proto
    return session


def encoder_companion(decoder, graph: onnx.ModelProto | None = None) -> tuple[str, int | None] | None:
    """(the encoder file, the recorded decoder start id) of a decoder that mha-deploy exported as one of an
    encoder-decoder pair (``export --kv-cache``: ``mt.onnx`` and ``mt.encoder.onnx``); None for any other file.
    ``ModelFileError`` when the file is the pair's encoder, or its encoder is missing. ``graph``: the file's graph
    as read already (its metadata is what is read), else read here."""
    try:
        props = {p.key: p.value for p in (graph if graph is not None else read_graph(decoder)).metadata_props}
    except Exception:  # not readable here: whoever opens it says why
        return None
    if ENCODER_DECODER_KEY not in props:
        return None
    record = EncoderDecoderRecord.from_json(props[ENCODER_DECODER_KEY], str(decoder))
    companion = os.path.join(os.path.dirname(os.fspath(decoder)), record.companion)
    if record.part == "encoder":
        raise ModelFileError(f"{decoder} is the encoder of an encoder-decoder: give its decoder, {companion}")
    if not os.path.isfile(companion):
        raise ModelFileError(f"{decoder}: its encoder {companion} (written beside it at export) is missing")
    start = record.generation.decoder_start_token_id if record.generation is not None else None
    return companion, start


def _file_graph(path) -> FileGraph:
    """``session_file.read_file_graph`` of ``path``, or ``ModelFileError`` naming what is wrong (missing, not ONNX)."""
    try:
        graph = read_file_graph(path)
        if graph.proto is None:
            onnx.load_from_string(graph.data)  # onnx's own words for what is wrong
    except Exception as exc:  # a missing file, or not ONNX: say which
        raise ModelFileError(f"{path}: not a readable ONNX file: {exc}") from exc
    return graph


def _ports(values) -> dict[str, _Port]:
    """An ONNX graph's inputs or outputs with their element types and declared shapes."""
    ports = {}
    for value in values:
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        ports[value.name] = _Port(value.name, np.dtype(dtype), shape)
    return ports


class KVCacheStepper:
    """A ``TokenStepper`` (``mha_deploy.runtime.generation``) over an ONNX decoder with a KV cache.

    >>> stepper = KVCacheStepper("lm.onnx")                      # or an MHASession / InferenceSession
    >>> generate(stepper, [[5, 7, 9], [4]], max_new_tokens=32).tokens

    ``num_heads`` and ``head_dim`` are read from the cache inputs' shapes; give them when the file leaves
    them symbolic. A path opens on ``provider`` (cpu, cuda or auto; the cache stays in numpy between calls).
    ``generation_ids``: the eos/pad/start ids an mha-deploy file recorded at export (``generate``'s defaults), or
    None. One stepper holds one batch's cache: use one per thread.
    """

    def __init__(
        self,
        model,
        *,
        encoder=None,
        decoder_start_token_id: int | None = None,
        num_heads: int | None = None,
        head_dim: int | None = None,
        threads: int | None = None,
        provider: str = "cpu",
        cache_layout: str | None = None,
    ):
        file_graph = None
        if isinstance(model, str | os.PathLike):
            # Read once: the companion's record, then the session's load and check, the ports, the cache layout.
            file_graph = _file_graph(model)
        if encoder is None and file_graph is not None:
            # A decoder exported with its encoder beside it (own_seq2seq_cache) names it, and its start id.
            found = encoder_companion(model, file_graph.proto)
            if found is not None:
                encoder = found[0]
                decoder_start_token_id = found[1] if decoder_start_token_id is None else decoder_start_token_id
        self.graph = _Graph(model, threads, provider, file_graph)
        self.encoder = _Graph(encoder, threads, provider) if encoder is not None else None
        self.generation_ids = self.graph.generation_ids
        if (encoder is None) != (decoder_start_token_id is None):
            raise OptionError(
                "an encoder-decoder needs both encoder= and decoder_start_token_id=; a decoder-only model neither"
            )
        self.decoder_start_token_id = decoder_start_token_id
        inputs, source = self.graph.inputs, self.graph.source
        self.self_caches = {n: _present(n) for n in inputs if SELF_CACHE.match(n)}
        self.cross_caches = {n: _present(n) for n in inputs if CROSS_CACHE.match(n)}
        unknown = sorted(set(inputs) - DECODER_INPUTS - set(self.self_caches) - set(self.cross_caches))
        if "input_ids" not in inputs or unknown or not self.self_caches:
            raise ModelFileError(
                f"{source}: not a KV-cache decoder in Optimum's naming (inputs {sorted(inputs)}): it needs input_ids "
                f"and past_key_values.{{i}}.key|value" + (f"; {unknown} are not inputs it knows" if unknown else "")
            )
        # An encoder may compute the cross-attention caches itself (present.{i}.encoder.*): the decoder then
        # only reads them.
        encoder_outputs = self.encoder.outputs if self.encoder is not None else ()
        self._cross_from_encoder = bool(self.cross_caches) and all(
            p in encoder_outputs for p in self.cross_caches.values())
        crosses = [] if self._cross_from_encoder else list(self.cross_caches.values())
        missing = [p for p in [*self.self_caches.values(), *crosses, "logits"] if p not in self.graph.outputs]
        if missing:
            raise ModelFileError(f"{source}: outputs {missing} are missing (each past_* input needs its present.*)")
        if self.cross_caches and self.encoder is None:
            raise OptionError(f"{source} has cross-attention caches: give encoder= and decoder_start_token_id=")
        self._cache_shape = _head_shape(inputs, [*self.self_caches, *self.cross_caches], num_heads, head_dim, source)
        self._cache_dtype = inputs[next(iter(self.self_caches))].dtype
        layout = cache_layout or self.graph.cache_layout
        if layout not in (CACHE_RAGGED, CACHE_HOLES):
            raise OptionError(f"cache_layout must be {CACHE_RAGGED!r} or {CACHE_HOLES!r}, got {layout!r}")
        if layout == CACHE_RAGGED and (self.encoder is not None or "attention_mask" not in inputs):
            raise ModelFileError(f"{source}: a ragged cache needs a decoder-only file that takes attention_mask (each "
                                 "row's length)")
        if layout == CACHE_RAGGED and _provider(self.graph.session) != "cpu":
            from mha_deploy.runtime.cuda_support import RAGGED_OFF_CPU

            # The cache lives in host buffers that ORT writes in place (run_in_place binds host memory).
            raise OptionError(f"{source}: provider {_provider(self.graph.session)!r}: {RAGGED_OFF_CPU}")
        self.cache_layout = layout
        self.source_features = _features_input(self.encoder) if self.encoder is not None else None
        # Positions and rows the next allocation holds at least (``reserve``).
        self._reserved = (0, 0)
        # A ragged call's present outputs, each written into its past input's buffer.
        self._in_place = {present: name for name, present in self.self_caches.items()}
        # The logits' last axis, for the array a decode step's logits are written into: the file's, else the first
        # call's (a prefill's logits are allocated by ORT).
        self._logits_width = self.graph.vocab_size
        self._reset(0)

    def _reset(self, rows: int) -> None:
        self._decode_step: _DecodeStep | None = None  # prepared by a decode step, dropped by anything that moves
        self._mask = np.zeros((rows, 0), np.int64)  # [rows, width]: 1 = real token in the cache
        self.past = {name: self._empty(rows) for name in (*self.self_caches, *self.cross_caches)}
        self.encoder_feeds: dict[str, np.ndarray] = {}
        # The ragged layout: each row's tokens so far, and per cache input one buffer [row capacity, heads,
        # capacity, head_dim] that is both the past ORT reads and the present it writes (rows first: the running
        # rows are the contiguous view buffer[:rows]).
        self.lengths = np.zeros(rows, np.int64)
        self.buffers: dict[str, np.ndarray] = {}
        # Per cache input, the view of its buffer the last call fed: the same view object step after step, so that
        # the kept binding (session.KeptBinding) sees at once that nothing moved.
        self._views: dict[str, tuple[np.ndarray, tuple[int, int], np.ndarray]] = {}
        # Those views by cache input, and a token standing for them (a new one whenever one changes): a call with
        # the token its thread's binding last bound binds no cache again (_Graph.run_in_place).
        self._cache_feeds: dict[str, np.ndarray] = {}
        self._caches_token = object()
        # A decode step's logits [rows, 1, vocab], written by every step while the row count stays; the block its
        # mask is written into, and the column numbers the mask compares with each row's length.
        self._step_logits: np.ndarray | None = None
        self._step_mask: np.ndarray | None = None
        self._columns = np.arange(0)
        # A decode step's input_ids and position_ids [rows, 1], kept while the row count stays (_token_feeds).
        self._step_inputs: dict[str, np.ndarray] | None = None

    @property
    def ragged(self) -> bool:
        return self.cache_layout == CACHE_RAGGED

    @property
    def mask(self) -> np.ndarray:
        """[rows, width] int64, 1 = a real token in the cache. Ragged: each row's tokens first, width the longest."""
        if self.ragged:
            return right_padding_mask(self.lengths, int(self.lengths.max(initial=0))).astype(np.int64)
        return self._mask

    @property
    def capacity(self) -> int:
        """Ragged: the positions each row's buffer holds (0 before the first call); holes: the cache width."""
        if self.ragged:
            return next(iter(self.buffers.values())).shape[2] if self.buffers else 0
        return self._mask.shape[1]

    @property
    def row_capacity(self) -> int:
        """Ragged: the rows the buffers hold, running or spare (a join fills spare rows without moving the others)."""
        return next(iter(self.buffers.values())).shape[0] if self.buffers else 0

    def _empty(self, rows: int) -> np.ndarray:
        heads, head_dim = self._cache_shape
        return np.zeros((rows, heads, 0, head_dim), self._cache_dtype)

    @property
    def rows(self) -> int:
        return len(self.lengths) if self.ragged else self._mask.shape[0]

    def reserve(self, positions: int, rows: int | None = None) -> None:
        """Size the ragged cache for ``positions`` tokens per row (a caller that knows prompt + max_new_tokens) and
        ``rows`` rows: the buffers are allocated once at that size, or grown now (one copy of what is in use)
        instead of doubling later. Nothing for the holes layout, whose cache is the last call's present."""
        if not isinstance(positions, int | np.integer) or positions < 1:
            raise OptionError(f"reserve takes a positive number of positions, got {positions!r}")
        if not self.ragged:
            return
        self._reserved = (int(positions), int(rows or 0))
        if self.buffers:
            # Reallocated (when short) at exactly what is asked, which may be fewer positions than held now.
            self._ensure(max(self.rows, self._reserved[1]), max(int(positions), int(self.lengths.max(initial=0))),
                         grow=False)

    def flushing(self):
        """One denormal scope for many calls of this thread (``MHASession.flushing``): what ``generate`` enters once
        for a whole generation."""
        return self.graph.flushing()

    # --- the TokenStepper protocol -------------------------------------------------------------

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, every_position: bool = False,
                decoder_input_ids: np.ndarray | None = None) -> np.ndarray:
        """The prompts' cache; returns each row's last real token's logits [rows, vocab], or with ``every_position``
        the logits at every column the call fed [rows, seq, vocab] (what a prompt's own log probabilities need; the
        file computes them anyway): a padded prompt's padding columns hold no meaning (a ragged prefill moves each
        row's tokens to the front first), and an encoder-decoder's one column is its start token's.
        ``decoder_input_ids`` int64 [rows, length] (an encoder-decoder's): the decoder starts from these instead
        of the start id alone (its decoder prompt, start id included), unpadded."""
        self._check_every_position(every_position)
        if self.source_features is not None:  # the encoder's features, every item of one size: no mask to read
            features = check_features(self.source_features, input_ids)
            attention_mask = np.ones((len(features), 1), np.int64)
            input_ids = features
        else:
            input_ids = np.asarray(input_ids, np.int64)
            attention_mask = np.asarray(attention_mask, np.int64)
        if self.source_features is None and (input_ids.ndim != 2 or attention_mask.shape != input_ids.shape):
            raise InputError(
                f"input_ids and attention_mask must both be [batch, seq], got {input_ids.shape} and "
                f"{attention_mask.shape}"
            )
        if self.encoder is None:
            self._check_vocabulary(input_ids, attention_mask)
            if "attention_mask" not in self.graph.inputs and not attention_mask.all():
                raise InputError(
                    f"{self.graph.source} takes no attention_mask, so it cannot tell padding from tokens: give "
                    "prompts of one length (or one prompt per call)"
                )
        if self.ragged:
            return self._prefill_ragged(input_ids, attention_mask, every_position)
        self._reset(len(input_ids))
        if decoder_input_ids is not None and self.encoder is None:
            raise InputError("decoder_input_ids are an encoder-decoder's decoder prompt: this model has no encoder")
        if self.encoder is not None:
            self.encoder_feeds = self._encode(input_ids, attention_mask)
            rows = len(input_ids)
            if decoder_input_ids is None:
                input_ids = np.full((rows, 1), self.decoder_start_token_id, np.int64)
            else:
                input_ids = np.asarray(decoder_input_ids, np.int64)
                if input_ids.ndim != 2 or len(input_ids) != rows or input_ids.shape[1] == 0:
                    raise InputError(f"decoder_input_ids must be [rows={rows}, length >= 1], got {input_ids.shape}")
            attention_mask = np.ones_like(input_ids)
        return self._call(input_ids, attention_mask, first=True, every_position=every_position)

    @property
    def last_token_only(self) -> bool:
        """Whether the file computes each row's last real token's logits only ([batch, 1, vocab]): ``every_position``
        is then refused."""
        return self.graph.last_token_only

    def _check_every_position(self, every_position: bool) -> None:
        if every_position and self.graph.last_token_only:
            raise ModelFileError(
                f"{self.graph.source} computes each row's last token's logits only (logits [batch, 1, vocab], exported "
                "with --logits last): scoring every position of a prompt needs them all; export the model again with "
                "--logits all")

    def _check_vocabulary(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> None:
        """Refuse prompts with ids the embedding has no row for (ORT would fail in a Gather, naming no prompt).
        The logits say how large a decoder-only model's vocabulary is (an encoder's may differ)."""
        vocab = self.graph.vocab_size
        if vocab is None:
            return
        bad = np.flatnonzero(((input_ids >= vocab) & (attention_mask != 0)).any(axis=1))
        if bad.size:
            raise InputError(
                f"prompts {bad.tolist()} hold token ids past the vocabulary of {self.graph.source} ({vocab} ids, 0 to "
                f"{vocab - 1}): was the prompt tokenized for another model?"
            )

    def step(self, next_ids: np.ndarray) -> np.ndarray:
        """Append one token per running row (int64 [rows]); returns each row's next-token logits [rows, vocab]. On
        a ragged cache they lie in an array of the stepper's that its next call overwrites: copy what you keep."""
        prepared = self._decode_step
        if prepared is not None and prepared.ready(next_ids):
            return prepared(next_ids)
        next_ids = np.asarray(next_ids, np.int64).reshape(-1, 1)
        if len(next_ids) != self.rows or self.rows == 0:
            raise InputError(f"step takes one token per running row ({self.rows}), got {len(next_ids)}")
        if self.ragged:
            return self._ragged_call(slice(0, self.rows), next_ids, self.lengths + 1, first=False)
        return self._call(next_ids, np.ones_like(next_ids), first=False)

    # --- beyond the protocol: what a server's continuous batching needs ----------------------------

    def extend(self, input_ids: np.ndarray, every_position: bool = False) -> np.ndarray:
        """Append several real tokens to every row (int64 [rows, seq]), as a long prompt prefilled in chunks does
        after ``prefill`` of its first chunk; returns the logits of each row's last token [rows, vocab], or with
        ``every_position`` of each token [rows, seq, vocab]."""
        self._check_every_position(every_position)
        input_ids = np.asarray(input_ids, np.int64)
        if input_ids.ndim != 2 or input_ids.shape[0] != self.rows or self.rows == 0 or input_ids.shape[1] == 0:
            raise InputError(f"extend takes [rows={self.rows}, seq >= 1] token ids, got shape {input_ids.shape}")
        if self.encoder is None:
            self._check_vocabulary(input_ids, np.ones_like(input_ids))
        if self.ragged:
            # ORT's GroupQueryAttention takes several tokens after a past for one row at a time: each row in its
            # own call, on its own rows of the buffers (a view, nothing copied).
            seq = input_ids.shape[1]
            if seq == 1 or self.rows == 1:
                return self._ragged_call(slice(0, self.rows), input_ids, self.lengths + seq, False, every_position)
            return np.concatenate([
                self._ragged_call(slice(r, r + 1), input_ids[r : r + 1], self.lengths[r : r + 1] + seq, False,
                                  every_position)
                for r in range(self.rows)])
        return self._call(input_ids, np.ones_like(input_ids), first=False, every_position=every_position)

    def fork(self) -> KVCacheStepper:
        """An empty stepper over the same files and sessions (nothing loaded twice): a server prefills a new
        request in one, then ``join``s it to the running rows."""
        twin = copy.copy(self)
        twin._reserved = (0, 0)
        twin._reset(0)
        return twin

    def join(self, other: KVCacheStepper) -> None:
        """Append ``other``'s rows (same graph) after this stepper's (``other`` is left empty).

        The self-attention caches share one width: the narrower side gets masked holes on the left, zero keys and
        values that no token attends to; positions come from each row's count of real tokens (``position_ids``), so
        a file that takes them continues every row as it would alone. A file with its own positions over the cache
        width does not (``mixes_lengths_exactly``), and a file without ``attention_mask`` cannot mask holes at all: join
        only rows of one width there. An encoder-decoder's sources (encoder states, cross-attention caches) are
        padded on the right to the longest, masked by ``encoder_attention_mask``; a decoder without that input takes
        only rows of one source length."""
        if other.graph is not self.graph:
            raise OptionError("join takes rows of a stepper forked from this one (same graph)")
        if other.rows == 0:
            return
        if self.ragged:
            self._join_ragged(other)
            return
        if self.rows == 0:
            self._mask, self.past, self.encoder_feeds = other._mask, other.past, other.encoder_feeds
            other._reset(0)
            return
        inputs = self.graph.inputs
        width = max(self._mask.shape[1], other._mask.shape[1])
        if "attention_mask" not in inputs and self._mask.shape[1] != other._mask.shape[1]:
            raise OptionError(f"{self.graph.source} takes no attention_mask: only rows of one length can join")
        source = self.source_width, other.source_width
        if source[0] != source[1] and "encoder_attention_mask" not in inputs:
            raise OptionError(f"{self.graph.source} takes no encoder_attention_mask: only rows of one source length "
                              "can join")

        def padded(array: np.ndarray, axis: int, size: int, left: bool) -> np.ndarray:
            pad = [(0, 0)] * array.ndim
            pad[axis] = (size - array.shape[axis], 0) if left else (0, size - array.shape[axis])
            return np.pad(array, pad) if any(pad[axis]) else array

        self._mask = np.concatenate([padded(self._mask, 1, width, True), padded(other._mask, 1, width, True)])
        longest = max(source)
        for name in self.past:
            ours, theirs = self.past[name], other.past[name]
            if name in self.self_caches:
                self.past[name] = np.concatenate([padded(ours, 2, width, True), padded(theirs, 2, width, True)])
            else:  # a cross-attention cache: [rows, heads, source, head_dim]
                self.past[name] = np.concatenate([padded(ours, 2, longest, False), padded(theirs, 2, longest, False)])
        for name in self.encoder_feeds:  # [rows, source(, d)]: zeros past a row's source, masked
            self.encoder_feeds[name] = np.concatenate([padded(self.encoder_feeds[name], 1, longest, False),
                                                       padded(other.encoder_feeds[name], 1, longest, False)])
        other._reset(0)

    @property
    def source_width(self) -> int:
        """An encoder-decoder's source length as its rows hold it (0 for a decoder-only model)."""
        states = self.encoder_feeds.get("encoder_hidden_states")
        if states is not None:
            return states.shape[1]
        return next((self.past[name].shape[2] for name in self.cross_caches), 0)

    @property
    def cache_positions(self) -> int:
        """Positions the self-attention cache holds now: holes, rows x width, holes included; ragged, the buffers'
        row capacity x capacity (spare rows and the positions not yet written included: what its memory is)."""
        if self.ragged:
            return self.row_capacity * self.capacity
        return int(self._mask.size)

    def keep(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64).ravel()
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise InputError(f"rows {rows.tolist()} out of range for {self.rows} running rows")
        if rows.size == self.rows and np.array_equal(rows, np.arange(self.rows)):
            return
        if self.ragged:
            self._keep_ragged(rows)
            return
        mask = self._mask[rows]
        # Columns before every remaining row's first real token hold nothing any row reads: drop them too.
        start = int(np.argmax(mask.any(axis=0))) if mask.size else 0
        self._mask = np.ascontiguousarray(mask[:, start:])
        for name, cache in self.past.items():
            kept = cache[rows]  # a copy: the rows left out are freed with the old array
            self.past[name] = np.ascontiguousarray(kept[:, :, start:]) if name in self.self_caches and start else kept
        self.encoder_feeds = {name: value[rows] for name, value in self.encoder_feeds.items()}

    # --- the ragged layout -----------------------------------------------------------------------

    def _prefill_ragged(self, input_ids: np.ndarray, attention_mask: np.ndarray, every_position: bool) -> np.ndarray:
        """Each row's real tokens (wherever its padding was) moved to the front, padded on the right."""
        real = attention_mask != 0
        lengths = real.sum(axis=1).astype(np.int64)
        if (lengths == 0).any():
            raise InputError(f"prompts {np.flatnonzero(lengths == 0).tolist()} have no real token")
        width = int(lengths.max())
        ids = np.zeros((len(input_ids), width), np.int64)
        ids[right_padding_mask(lengths, width)] = input_ids[real]  # row-major: each row's in order
        positions, rows = self._reserved
        if not self.buffers or self.row_capacity < max(len(ids), rows) or self.capacity < max(width, positions):
            self.buffers = {}  # a fresh cache: nothing of the last one is kept
        self.lengths = np.zeros(len(ids), np.int64)
        self._ensure(len(ids), width, grow=False)
        return self._ragged_call(slice(0, len(ids)), ids, lengths, True, every_position)

    def _ensure(self, rows: int, positions: int, grow: bool = True) -> None:
        """Buffers of at least ``rows`` rows and ``positions`` positions. Growing copies the running rows' positions
        in use into the new buffers, the only copy of the cache there is; ``grow`` doubles what is short, so that
        a cache that grows token by token is copied a logarithmic number of times (without ``grow``, the new buffers
        are exactly as large as asked and reserved)."""
        reserved_positions, reserved_rows = self._reserved
        have_rows, have_positions = self.row_capacity, self.capacity
        if self.buffers and have_rows >= rows and have_positions >= positions:
            return
        self._decode_step = None
        new_rows = max(rows, reserved_rows, (2 * have_rows if have_rows < rows else have_rows) if grow else 0)
        new_positions = max(positions, reserved_positions,
                            (2 * have_positions if have_positions < positions else have_positions) if grow else 0)
        heads, head_dim = self._cache_shape
        used, width = self.rows, int(self.lengths.max(initial=0))
        for name in self.self_caches:
            buffer = np.empty((new_rows, heads, new_positions, head_dim), self._cache_dtype)
            buffer.fill(0)  # pages written now (a cache costs its memory up front) and no stale NaN
            if name in self.buffers and used and width:
                buffer[:used, :, :width] = self.buffers[name][:used, :, :width]
            self.buffers[name] = buffer

    def _ragged_call(
        self, rows: slice, input_ids: np.ndarray, lengths: np.ndarray, first: bool, every_position: bool = False
    ) -> np.ndarray:
        """One call on ``rows`` of the buffers: ``input_ids`` [n, seq] are each row's next tokens (a first call's
        rows right-padded), ``lengths`` [n] each row's tokens after it. Present is written into past's buffer."""
        self._decode_step = None
        inputs = self.graph.inputs
        count, seq = input_ids.shape
        total = int(lengths.max())
        self._ensure(max(self.rows, rows.stop), total)
        logits_out = None
        if seq == 1 and not every_position and self._logits_width:
            feeds = self._token_feeds(input_ids, lengths, total)
            # The logits written into an array of ours, so that ORT's outputs are never read back (session.
            # run_in_place): the same array step after step (bound once; binding a new one cost a tenth of a
            # batch-1 step's host time), so a step's logits are overwritten by the next call (``step`` says so).
            logits_out = self._step_logits
            if logits_out is None or len(logits_out) != count:
                logits_out = self._step_logits = np.empty((count, 1, self._logits_width), self.graph.logits_dtype)
        else:
            feeds = {
                "input_ids": np.ascontiguousarray(input_ids, inputs["input_ids"].dtype),
                "attention_mask": right_padding_mask(lengths, total).astype(inputs["attention_mask"].dtype),
            }
            if "position_ids" in inputs:
                # A first call numbers every column from 0 (a row's padding after its tokens is never read); later
                # calls continue each row from its own length.
                start = np.zeros_like(lengths) if first else lengths - seq
                feeds["position_ids"] = (start[:, None] + np.arange(seq)[None, :]).astype(inputs["position_ids"].dtype)
        views, span, caches = self._views, (rows.start, rows.stop), self._cache_feeds
        for name in self.self_caches:
            buffer = self.buffers[name]
            view = views.get(name)
            if view is None or view[0] is not buffer or view[1] != span:
                view = views[name] = (buffer, span, buffer[rows])  # [n, heads, capacity, head_dim], contiguous
                caches[name] = view[2]
                self._caches_token = object()  # another array to bind: the binding's token no longer holds
        if logits_out is None:
            logits = self.graph.run_in_place(feeds, caches, self._in_place, caches_token=self._caches_token)
            self._logits_width = logits.shape[-1]
        else:
            logits = self.graph.run_in_place(feeds, caches, self._in_place, logits_out, self._caches_token)
        self.lengths[rows] = lengths
        if logits_out is not None and rows.start == 0 and rows.stop == len(self.lengths):
            self._decode_step = _DecodeStep.prepared(self, feeds, logits_out, total)
        if every_position:
            return np.asarray(logits, np.float32)
        if seq == 1 or self.graph.last_token_only:
            return np.asarray(logits[:, 0, :], np.float32)  # a view of the array written (fp32): nothing copied
        # Each row's last real token: a first call's row ends at its length, a later call's at its last column.
        last = lengths - 1 if first else np.full(len(lengths), seq - 1)
        return np.asarray(logits[np.arange(len(last)), last, :], np.float32)

    def _token_feeds(self, input_ids: np.ndarray, lengths: np.ndarray, total: int) -> dict[str, np.ndarray]:
        """The inputs of a one-token call (a decode step), in arrays kept from step to step while the row count
        stays: the same arrays are bound once (session.KeptBinding) and written in place here; only the mask, one
        column wider every step, is a new array."""
        inputs = self.graph.inputs
        count = len(input_ids)
        kept = self._step_inputs
        if kept is None or len(kept["input_ids"]) != count:
            kept = self._step_inputs = {name: np.empty((count, 1), inputs[name].dtype)
                                        for name in ("input_ids", "position_ids") if name in inputs}
        np.copyto(kept["input_ids"], input_ids, casting="unsafe")
        feeds = dict(kept)
        if "position_ids" in kept:
            np.subtract(lengths[:, None], 1, out=kept["position_ids"], casting="unsafe")  # the token's position
        # The mask written into the front of one kept block, [count, total] (a view: contiguous however wide),
        # instead of two new arrays a step.
        block, columns = self._step_mask, self._columns
        if block is None or block.size < count * total:
            block = self._step_mask = np.empty(count * max(total, self.capacity), inputs["attention_mask"].dtype)
        if len(columns) < total:
            columns = self._columns = np.arange(max(total, self.capacity))
        mask = block[: count * total].reshape(count, total)
        np.less(columns[:total], lengths[:, None], out=mask)
        feeds["attention_mask"] = mask
        return feeds

    def _keep_ragged(self, rows: np.ndarray) -> None:
        """Rows ``rows`` of the buffers, in that order, written in place: only the rows that change place are copied
        (one row for a swap-remove), and only the positions their tokens use. Where the row count stays (beam
        search's reordering every step) the lengths are written in place too, and a prepared decode step stays
        prepared: it reads them from that array, and nothing it binds moved."""
        lengths = self.lengths[rows]
        if len(rows) != len(self.lengths):
            self._decode_step = None
        if len(rows) > self.row_capacity:
            self._ensure(len(rows), self.capacity)
        moved = np.flatnonzero(rows != np.arange(len(rows)))
        if moved.size:
            width = int(self.lengths[rows[moved]].max())
            for buffer in self.buffers.values():
                # The sources first (a copy of the moved rows only): a destination may be another's source.
                buffer[moved, :, :width] = buffer[rows[moved], :, :width]
        if self._decode_step is not None:
            self.lengths[:] = lengths
        else:
            self.lengths = lengths

    def _join_ragged(self, other: KVCacheStepper) -> None:
        """``other``'s rows into this one's spare rows: the running rows stay where they are."""
        self._decode_step = None
        if not self.buffers and not any(self._reserved):
            self.lengths, self.buffers = other.lengths, other.buffers  # nothing here yet: take its buffers whole
            other._reset(0)
            return
        start, count = self.rows, other.rows
        width = int(other.lengths.max())
        self._ensure(start + count, max(width, int(self.lengths.max(initial=0))))
        for name, buffer in self.buffers.items():
            buffer[start : start + count, :, :width] = other.buffers[name][:count, :, :width]
        self.lengths = np.concatenate([self.lengths, other.lengths])
        other._reset(0)

    # --- calls ---------------------------------------------------------------------------------

    def _encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        ports = self.encoder.inputs
        if self.source_features is not None:
            outputs = self.encoder.run({self.source_features.name: input_ids})
            for name, present in self.cross_caches.items():
                self.past[name] = outputs[present]
            return {}
        feeds = {"input_ids": input_ids.astype(ports["input_ids"].dtype)}
        if "attention_mask" in ports:
            feeds["attention_mask"] = attention_mask.astype(ports["attention_mask"].dtype)
        outputs = self.encoder.run(feeds)
        if self._cross_from_encoder:
            for name, present in self.cross_caches.items():
                self.past[name] = outputs[present]
        hidden = outputs.get("last_hidden_state", next(iter(outputs.values())))
        wanted = {"encoder_hidden_states": hidden, "encoder_attention_mask": attention_mask}
        return {name: value for name, value in wanted.items() if name in self.graph.inputs}

    def _call(
        self, input_ids: np.ndarray, new_mask: np.ndarray, first: bool, every_position: bool = False
    ) -> np.ndarray:
        inputs = self.graph.inputs
        mask = np.concatenate([self._mask, new_mask], axis=1)
        feeds = {"input_ids": input_ids.astype(inputs["input_ids"].dtype, copy=False), **self.past}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = mask.astype(inputs["attention_mask"].dtype, copy=False)
        if "position_ids" in inputs:
            # Each token's position among its row's real tokens: holes left by padding take no position.
            positions = np.cumsum(mask, axis=1)[:, -input_ids.shape[1] :] - 1
            feeds["position_ids"] = np.maximum(positions, 0).astype(inputs["position_ids"].dtype)
        if "use_cache_branch" in inputs:
            feeds["use_cache_branch"] = np.array([not first])
        for name, value in self.encoder_feeds.items():
            feeds[name] = value.astype(inputs[name].dtype, copy=False)
        outputs = self.graph.run(feeds)
        self._mask = mask
        for name, present in self.self_caches.items():
            self.past[name] = outputs[present]
        if first:  # the encoder's keys and values: computed now, passed back unchanged after
            for name, present in ({} if self._cross_from_encoder else self.cross_caches).items():
                self.past[name] = outputs[present]
            self._zero_holes()
        if every_position:
            return np.asarray(outputs["logits"], np.float32)
        if self.graph.last_token_only:  # the file computed each row's last real token's only
            return np.asarray(outputs["logits"][:, 0, :], np.float32)
        # Each row's last real new token: a right-padded prompt's last column is padding.
        last = new_mask.shape[1] - 1 - np.argmax(new_mask[:, ::-1] != 0, axis=1)
        return np.asarray(outputs["logits"][np.arange(len(last)), last, :], np.float32)

    def _zero_holes(self) -> None:
        """Zeros where the prompt was padding, in every self-attention cache. A padded position's keys and values
        are masked for every real token, but a graph may compute NaN there (a query row with no key to attend
        to), and a masked NaN value still poisons the weighted sum (0 * NaN). Holes appear in the prompt only."""
        rows, columns = np.nonzero(self._mask == 0)
        if rows.size:
            for name in self.self_caches:
                self.past[name][rows, :, columns, :] = 0


class _DecodeStep:
    """A ragged decode step prepared by the last one (``KVCacheStepper._ragged_call``), for a loop whose rows and
    buffers stay put: the same kept arrays are written in place (each row's token, position and mask) and the
    call runs through the binding as the last step left it, only the mask bound anew (one column wider). What the
    general step does (validating, sizing, finding what to bind) costs a batch-1 step about 0.3 ms of host time
    after ORT's run has pushed the loop's memory out of the caches: a quarter of an int4 step.

    It is used only while nothing else moved: the stepper drops it on any other call, ``keep``, ``join`` or
    growth; it declines (``ready`` False: the general step runs) when another caller on this thread bound other
    arrays since, when the cache is full, when the row count differs, or outside the denormal scope its session's
    calls need."""

    def __init__(self, stepper: KVCacheStepper, kept: KeptBinding, feeds: dict[str, np.ndarray], logits: np.ndarray,
                 total: int):
        graph = stepper.graph
        self.kept = kept
        self._local = graph._kept
        self._session = graph.session
        ort_session = self._session if isinstance(self._session, ort.InferenceSession) else self._session._session
        self._run = ort_session.run_with_iobinding
        self._flushed = getattr(self._session, "flushed_here", None)
        self.lengths = stepper.lengths  # the stepper's own array, advanced in place
        self._lengths_column = self.lengths[:, None]
        self._ids = feeds["input_ids"][:, 0]
        self._positions = feeds["position_ids"][:, 0] if "position_ids" in feeds else None
        self._mask_block = stepper._step_mask
        self._columns = stepper._columns
        self._rows = len(self.lengths)
        self._total = total
        self._room = min(stepper.capacity, len(stepper._columns), len(self._mask_block) // self._rows)
        # [rows, vocab], a view of the array the call writes: what step returns where the file's logits are float32
        # (np.asarray of it would be that view, at the cost of a call).
        self._logits = logits[:, 0, :]
        self._logits_float32 = self._logits.dtype == np.float32
        # One row (batch-1 decoding): its length is the cache's width (``total`` is the rows' longest), so its mask
        # is all ones, a slice of a kept row of them, and its length is written as the new width: the step runs no
        # numpy arithmetic (each kind of numpy call, the first time after ORT's run has pushed numpy out of the
        # caches, cost ~10-20 us of a ~1.5 ms int4 step).
        self._ones = np.ones((1, self._room), self._mask_block.dtype) if self._rows == 1 else None

    @classmethod
    def prepared(cls, stepper: KVCacheStepper, feeds, logits: np.ndarray, total: int) -> _DecodeStep | None:
        kept = getattr(stepper.graph._kept, "binding", None)
        if kept is None or "attention_mask" not in feeds:
            return None
        step = cls(stepper, kept, feeds, logits, total)
        kept.owner = step
        kept.forget("attention_mask")  # bound anew by every prepared step, behind the binding's record
        return step

    def ready(self, next_ids) -> bool:
        # Only one id per row as a vector: another shape (one row's scalar, [rows, 1]) is the general step's to read
        # or refuse.
        return (self.kept.owner is self and self._total < self._room and isinstance(next_ids, np.ndarray)
                and next_ids.shape == (self._rows,) and getattr(self._local, "binding", None) is self.kept
                and (self._flushed is None or self._session.flushed_here))

    def __call__(self, next_ids: np.ndarray) -> np.ndarray:
        self._ids[:] = next_ids  # ready() checked: an array of one id per row
        lengths = self.lengths
        if self._positions is not None:
            np.copyto(self._positions, lengths)  # the new token's position: the row's length before it
        total = self._total + 1
        if self._ones is not None:
            mask = self._ones[:, :total]
        else:
            mask = self._mask_block[: self._rows * total].reshape(self._rows, total)
            np.less_equal(self._columns[:total], self._lengths_column, out=mask)  # up to the new token, at its length
        self.kept.binding.bind_cpu_input("attention_mask", mask)
        self._run(self.kept.binding)
        # Advanced once the call has run, as the general step does: a call that fails (a token id past the
        # vocabulary) leaves the rows as they were, and the next step continues them.
        if self._ones is not None:
            lengths[0] = total
        else:
            lengths += 1
        self._total = total
        return self._logits if self._logits_float32 else np.asarray(self._logits, np.float32)


def _features_input(encoder: _Graph) -> TensorSpec | None:
    """The encoder's source when it is features of a fixed size (Whisper's ``input_features`` [batch, mel,
    frames]: one float input, every axis but the batch fixed), as the one validator's spec; None for token ids."""
    ports = list(encoder.inputs.values())
    if "input_ids" in encoder.inputs or len(ports) != 1:
        return None
    port = ports[0]
    sizes = tuple(port.shape[1:])
    if port.dtype.kind != "f" or not sizes or not all(isinstance(size, int) and size > 0 for size in sizes):
        return None
    role = AUDIO if len(sizes) == 2 else IMAGE
    return TensorSpec(port.name, role, port.dtype.name, ("batch", *sizes))


def check_features(spec: TensorSpec, value) -> np.ndarray:
    """A batch of an encoder's features: ``spec``'s float dtype, [batch, <its sizes>], finite; ``InputError`` naming
    what is wrong otherwise (the sizes through ``validation.fixed_shape_problem``, as infer and serve check them)."""
    from mha_deploy.runtime.validation import fixed_shape_problem

    array = np.asarray(value)
    if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
        raise InputError(f"{spec.name} must be {spec.dtype} features, got {array.dtype}")
    if array.ndim == 0 or array.shape[0] == 0:
        raise InputError(f"{spec.name} is empty (shape {array.shape}): give at least one item's features")
    problem = fixed_shape_problem(spec, array.shape[1:])
    if problem is not None:
        raise InputError(f"{problem.message} (batch shape {array.shape})")
    array = array.astype(spec.dtype, copy=False)
    if not np.isfinite(array).all():
        raise InputError(f"{spec.name} contains NaN or Inf")
    return np.ascontiguousarray(array)


def _provider(session) -> str:
    """"cpu" or another provider: an MHASession says which, an ORT session lists its providers (first preferred)."""
    if isinstance(session, ort.InferenceSession):
        return "cpu" if session.get_providers()[0] == "CPUExecutionProvider" else session.get_providers()[0]
    return getattr(session, "provider", "cpu")


def _present(past_name: str) -> str:
    return "present." + past_name.removeprefix("past_key_values.")


def _head_shape(inputs: dict[str, _Port], caches: list[str], num_heads, head_dim, source: str) -> tuple[int, int]:
    """(heads, head_dim) of the caches: as given, else read off the cache inputs' declared shapes."""
    shape = inputs[caches[0]].shape
    if len(shape) != 4:
        raise ModelFileError(f"{source}: {caches[0]} must be [batch, heads, past, head_dim], declared {shape}")
    heads = num_heads if num_heads is not None else shape[1]
    size = head_dim if head_dim is not None else shape[3]
    if not isinstance(heads, int) or not isinstance(size, int):
        raise OptionError(
            f"{source}: {caches[0]} declares its shape as {shape}; give num_heads= and head_dim= to size an empty cache"
        )
    return heads, size


def mixes_lengths_exactly(stepper: KVCacheStepper) -> bool:
    """Whether rows of different lengths can share the stepper's cache (``serve``'s cohorts, ``generate``'s padded
    prompt batches) and still get the tokens they get alone. A ragged cache: always, each row at its own length with
    its own positions, no hole anywhere (the export writes that layout only for a file taking position_ids or whose
    positions it measured as none). Holes: the file masks them (``attention_mask``; an encoder-decoder's shorter
    sources too, ``encoder_attention_mask``) and takes ``position_ids``, which the stepper counts over each row's real
    tokens (a file's own positions over the cache width would shift by the holes), or its export measured that
    padding does not change a row (metadata positions "none": a model without positions). A file whose export
    measured that its rows move with their padding even given their own positions (metadata positions
    "padded-width") mixes only rows of one length."""
    if stepper.ragged:
        return True
    inputs = stepper.graph.inputs
    masks = "attention_mask" in inputs and (stepper.encoder is None or "encoder_attention_mask" in inputs)
    positions = stepper.graph.positions
    return masks and (("position_ids" in inputs and positions != POSITIONS_PADDED_WIDTH) or positions == POSITIONS_NONE)
