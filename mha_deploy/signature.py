"""The exported model's I/O contract: every input and output, its role, dtype and named axes.

The one description of what a model takes and returns. The exporter traces and
declares dynamic axes from it, ``MHASession`` validates feeds and builds warm-up
inputs from it, the batch planner pads and cuts by its axes, the HTTP server and
Triton describe tensors with it, and parity, bench and tests generate inputs
from it. Adding an input kind means adding its ``TensorSpec`` here and the code
that computes it in the graph.

No torch and no onnx here: both sides of the file boundary import this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from mha_deploy.errors import SignatureError

ATTENTION_KINDS = ("self", "cross")
# A lone reference MHA, a post-norm Transformer stack built from it, or a user's own model built around the
# attention ("custom": its tensors are declared at export, not derived from the mask mode).
MODEL_KINDS = ("mha", "encoder", "decoder", "custom")
MASK_MODES = ("none", "padding", "causal", "padding-causal")

# Roles of a tensor in the contract.
SEQUENCE = "sequence"  # float [batch, <sequence axis>, d_model] (a custom model's: [batch, <axis>, features])
TOKENS = "tokens"  # int64 [batch, <sequence axis>]: token ids (custom models)
# bool [batch, <sequence axis>], True = real token; or int64 1/0 (a Hugging Face tokenizer's attention_mask: what the
# files ``export --hf`` writes take, and a causal LM's with a cache), cast inside the graph.
PADDING_MASK = "padding_mask"
MASK_DTYPES = ("bool", "int64")
# Segment ids (BERT's token_type_ids): int64 [batch, <a tokens input's axis>], indexing a table of their own.
SEGMENTS = "segments"
# Whole-item inputs, every size but the batch fixed by the model: no length axis, so nothing to pad or mask.
IMAGE = "image"  # float [batch, channels, height, width] (pixel_values)
AUDIO = "audio"  # float [batch, mel, frames] (Whisper's input_features)
OUTPUT = "output"  # float [batch, <query axis>, d_model]; a custom model's per token or per item (see ``per_token``)
# A per-token output computed at one position per row: [batch, 1, ...], the row's last real token of the call (a
# KV-cache LM's logits exported with --logits last, exporters.last_token_logits: what a generator reads).
LAST_TOKEN = "last_token"
WEIGHTS = "weights"  # float [batch, heads, <query axis>, <key axis>]: the softmax probabilities
# A KV-cache model's keys/values of earlier calls, in and out: float [batch, heads, <length axis>, d_k].
PAST = "past"  # past_key / past_value: the cache so far (length past_seq, 0 on the first call)
PRESENT = "present"  # present_key / present_value: past ++ the new tokens' keys/values (length total_seq)

# Axes whose size is fixed by the model (recorded in its metadata); every other axis is dynamic.
FIXED_AXES = ("d_model", "heads", "d_k")
BATCH_AXIS = "batch"
# KV cache: the cached length and the length after this call (past_seq + seq), the cache grows along them.
PAST_AXIS, TOTAL_AXIS = "past_seq", "total_seq"
# A decoder's cross-attention cache: the memory's keys/values, 0 long on the first call (they are computed
# from memory then), mem_seq long on every later call (passed back; memory's values are then not read).
ENCODER_PAST_AXIS, MEMORY_AXIS = "past_mem_seq", "mem_seq"
# past input -> the present output the next call feeds back into it (Optimum's names for a lone attention).
CACHE_PAIRS = {"past_key": "present_key", "past_value": "present_value"}
# A decoder stack's caches per layer i: past_key_values.{i}.<kind> -> present.{i}.<kind> (Optimum's naming).
SELF_CACHE_KINDS, ENCODER_CACHE_KINDS = ("key", "value"), ("encoder_key", "encoder_value")
# dtype of a float tensor: whatever the model was exported in (float32, or float16).
MODEL_DTYPE = "model"
# Inputs whose axis 1 is a length axis that items are batched (padded, masked, cut) along.
LENGTH_ROLES = (TOKENS, SEQUENCE, SEGMENTS, PADDING_MASK)
# Inputs of fixed item shape ([batch, <ints>]): a batch of them stacks, never pads.
FIXED_SHAPE_ROLES = (IMAGE, AUDIO)
# Ids that index an embedding table: int64, each input its own vocabulary (the rows of the table it indexes).
ID_ROLES = (TOKENS, SEGMENTS)
# The roles a custom model's inputs may have (the CLI spells padding_mask "padding-mask").
INPUT_ROLES = (*LENGTH_ROLES, *FIXED_SHAPE_ROLES)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the contract."""

    name: str
    role: str
    dtype: str  # MODEL_DTYPE, "bool" or "int64"
    # e.g. ("batch", "seq", "d_model"); a custom model's fixed sizes are ints: ("batch", "seq", 80), ("batch", 3)
    axes: tuple[str | int, ...]
    marks: str | None = None  # padding masks: the sequence input whose positions it marks
    # Token or segment ids: the rows of the table they index (ids must be in [0, vocab)); None when unknown.
    vocab: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))  # a list when read back from JSON

    @property
    def sequence_axis(self) -> str | None:
        """The length axis of a sequence input, token or segment ids or padding mask (axis 1), else None (an
        image or audio input has none)."""
        return self.axes[1] if self.role in LENGTH_ROLES else None

    @property
    def dynamic_axes(self) -> dict[int, str]:
        """Position -> name of every axis whose size varies from call to call."""
        return {i: axis for i, axis in enumerate(self.axes) if isinstance(axis, str) and axis not in FIXED_AXES}

    def numpy_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.dtype == MODEL_DTYPE else self.dtype

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The concrete shape for axis sizes ``sizes`` (name -> size; must cover every named axis)."""
        return tuple(axis if isinstance(axis, int) else int(sizes[axis]) for axis in self.axes)

    def dims(self, sizes: Mapping[str, int], dynamic: int = -1) -> tuple[int, ...]:
        """The shape with ``dynamic`` (Triton and the v2 protocol use -1) for every dynamic axis."""
        dynamic_axes = self.dynamic_axes
        return tuple(
            dynamic if i in dynamic_axes else axis if isinstance(axis, int) else int(sizes[axis])
            for i, axis in enumerate(self.axes)
        )

    def item_shape(self, length: int, fixed: Mapping[str, int]) -> tuple[int, ...]:
        """One item's shape (no batch axis) with ``length`` positions: [length, d_model], [length], [length, 80];
        an image's or audio input's whatever ``length``: [3, 224, 224], [80, 3000]."""
        axis = self.sequence_axis
        return self.shape({**fixed, BATCH_AXIS: 1, **({axis: length} if axis else {})})[1:]

    def describe(self) -> str:
        """``[batch, seq, 80]``: the axes as the docs and errors write them."""
        return "[" + ", ".join(map(str, self.axes)) + "]"

    @property
    def spans_batch(self) -> bool:
        """An output with the batch on a later axis too (CLIP's logits_per_image [batch, batch]: every image
        against every text of the call): what it holds for an item depends on the other items of its call, so
        nothing may split it into items, pad it or batch other items with it."""
        return BATCH_AXIS in self.axes[1:]


@dataclass(frozen=True)
class Signature:
    """Which inputs and outputs an exported model has, and what they mean."""

    attention: str = "self"
    mask: str = "none"
    return_weights: bool = False
    # "encoder": x -> output with self-attention layers; "decoder": x (target) and
    # memory -> output, causal self-attention then cross-attention over memory.
    model: str = "mha"
    # Incremental decoding: past_key/past_value in, present_key/present_value out (see ``cache_pairs``).
    kv_cache: bool = False
    # A KV-cache decoder stack's layer count: its cache inputs and outputs are per layer. 1 otherwise.
    layers: int = 1
    # model "custom" (``Signature.custom``): the tensors as declared at export, and the length axes along
    # which right-padding was measured to leave every real output unchanged (``paddable_axes``).
    custom_inputs: tuple[TensorSpec, ...] = ()
    custom_outputs: tuple[TensorSpec, ...] = ()
    custom_paddable: tuple[str, ...] = ()

    @classmethod
    def custom(
        cls, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], paddable: tuple[str, ...] = (),
        layers: int = 0,
    ) -> Signature:
        """A user's own model: ``inputs`` (tokens, sequences, padding masks) and ``outputs`` as declared.
        ``layers`` > 0: a causal LM with a KV cache per attention (``exporters.own_kv_cache``): past inputs and
        present outputs among them, its padding mask over past_seq + seq."""
        has_masks = any(spec.role == PADDING_MASK for spec in inputs)
        return cls(
            "self", "padding" if has_masks else "none", model="custom", kv_cache=layers > 0, layers=max(layers, 1),
            custom_inputs=tuple(inputs), custom_outputs=tuple(outputs), custom_paddable=tuple(paddable),
        )

    def __post_init__(self):
        # Read back from JSON, the declared tensors are dicts and lists.
        for name in ("custom_inputs", "custom_outputs"):
            specs = tuple(spec if isinstance(spec, TensorSpec) else TensorSpec(**spec) for spec in getattr(self, name))
            object.__setattr__(self, name, specs)
        object.__setattr__(self, "custom_paddable", tuple(self.custom_paddable))
        if self.model == "custom":
            self._check_custom()
            return
        if self.custom_inputs or self.custom_outputs or self.custom_paddable:
            raise SignatureError(f"declared inputs and outputs are for a custom model, not --model {self.model}")
        if self.model not in MODEL_KINDS:
            raise SignatureError(f"model must be one of {', '.join(MODEL_KINDS)}, got {self.model!r}")
        if self.attention not in ATTENTION_KINDS:
            raise SignatureError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.mask not in MASK_MODES:
            raise SignatureError(f"mask must be one of {', '.join(MASK_MODES)}, got {self.mask!r}")
        if self.layers < 1 or (self.layers != 1 and not (self.kv_cache and self.model == "decoder")):
            raise SignatureError(f"layers is the cache's layer count of a --kv-cache decoder, got {self.layers}")
        if self.kv_cache:
            self._check_kv_cache()
        if self.model != "mha":
            self._check_stack()
        elif self.is_causal and self.attention == "cross":
            raise SignatureError(
                f"mask {self.mask!r} needs self-attention: a causal mask orders queries and keys of "
                "one sequence, which cross-attention does not have (use --mask padding or none)"
            )

    def _check_custom(self) -> None:
        if self.return_weights or (self.layers != 1 and not self.kv_cache):
            raise SignatureError("a custom model declares its tensors: no return_weights, and layers only with a cache")
        caches = [spec for spec in self.custom_inputs if spec.role == PAST]
        if self.kv_cache and len(caches) != 2 * self.layers:
            raise SignatureError(
                f"a cache of {self.layers} layers has {2 * self.layers} past inputs, got {len(caches)}"
            )
        if caches and not self.kv_cache:
            raise SignatureError(f"{caches[0].name}: past inputs belong to a KV-cache model")
        inputs = tuple(spec for spec in self.custom_inputs if spec.role != PAST)
        outputs = self.custom_outputs
        names = [spec.name for spec in (*inputs, *outputs)]
        if duplicate := next((name for name in names if names.count(name) > 1), None):
            raise SignatureError(f"{duplicate} is declared twice: every input and output needs its own name")
        if not any(spec.role in (SEQUENCE, TOKENS, *FIXED_SHAPE_ROLES) for spec in inputs):
            raise SignatureError("a model needs at least one tokens, sequence, image or audio input")
        if not outputs:
            raise SignatureError("a model needs at least one output")
        if (blank := next((index for index, spec in enumerate(outputs) if not spec.name.strip()), None)) is not None:
            raise SignatureError(
                f"output {blank} is named {outputs[blank].name!r}: every output needs a name that clients ask for "
                "(--output-name NAME, once per output, in the forward's order)"
            )
        for spec in inputs:
            if spec.role not in INPUT_ROLES:
                raise SignatureError(f"{spec.name}: role must be one of {', '.join(INPUT_ROLES)}, got {spec.role!r}")
            _check_input_axes(spec)
        sequences = {spec.name: spec.axes[1] for spec in inputs if spec.role in (SEQUENCE, TOKENS)}
        token_axes = {spec.axes[1] for spec in inputs if spec.role == TOKENS}
        for spec in inputs:
            if spec.role == SEGMENTS and spec.axes[1] not in token_axes:
                raise SignatureError(
                    f"{spec.name}: segment ids mark the positions of a tokens input, and none is declared on their "
                    f"axis {spec.axes[1]!r} (give both the same axis: NAME:ROLE:AXIS)"
                )
        for spec in inputs:
            if spec.role != PADDING_MASK:
                continue
            if spec.dtype not in MASK_DTYPES:
                raise SignatureError(f"{spec.name}: a padding mask is {' or '.join(MASK_DTYPES)}, got {spec.dtype}")
            # With a cache, the mask covers the cached tokens too: [batch, total_seq].
            axis = spec.axes[1] if not (self.kv_cache and spec.axes[1] == TOTAL_AXIS) else sequences.get(spec.marks)
            if spec.marks not in sequences or sequences[spec.marks] != axis:
                along = [name for name, axis in sequences.items() if axis == spec.axes[1]]
                raise SignatureError(
                    f"{spec.name}: a padding mask marks a tokens or sequence input on its length axis "
                    f"{spec.axes[1]!r}, and {'none' if not along else ', '.join(along)} "
                    f"{'is' if len(along) <= 1 else 'are'} declared on it"
                    + ("" if along else " (declare the sequence first, or give both the same NAME:ROLE:AXIS)")
                )
        axes = set(sequences.values())
        if unknown := [axis for axis in self.custom_paddable if axis not in axes]:
            raise SignatureError(f"paddable axes {unknown} are not length axes of the inputs ({sorted(axes)})")

    def with_mask_dtype(self, dtype: str) -> Signature:
        """A custom model's signature with its padding masks taking ``dtype`` ("bool" or "int64": Hugging Face's
        1/0 attention_mask)."""
        if dtype not in MASK_DTYPES:
            raise SignatureError(f"a padding mask is {' or '.join(MASK_DTYPES)}, got {dtype!r}")
        if self.model != "custom":
            raise SignatureError("only a custom model's padding masks take another dtype (a built-in one's are bool)")
        inputs = tuple(replace(spec, dtype=dtype) if spec.role == PADDING_MASK else spec for spec in self.custom_inputs)
        return replace(self, custom_inputs=inputs)

    @property
    def item_outputs(self) -> tuple[TensorSpec, ...]:
        """The outputs each item has its own share of (every one but those that span the batch)."""
        return tuple(spec for spec in self.outputs if not spec.spans_batch)

    @property
    def batch_outputs(self) -> tuple[str, ...]:
        """Outputs that span the whole batch (``TensorSpec.spans_batch``): a call's, returned for its batch as
        it was given, never cut into items or computed over a batch formed from several callers' items."""
        return tuple(spec.name for spec in self.outputs if spec.spans_batch)

    @property
    def per_token_outputs(self) -> tuple[str, ...]:
        """Outputs with a row per position of a length axis (axis 1); the others have one row per item."""
        lengths = set(self.sequence_axes)
        return tuple(spec.name for spec in self.outputs if len(spec.axes) > 1 and spec.axes[1] in lengths)

    @property
    def last_token_outputs(self) -> tuple[str, ...]:
        """Outputs holding each row's last real token of the call only ([batch, 1, ...]), not every position's."""
        return tuple(spec.name for spec in self.outputs if spec.role == LAST_TOKEN)

    def _check_stack(self) -> None:
        attention = "self" if self.model == "encoder" else "cross"
        if self.attention != attention:
            raise SignatureError(f"--model {self.model} has {attention}-attention inputs, not {self.attention!r}")
        if self.mask not in ("none", "padding"):
            raise SignatureError(
                f"--model {self.model} takes --mask none or padding"
                + (" (its self-attention is always causal)" if self.model == "decoder" else "")
            )
        if self.return_weights:
            raise SignatureError(f"--model {self.model} has several attentions: --return-weights is for a lone MHA")

    def _check_kv_cache(self) -> None:
        if self.model == "encoder":
            raise SignatureError(
                "--kv-cache needs causal self-attention: an encoder's attends both ways (use --model decoder)"
            )
        if self.model == "mha" and (self.attention != "self" or not self.is_causal):
            raise SignatureError(
                "--kv-cache needs causal self-attention (--mask causal or padding-causal): a cache holds the "
                f"keys of earlier tokens, which only causal attention leaves unchanged (got {self.attention}, "
                f"{self.mask!r})"
            )
        if self.return_weights:
            raise SignatureError("--kv-cache returns the cache, not the probabilities: drop --return-weights")

    @property
    def cache_free(self) -> Signature:
        """The same model without its cache: what one forward over the whole sequence takes."""
        return replace(self, kv_cache=False, layers=1)

    @property
    def has_padding_mask(self) -> bool:
        return self.mask in ("padding", "padding-causal")

    @property
    def is_causal(self) -> bool:
        """Whether the mask mode is causal (a decoder's self-attention is causal whatever the mask mode)."""
        return self.mask in ("causal", "padding-causal")

    # --- the tensors -------------------------------------------------------------------------

    @property
    def _sequences(self) -> tuple[tuple[str, str], ...]:
        """(input name, its length axis) of each sequence input; the first one's positions are the output rows."""
        if self.model == "custom":
            sequences = [(spec.name, spec.axes[1]) for spec in self.custom_inputs
                         if spec.role in (SEQUENCE, TOKENS, SEGMENTS)]
            if not sequences:  # an image or audio encoder: no length axis at all
                return ()
            # The rows users read: the first per-token output's axis (an encoder-decoder's target), first.
            rows = next(
                (spec.axes[1] for spec in self.custom_outputs
                 if len(spec.axes) > 1 and spec.axes[1] in {axis for _, axis in sequences}),
                sequences[0][1],
            )
            return tuple(sorted(sequences, key=lambda pair: pair[1] != rows))
        if self.model == "decoder":
            return (("x", "tgt_seq"), ("memory", "mem_seq"))
        if self.attention == "self":
            return (("x", "seq"),)
        return (("query", "q_seq"), ("key", "kv_seq"), ("value", "kv_seq"))

    @property
    def _masks(self) -> tuple[tuple[str, str], ...]:
        """(mask name, the sequence input it marks)."""
        if self.model == "custom":
            return tuple((spec.name, spec.marks) for spec in self.custom_inputs if spec.role == PADDING_MASK)
        if not self.has_padding_mask:
            return ()
        if self.model == "decoder":
            return (("key_padding_mask", "x"), ("memory_padding_mask", "memory"))
        return (("key_padding_mask", "x" if self.attention == "self" else "key"),)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        if self.model == "custom":
            return self.custom_inputs
        axis_of = dict(self._sequences)
        specs = [
            TensorSpec(name, SEQUENCE, MODEL_DTYPE, (BATCH_AXIS, axis, "d_model")) for name, axis in axis_of.items()
        ]
        specs += [TensorSpec(name, PAST, MODEL_DTYPE, _cache_axes(axis)) for name, (axis, _) in self._caches.items()]
        # With a cache, the queries' mask covers the cached tokens and the new ones: [batch, past_seq + seq].
        specs += [
            TensorSpec(
                name, PADDING_MASK, "bool",
                (BATCH_AXIS, TOTAL_AXIS if self.kv_cache and marks == self.query_input else axis_of[marks]),
                marks=marks,
            )
            for name, marks in self._masks
        ]
        return tuple(specs)

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        if self.model == "custom":
            return self.custom_outputs
        specs = [TensorSpec("output", OUTPUT, MODEL_DTYPE, (BATCH_AXIS, self.query_axis, "d_model"))]
        if self.return_weights:
            axes = (BATCH_AXIS, "heads", self.query_axis, self.key_axis)
            specs.append(TensorSpec("attn_weights", WEIGHTS, MODEL_DTYPE, axes))
        presents = self.cache_pairs
        specs += [
            TensorSpec(presents[past], PRESENT, MODEL_DTYPE, _cache_axes(axis))
            for past, (_, axis) in self._caches.items()
        ]
        return tuple(specs)

    @property
    def _caches(self) -> dict[str, tuple[str, str]]:
        """Each past input -> (its length axis, the length axis of its present output)."""
        if not self.kv_cache:
            return {}
        if self.model == "custom":
            return {spec.name: (PAST_AXIS, TOTAL_AXIS) for spec in self.custom_inputs if spec.role == PAST}
        if self.model == "mha":
            return dict.fromkeys(CACHE_PAIRS, (PAST_AXIS, TOTAL_AXIS))
        caches = {}
        for layer in range(self.layers):
            caches.update({f"past_key_values.{layer}.{kind}": (PAST_AXIS, TOTAL_AXIS) for kind in SELF_CACHE_KINDS})
            caches.update(
                {f"past_key_values.{layer}.{kind}": (ENCODER_PAST_AXIS, MEMORY_AXIS) for kind in ENCODER_CACHE_KINDS}
            )
        return caches

    @property
    def cache_pairs(self) -> dict[str, str]:
        """Each past input -> the present output that becomes it on the next call; empty without a cache.

        A lone MHA: past_key -> present_key, past_value -> present_value. A decoder stack, per layer i:
        past_key_values.{i}.key/.value -> present.{i}.key/.value (self-attention, grows by each call's
        tokens) and past_key_values.{i}.encoder_key/.encoder_value -> present.{i}.encoder_key/.encoder_value
        (cross-attention over memory: empty on the first call, then the same every call).
        """
        if self.model == "mha":
            return {name: CACHE_PAIRS[name] for name in self._caches}
        # A custom model's: Optimum's names, as a decoder stack's
        return {name: name.replace("past_key_values.", "present.", 1) for name in self._caches}

    @property
    def growing_caches(self) -> tuple[str, ...]:
        """The past inputs that grow by each call's tokens (self-attention's); the others hold memory's."""
        return tuple(name for name, (axis, _) in self._caches.items() if axis == PAST_AXIS)

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        """Every input and output by name."""
        return {spec.name: spec for spec in (*self.inputs, *self.outputs)}

    @property
    def sequence_inputs(self) -> tuple[str, ...]:
        """The inputs an item holds along a length axis (sequences, token and segment ids), query input first."""
        return tuple(name for name, _ in self._sequences)

    @property
    def fixed_shape_inputs(self) -> tuple[str, ...]:
        """The image and audio inputs: one fixed-shape array per item, stacked into a batch, never padded."""
        return tuple(spec.name for spec in self.custom_inputs if spec.role in FIXED_SHAPE_ROLES)

    @property
    def item_inputs(self) -> tuple[str, ...]:
        """Every input an item carries (what datasets, requests and the planner hold per item): the sequence
        inputs, then the fixed-shape ones. Padding masks and caches are not an item's: batching builds them."""
        return (*self.sequence_inputs, *self.fixed_shape_inputs)

    @property
    def padding_masks(self) -> dict[str, str]:
        """Each bool padding-mask input -> the sequence input whose positions it marks."""
        return dict(self._masks)

    @property
    def memory_input(self) -> str | None:
        """A decoder stack's ``memory`` (the sequence its cross-attention reads); None for other models."""
        return self._sequences[1][0] if self.model == "decoder" else None

    def mask_of(self, sequence: str | None) -> str | None:
        """The padding mask marking ``sequence``'s positions, or None (no such mask, or no such sequence)."""
        return next((mask for mask, marks in self._masks if marks == sequence), None)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    # --- the axes ----------------------------------------------------------------------------

    @property
    def query_input(self) -> str:
        """The sequence input whose positions are the output's rows (x or query); a model with no length axis
        (an image or audio encoder): its first input."""
        return self._sequences[0][0] if self._sequences else self.item_inputs[0]

    @property
    def query_axis(self) -> str | None:
        """The query input's length axis; None for a model with no length axis (an image or audio encoder)."""
        return self._sequences[0][1] if self._sequences else None

    @property
    def key_axis(self) -> str | None:
        """The length axis of the keys the (first) attention reads."""
        if self.kv_cache:
            return TOTAL_AXIS
        if self.model == "custom":
            # Its attentions are the user's: the longest axis bounds what one of them reads.
            return self.query_axis
        return self._sequences[0][1] if self.attention == "self" else self._sequences[1][1]

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Every dynamic length axis, query axis first."""
        return tuple(dict.fromkeys(axis for _, axis in self._sequences))

    def axis_of(self, name: str) -> str:
        """The length axis of a sequence input or padding mask."""
        axis = self.tensors[name].sequence_axis
        if axis is None:
            raise KeyError(f"{name} has no sequence axis")
        return axis

    @property
    def paddable_axes(self) -> frozenset[str]:
        """Length axes that can be right-padded without changing any real position's output.

        A query position never influences another, so an axis read only as
        queries can always be padded. An axis read as keys can be padded when a
        padding mask marks it, or when the attention over it is causal (right
        padding comes after every real query, which never sees it).
        """
        if self.model == "custom":
            # Measured at export (exporters.own_model): the model's code decides, not a mask mode.
            return frozenset(self.custom_paddable)
        attended = {self.key_axis}
        if self.model == "decoder":
            attended = {"tgt_seq", "mem_seq"}
        causal = {self.query_axis} if self.is_causal or self.model == "decoder" else set()
        masked = {self.axis_of(mask) for mask in self.padding_masks}
        return frozenset(axis for axis in self.sequence_axes if axis not in attended - causal - masked)

    def axis_sizes(
        self, batch: int, q_len: int, kv_len: int | None = None, mem_len: int | None = None, **fixed: int
    ) -> dict[str, int]:
        """Axis sizes for a batch whose query axis has ``q_len`` and every other length axis ``kv_len``.

        ``fixed`` gives the model's fixed axes (d_model=..., heads=...).
        With a KV cache, ``kv_len`` is the cached length (past_seq; default 0, a prefill), and a decoder's
        memory has ``mem_len`` tokens (default: the longer of past_seq and q_len). ``d_k`` follows from
        d_model and heads when both are given.
        """
        sizes = {BATCH_AXIS: batch, **fixed}
        if "d_model" in fixed and "heads" in fixed:
            sizes.setdefault("d_k", fixed["d_model"] // fixed["heads"])
        if self.kv_cache:
            past = 0 if kv_len is None else kv_len
            sizes.update({self.query_axis: q_len, PAST_AXIS: past, TOTAL_AXIS: past + q_len})
            if self.model == "decoder":
                memory = mem_len if mem_len is not None else max(past, q_len)
                # The cross-attention cache is empty on the first call (past_seq 0), memory's length after.
                sizes.update({MEMORY_AXIS: memory, ENCODER_PAST_AXIS: memory if past else 0})
            return sizes
        kv_len = q_len if kv_len is None else kv_len
        for axis in self.sequence_axes:
            sizes[axis] = q_len if axis == self.query_axis else kv_len
        return sizes

    def input_shapes(self, sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        return {spec.name: spec.shape(sizes) for spec in self.inputs}


def _check_input_axes(spec: TensorSpec) -> None:
    """A length input is [batch, <length axis>, ...] (segment ids int64 [batch, <axis>]); an image [batch,
    channels, height, width] and audio [batch, mel, frames], every size but the batch fixed."""
    if spec.role in FIXED_SHAPE_ROLES:
        rank = 4 if spec.role == IMAGE else 3
        layout = "[batch, channels, height, width]" if spec.role == IMAGE else "[batch, mel, frames]"
        if (len(spec.axes) != rank or spec.axes[0] != BATCH_AXIS
                or not all(isinstance(size, int) and size >= 1 for size in spec.axes[1:])):
            raise SignatureError(f"{spec.name}: an {spec.role} input is {layout} with fixed sizes, got "
                                 f"{spec.describe()}")
        return
    if len(spec.axes) < 2 or spec.axes[0] != BATCH_AXIS or not isinstance(spec.axes[1], str):
        raise SignatureError(f"{spec.name}: an input is [batch, <length axis>, ...], got {spec.describe()}")
    if spec.role == SEGMENTS and (len(spec.axes) != 2 or spec.dtype != "int64"):
        raise SignatureError(f"{spec.name}: segment ids are int64 [batch, <length axis>], got {spec.dtype} "
                             f"{spec.describe()}")


def _cache_axes(length_axis: str) -> tuple[str, ...]:
    return (BATCH_AXIS, "heads", length_axis, "d_k")
