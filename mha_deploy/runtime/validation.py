"""The one validator: inputs checked against a model's Signature before ONNX Runtime sees them.

ORT's own errors name internal node ids and often come late (or not at all,
e.g. for a mask of the wrong length that still broadcasts); these say what the
caller passed and what the model expects.

Two entry points share the rules:

- ``validate_inputs``: a batch of feeds for ``MHASession.run`` (raises ``InputError``);
- ``item_problem``: one unbatched item (sequence input -> [seq, d_model]), as the
  batch runner and the HTTP server receive them. It returns a ``Problem`` instead
  of raising, so that the runner can skip the item and the server can answer
  with a status code chosen by ``Problem.kind``. Both first pass the item through
  ``in_model_dtype``: datasets and JSON bodies hold float32 (or float64, or
  integers) whatever the model's dtype, so an fp16 model takes them cast.

Padding is made inert on the way in: ``validate_inputs`` returns zeros at every
position a padding mask marks as padding, in sequence inputs and KV caches alike
(``zero_padding``). A ragged KV-cache file (metadata cache_layout "ragged", the contract in
``exporters.fusion.ragged_cache``) has its own rules: the mask is 1 on each row's first n tokens (right padding
only), only a first call's rows may be padded, and a cache is read up to each row's past length, so only the
padded new tokens are zeroed. The mask keeps real rows from attending there, but a NaN or
Inf at a padded position would still reach them through the kernel's
arithmetic (NaN times a zero weight is NaN), and from a cache every later step.

And one check of what comes out: ``output_problem`` finds NaN or Inf in one
item's outputs, which finite inputs can still produce (values near the dtype's
limit overflow in the projections or the scores); the runner and the server
treat such an item as a bad one instead of returning NaN.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mha_deploy.errors import InputError
from mha_deploy.inputs import right_padding_mask
from mha_deploy.metadata import CACHE_RAGGED, ModelMetadata
from mha_deploy.signature import (
    AUDIO,
    BATCH_AXIS,
    ENCODER_PAST_AXIS,
    FIXED_SHAPE_ROLES,
    ID_ROLES,
    IMAGE,
    MEMORY_AXIS,
    PADDING_MASK,
    PAST_AXIS,
    SEGMENTS,
    TOTAL_AXIS,
    Signature,
    TensorSpec,
)

# The axes of an image's or audio input's item, as errors name them.
_FIXED_AXIS_NAMES = {IMAGE: ("channels", "height", "width"), AUDIO: ("mel", "frames")}


@dataclass(frozen=True)
class Problem:
    """What is wrong with an item: ``kind`` is a stable label (for clients and metrics), ``message`` for people."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


def name_problem(names, expected: tuple[str, ...]) -> Problem | None:
    """Missing or unexpected input names."""
    missing = [name for name in expected if name not in names]
    unexpected = sorted(set(names) - set(expected))
    if not missing and not unexpected:
        return None
    # The unexpected names quoted: a key such as 'inputs' would otherwise read as a word of the message.
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
        [f"unexpected input{'s' if len(unexpected) > 1 else ''} {', '.join(map(repr, unexpected))}"]
        if unexpected else []
    )
    text = f"{'; '.join(parts)}: this model takes {', '.join(expected)}"
    if any(name.endswith(PADDING_MASK) for name in missing):
        # Every path requires a model's padding mask (MHASession, v2 REST and gRPC, Triton's config): say what it is.
        text += " (a padding mask is bool [batch, seq], True = real token: all True when nothing is padded)"
    return Problem("wrong_inputs", text)


def shape_problem(
    metadata: ModelMetadata, name: str, shape: tuple[int, ...], max_item_tokens: int | None = None
) -> Problem | None:
    """One item's sequence must be [seq, d_model] ([seq] token or segment ids, [seq, features] for a custom
    model's sequence) with 1 <= seq (<= ``max_item_tokens`` when given); an image or audio item exactly the
    sizes the model was exported with (``fixed_shape_problem``)."""
    spec = metadata.signature.tensors[name]
    if spec.role in FIXED_SHAPE_ROLES:
        return fixed_shape_problem(spec, tuple(shape))
    expected = spec.item_shape(0, metadata.fixed_sizes)
    layout = "[" + ", ".join(["seq", *map(str, expected[1:])]) + "]"
    if len(shape) >= 1 and shape[0] == 0:
        return Problem("empty_sequence", f"{name} is empty: a sequence needs at least one token")
    if len(shape) != len(expected):
        return Problem("wrong_rank", f"{name} has shape {tuple(shape)}, expected {layout}")
    if tuple(shape[1:]) != expected[1:]:
        if spec.axes[2:] == ("d_model",):
            return Problem("wrong_d_model", f"{name} has d_model {shape[1]}, this model expects {expected[1]}")
        return Problem("wrong_shape", f"{name} has shape {tuple(shape)}, this model expects {layout}")
    if max_item_tokens is not None and shape[0] > max_item_tokens:
        return Problem("too_many_tokens", f"{name} has {shape[0]} tokens, at most {max_item_tokens} are accepted")
    return length_problem(metadata, name, shape[0])


def fixed_shape_problem(spec: TensorSpec, shape: tuple[int, ...]) -> Problem | None:
    """One image's [channels, height, width] or audio input's [mel, frames] against the sizes the model takes
    (its metadata's, fixed at export), each wrong size named with the expected one; or None."""
    expected, names = tuple(spec.axes[1:]), _FIXED_AXIS_NAMES[spec.role]
    layout = f"[{', '.join(names)}] = {list(expected)}"
    if tuple(shape) == expected:
        return None
    if len(shape) != len(expected):
        return Problem("wrong_rank", f"{spec.name} has shape {tuple(shape)}: one {spec.role} is {layout}")
    wrong = ", ".join(f"{axis} {got} (expected {want})"
                      for axis, got, want in zip(names, shape, expected, strict=True) if got != want)
    fix = "resize the images to it" if spec.role == IMAGE else (
        f"pad or cut the features to {expected[1]} frames, as the model's feature extractor does")
    what = "images" if spec.role == IMAGE else "audio features"
    return Problem("wrong_shape", f"{spec.name} has {wrong}: this model takes {what} of {layout}; {fix}")


def length_problem(metadata: ModelMetadata, name: str, length: int) -> Problem | None:
    """A sequence longer than the model's recorded max length (its position table: ONNX Runtime would index
    past it), or None."""
    if metadata.max_length is None or length <= metadata.max_length:
        return None
    return Problem(
        "too_long",
        f"{name} is {length} tokens long, this model takes at most {metadata.max_length} (its max length, "
        "recorded at export): truncate or split it",
    )


def _length_problem(signature: Signature, lengths: Mapping[str, int]) -> Problem | None:
    """Sequence inputs that share a length axis (cross-attention's key and value) must agree."""
    by_axis: dict[str, dict[str, int]] = {}
    for name, length in lengths.items():
        by_axis.setdefault(signature.axis_of(name), {})[name] = length
    for group in by_axis.values():
        if len(set(group.values())) > 1:
            names, sizes = " and ".join(group), " and ".join(str(n) for n in group.values())
            return Problem("length_mismatch", f"{names} must have the same length, got {sizes}")
    return None


# How many [heads, q_len, kv_len] float tensors one item's attention holds at once, per fusion target.
# none runs the plain graph (scores, masked scores, probabilities); onnx's standard Attention materialises
# the scores, and a padding mask adds a float attn_mask of the same shape. The mha target runs ORT's tiled
# kernels on a lone item when the scores would be large: nothing is padded, so the padding If takes the
# flash path; causal runs on GroupQueryAttention, which materialises its scores only while they take at
# most 64 MB (the causal_gqa fusion's If) and runs tiled beyond. So no limit here.
SCORE_COPIES = {"none": 3, "onnx": 2}
# The share of the machine's memory one item's attention may take.
ITEM_MEMORY_SHARE = 0.5


def physical_memory_bytes() -> int | None:
    """The machine's memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None


def memory_problem(metadata: ModelMetadata, q_len: int, kv_len: int) -> Problem | None:
    """An item too long for this machine's memory on a model that materialises its attention scores, or None."""
    copies = SCORE_COPIES.get(metadata.fusion)
    memory = physical_memory_bytes()
    if copies is None or memory is None:
        return None
    needed = copies * metadata.num_heads * q_len * kv_len * np.dtype(metadata.dtype).itemsize
    if needed <= ITEM_MEMORY_SHARE * memory:
        return None
    return Problem(
        "too_long_for_memory",
        f"{q_len} x {kv_len} tokens need about {needed / 2**30:.1f} GiB of attention scores in this model "
        f"(--fuse {metadata.fusion} materialises heads x q x kv floats), more than half of this machine's "
        f"{memory / 2**30:.1f} GiB: split the item, or export with --fuse mha (tiled kernels)",
    )


def in_model_dtype(metadata: ModelMetadata, item: Mapping[str, object]) -> dict[str, object]:
    """``item`` with its numeric sequences cast to the model's dtype; anything else is left for ``item_problem``.

    Only arrays of an acceptable shape are cast: a reader may hand over a
    zero-stride stand-in for an array it refused to read (``mha_deploy.batch.datasets``),
    which a copy would materialise. A float32 value beyond float16's range becomes
    inf here, which ``item_problem`` then refuses as ``not_finite``: the cast never
    hides an overflow.
    """
    dtype = np.dtype(metadata.dtype)
    cast = dict(item)
    specs = metadata.signature.tensors
    for name in metadata.signature.item_inputs:
        array = item.get(name)
        if (
            isinstance(array, np.ndarray)
            and array.dtype.kind in "fiu"
            and shape_problem(metadata, name, array.shape) is None
        ):
            if specs[name].role in ID_ROLES:
                # Ids stay ids: integers of any width become int64 (an unsigned one beyond int64 is left for
                # item_problem to name); floats are left for item_problem to refuse.
                if array.dtype.kind in "iu" and _beyond_int64(array) is None:
                    cast[name] = np.ascontiguousarray(array, dtype=np.int64)
                continue
            with np.errstate(over="ignore"):  # no copy when already contiguous in the model's dtype
                cast[name] = np.ascontiguousarray(array, dtype=dtype)
    return cast


def item_problem(
    metadata: ModelMetadata, item: Mapping[str, object], max_item_tokens: int | None = None
) -> Problem | None:
    """What makes one item (input name -> [seq, d_model], [seq] ids, [channels, height, width]) unusable, or
    None."""
    signature = metadata.signature
    problem = name_problem(item, signature.item_inputs)
    if problem:
        return problem
    dtype = np.dtype(metadata.dtype)
    specs = signature.tensors
    for name in signature.item_inputs:
        array = item[name]
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "fiu":
            kind = getattr(getattr(array, "dtype", None), "name", type(array).__name__)
            return Problem("not_numeric", f"{name} holds {kind}: expected an array of numbers")
        problem = shape_problem(metadata, name, array.shape, max_item_tokens)
        if problem:
            return problem
        if specs[name].role in ID_ROLES:
            too_large = _beyond_int64(array)
            if too_large is not None:
                return _id_out_of_range(specs[name], too_large)
            if array.dtype != np.int64:
                return Problem("wrong_dtype", f"{name} holds {_ids(specs[name])}: expected integers, got {array.dtype}")
            problem = _id_problem(specs[name], array)
            if problem:
                return problem
            continue
        if array.dtype != dtype:
            return Problem("wrong_dtype", f"{name} has dtype {array.dtype}, the model takes {dtype.name}")
        if not np.isfinite(array).all():
            return Problem("not_finite", f"{name} contains NaN or Inf (or a value beyond {dtype.name}'s range)")
    lengths = {name: item[name].shape[0] for name in signature.sequence_inputs}
    problem = _length_problem(signature, lengths)
    if problem:
        return problem
    if signature.query_axis is None:  # images, audio: no length, the scores' size fixed by the model
        return None
    axes = {signature.axis_of(name): length for name, length in lengths.items()}
    return memory_problem(metadata, axes[signature.query_axis], axes[signature.key_axis])


def output_problem(outputs: Mapping[str, np.ndarray]) -> Problem | None:
    """NaN or Inf in one item's outputs (output name -> array), or None. Kind ``not_finite_output``."""
    for name, array in outputs.items():
        array = np.asarray(array)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return Problem(
                "not_finite_output",
                f"{name} holds NaN or Inf although every input value is finite: values overflowed "
                f"{array.dtype.name} inside the model (scale the inputs down)",
            )
    return None


def output_shape_problem(
    signature: Signature, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
    fixed: Mapping[str, int] | None = None, ragged: bool = False,
) -> str | None:
    """An output whose shape is not what ``signature`` says for ``feeds`` (rank, or the size of an axis the
    feeds or ``fixed`` set), or None. A graph whose output rank follows its inputs' values (an If whose
    branches differ) would otherwise be cut per item at the wrong axes. ``ragged``: a ragged KV-cache file's
    outputs, whose present is max(total, past) wide."""
    sizes = dict(fixed or {})
    for spec in signature.inputs:
        if spec.name in feeds:
            sizes.update({axis: size for axis, size in zip(spec.axes, np.shape(feeds[spec.name]), strict=False)
                          if isinstance(axis, str)})
    if ragged and TOTAL_AXIS in sizes:
        # A ragged file's present is its past with this call's keys written in: as wide as the mask or the past.
        sizes[TOTAL_AXIS] = max(sizes[TOTAL_AXIS], sizes.get(PAST_AXIS, 0))
    for spec in signature.outputs:
        shape = tuple(np.shape(outputs[spec.name]))
        expected = tuple(axis if isinstance(axis, int) else sizes.get(axis) for axis in spec.axes)
        if len(shape) != len(expected) or any(
            want not in (None, got) for want, got in zip(expected, shape, strict=True)
        ):
            return (
                f"output {spec.name} came back with shape {shape} where the model's metadata says {spec.describe()}"
                f"{' = ' + str(expected).replace('None', '?') if len(shape) == len(expected) else ''}: the "
                "graph's output shape depends on its inputs' values (e.g. an If whose branches return different "
                "ranks); make every path of the forward return the same shape and export it again"
            )
    return None


def check_item(metadata: ModelMetadata, item: Mapping[str, object], max_item_tokens: int | None = None) -> None:
    """Raise ``InputError`` if ``item_problem`` finds something."""
    problem = item_problem(metadata, item, max_item_tokens)
    if problem:
        raise InputError(problem.message)


def validate_inputs(metadata: ModelMetadata, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Return a batch of inputs as ORT-ready arrays, or raise ``InputError`` saying what is wrong."""
    signature = metadata.signature
    problem = name_problem(inputs, signature.input_names)
    if problem:
        raise InputError(problem.message)
    specs = signature.tensors
    arrays = {name: _sequence_array(specs[name], inputs[name], metadata) for name in signature.sequence_inputs}
    fixed = {name: _fixed_shape_array(specs[name], inputs[name], metadata) for name in signature.fixed_shape_inputs}
    batch = {name: array.shape[0] for name, array in (arrays | fixed).items()}
    if len(set(batch.values())) > 1:
        raise InputError(f"batch sizes differ: {', '.join(f'{name} {size}' for name, size in batch.items())}")
    problem = _length_problem(signature, {name: array.shape[1] for name, array in arrays.items()})
    if problem:
        raise InputError(problem.message)
    past = _cache_arrays(metadata, inputs, arrays) if signature.kv_cache else {}
    ragged = bool(past) and metadata.cache_layout == CACHE_RAGGED
    for mask_name, sequence_name in signature.padding_masks.items():
        shape = arrays[sequence_name].shape[:2]
        if ragged and sequence_name == signature.query_input:
            arrays[mask_name] = _ragged_mask(mask_name, inputs[mask_name], shape,
                                             past[signature.growing_caches[0]].shape[2])
            continue
        if past and sequence_name == signature.query_input:
            # The queries' mask covers the cached tokens, then the new ones: [batch, past_seq + seq].
            shape = (shape[0], past[signature.growing_caches[0]].shape[2] + shape[1])
            sequence_name = f"past_seq + {sequence_name}'s length"
        arrays[mask_name] = _padding_mask(mask_name, inputs[mask_name], shape, sequence_name)
    _check_real_tokens(signature, arrays)
    feeds = ragged_padding(signature, arrays) | past if ragged else inert_padding(signature, {**arrays, **past})
    for name in signature.sequence_inputs:
        # Ids are checked once padding is inert: whatever sat at a padded position is 0 now.
        problem = _id_problem(specs[name], feeds[name]) if specs[name].role in ID_ROLES else None
        if problem:
            raise InputError(problem.message)
    feeds.update(fixed)
    for name in signature.padding_masks:
        if specs[name].dtype == "int64":  # a causal LM's attention_mask, as onnxruntime-genai feeds it
            feeds[name] = feeds[name].astype(np.int64)
    return feeds


def inert_padding(signature: Signature, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with zeros at every padded position of the sequence inputs and KV caches among them (masks
    as given): what ONNX Runtime is handed. Parity gives its reference the same feeds."""
    masks = padding_by_axis(signature, feeds)
    zeroed = (*signature.sequence_inputs, *signature.cache_pairs)
    return {
        name: zero_padding(array, signature.tensors[name], masks) if name in zeroed else array
        for name, array in feeds.items()
    }


def ragged_padding(signature: Signature, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A ragged KV-cache file's ``feeds`` (caches aside) with its padded new tokens zeroed: a first call's columns
    at or after each row's length. The caches are left as given: the file reads a row's cache only up to its past
    length (n - seq), so nothing after it reaches a real token."""
    mask = next(feeds[name] for name, marks in signature.padding_masks.items() if marks == signature.query_input)
    seq = feeds[signature.query_input].shape[1]
    lengths = mask.sum(axis=1)
    # Column j of this call is row r's token past_r + j, real while it is below n_r.
    past = np.maximum(lengths - seq, 0)
    real = {signature.query_axis: past[:, None] + np.arange(seq)[None, :] < lengths[:, None]}
    return {name: zero_padding(array, signature.tensors[name], real) if name in signature.sequence_inputs else array
            for name, array in feeds.items()}


def padding_by_axis(signature: Signature, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Length axis -> [batch, length] bool (True = real) for every axis of the feeds a padding mask covers.

    A position is padding only where every mask of its axis says so: a model given two masks of one axis
    (``mask1 | mask2``) reads every position one of them calls real. With a KV cache the queries' mask covers
    past_seq + seq: its first past_seq columns are the cache's (``past_seq``), the rest the new tokens'. A
    decoder's encoder caches are memory's length once filled.
    """
    masks: dict[str, np.ndarray] = {}

    def mark(axis: str, mask: np.ndarray) -> None:
        masks[axis] = mask | masks[axis] if axis in masks else mask

    for mask_name, marks in signature.padding_masks.items():
        mask = feeds[mask_name].astype(bool, copy=False)  # an int64 1/0 mask (a Hugging Face file's) as bool
        axis = signature.axis_of(mask_name)
        if axis == TOTAL_AXIS:
            past = mask.shape[1] - feeds[marks].shape[1]
            mark(signature.axis_of(marks), mask[:, past:])
            mark(PAST_AXIS, mask[:, :past])
            continue
        mark(axis, mask)
        if axis == MEMORY_AXIS and any(
            feeds[name].shape[2] == mask.shape[1] for name in signature.cache_pairs if name in feeds
        ):
            mark(ENCODER_PAST_AXIS, mask)
    return masks


def zero_padding(
    array: np.ndarray, spec: TensorSpec, masks: Mapping[str, np.ndarray], in_place: bool = False
) -> np.ndarray:
    """``array`` (laid out as ``spec``) with zeros wherever ``masks`` (axis -> [batch, length] bool, True =
    real) marks a position of one of its axes as padding.

    The one way padding is made inert, whatever the tensor (a sequence, a cache; ids of a token input would
    become 0 the same way). Copies only when a padded position holds anything but zero; ``in_place`` writes
    into ``array`` instead (an array the caller owns, such as a decoder's cache).
    """
    for position, axis in enumerate(spec.axes):
        mask = masks.get(axis) if position else None
        if mask is None or mask.shape != (array.shape[0], array.shape[position]) or mask.all():
            continue
        index: list = [slice(None)] * array.ndim
        index[0], index[position] = np.nonzero(~mask)
        if not in_place:
            if not array[tuple(index)].any():  # NaN counts as nonzero
                continue
            array, in_place = array.copy(), True
        array[tuple(index)] = 0
    return array


def _cache_arrays(
    metadata: ModelMetadata, inputs: Mapping[str, object], sequences: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The cache feeds: model dtype, [batch, heads, length, d_k], one past_seq for every growing cache; a
    decoder's encoder caches empty on the first call (past_seq 0) and memory-long on later ones."""
    signature = metadata.signature
    dtype = np.dtype(metadata.dtype)
    batch = next(iter(sequences.values())).shape[0]
    arrays = {}
    for name in signature.cache_pairs:
        # A cache states its own heads where it holds fewer than the queries (a grouped-query model's KV heads).
        _, heads, _, d_k = signature.tensors[name].axes
        heads = heads if isinstance(heads, int) else metadata.num_heads
        d_k = d_k if isinstance(d_k, int) else metadata.d_model // metadata.num_heads
        array = np.asarray(inputs[name])
        if array.dtype != dtype:
            raise InputError(f"{name} must be {dtype.name}, got {array.dtype}")
        if array.ndim != 4 or array.shape[0] != batch or array.shape[1] != heads or array.shape[3] != d_k:
            length = signature.tensors[name].axes[2]
            raise InputError(
                f"{name} must have shape [batch, heads, {length}, d_k] = [{batch}, {heads}, {length}, {d_k}], "
                f"got {array.shape}; pass the previous call's present output ({length} 0 on the first call)"
            )
        arrays[name] = np.ascontiguousarray(array)
    growing = {name: arrays[name].shape[2] for name in signature.growing_caches}
    if len(set(growing.values())) > 1:
        raise InputError(f"past_seq differs: {', '.join(f'{name} {n}' for name, n in growing.items())}")
    past_seq = next(iter(growing.values()))
    memory = signature.memory_input
    if memory is not None:
        expected = 0 if past_seq == 0 else sequences[memory].shape[1]
        wrong = {name: a.shape[2] for name, a in arrays.items() if name not in growing and a.shape[2] != expected}
        if wrong:
            when = "the first call (past_seq 0)" if past_seq == 0 else f"later calls ({memory}'s length)"
            raise InputError(
                f"encoder caches must be {expected} long on {when}, got "
                f"{', '.join(f'{name} {n}' for name, n in wrong.items())}: pass empty ones with the first call, "
                "then the present outputs of the first call"
            )
    return arrays


def _sequence_array(spec: TensorSpec, value: object, metadata: ModelMetadata) -> np.ndarray:
    """A batch of one tokens, segments or sequence input: its dtype, rank and fixed sizes (ids are checked
    against their table once padding is inert)."""
    name, array = spec.name, np.asarray(value)
    if spec.role in ID_ROLES:
        if array.dtype.kind not in "iu":
            raise InputError(f"{name} holds {_ids(spec)}: it must be an integer array (int64), got {array.dtype}")
        too_large = _beyond_int64(array)
        if too_large is not None:
            raise InputError(_id_out_of_range(spec, too_large).message)
        array = array.astype(np.int64, copy=False)
    else:
        dtype = np.dtype(metadata.dtype)
        if array.dtype != dtype:
            hint = f" (cast with .astype(np.{dtype.name}))" if array.dtype.kind in "fiu" else ""
            raise InputError(f"{name} must be {dtype.name}, got {array.dtype}{hint}")
    expected = spec.shape({**metadata.fixed_sizes, BATCH_AXIS: 0, spec.axes[1]: 0})
    if array.ndim != len(expected):
        raise InputError(f"{name} must have rank {len(expected)} {_layout(spec, metadata)}, got shape {array.shape}")
    wrong = [(i, size) for i, size in enumerate(expected[2:], start=2) if array.shape[i] != size]
    if wrong:
        position, size = wrong[0]
        feature = spec.axes[position] if isinstance(spec.axes[position], str) else f"axis {position}"
        raise InputError(
            f"{name} has {feature} {array.shape[position]}, this model expects {size} (shape {array.shape})"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError(f"{name} is empty (shape {array.shape}): batch and sequence length must be at least 1")
    problem = length_problem(metadata, name, array.shape[1])
    if problem:
        raise InputError(problem.message)
    return np.ascontiguousarray(array)


def _fixed_shape_array(spec: TensorSpec, value: object, metadata: ModelMetadata) -> np.ndarray:
    """A batch of one image or audio input: the model's float dtype, [batch, <the sizes it takes>], finite."""
    name, array = spec.name, np.asarray(value)
    dtype = np.dtype(metadata.dtype)
    if array.dtype != dtype:
        hint = f" (cast with .astype(np.{dtype.name}))" if array.dtype.kind in "fiu" else ""
        raise InputError(f"{name} must be {dtype.name}, got {array.dtype}{hint}")
    if array.ndim == 0 or array.shape[0] == 0:
        raise InputError(f"{name} is empty (shape {array.shape}): a batch needs at least one {spec.role}")
    problem = fixed_shape_problem(spec, array.shape[1:])
    if problem:
        raise InputError(f"{problem.message} (batch shape {array.shape})")
    if not np.isfinite(array).all():
        raise InputError(f"{name} contains NaN or Inf (or a value beyond {dtype.name}'s range)")
    return np.ascontiguousarray(array)


def _layout(spec: TensorSpec, metadata: ModelMetadata) -> str:
    """``[batch, seq, 512]``: the axes with the model's fixed sizes filled in."""
    fixed = metadata.fixed_sizes
    return "[" + ", ".join(str(fixed.get(axis, axis)) if isinstance(axis, str) else str(axis)
                           for axis in spec.axes) + "]"


def _id_problem(spec: TensorSpec, ids: np.ndarray) -> Problem | None:
    """Token ids no table row answers: negative ones always (an ONNX Gather reads ids below 0 from the end of
    its table, so -1 would silently answer as the last id), and ids past the vocabulary when it is known (the
    metadata's, or the graph's own table's, which the session reads on load)."""
    if ids.size == 0:
        return None
    low, high = int(ids.min()), int(ids.max())
    if low < 0:
        return _id_out_of_range(spec, low)
    if spec.vocab is not None and high >= spec.vocab:
        return _id_out_of_range(spec, high)
    return None


def _id_out_of_range(spec: TensorSpec, bad: int) -> Problem:
    if spec.vocab is not None and spec.role == SEGMENTS:
        allowed = (f"its segment table has {spec.vocab} rows in this model, so segment ids are 0 to "
                   f"{spec.vocab - 1}")
    elif spec.vocab is not None:
        allowed = f"this model's vocabulary is ids 0 to {spec.vocab - 1}"
    else:
        allowed = f"{_ids(spec)} are 0 or more" if bad < 0 else f"{_ids(spec)} must fit int64"
    return Problem("id_out_of_range", f"{spec.name} holds id {bad}: {allowed}")


def _ids(spec: TensorSpec) -> str:
    return "segment ids" if spec.role == SEGMENTS else "token ids"


def _beyond_int64(ids: np.ndarray) -> int | None:
    """The largest id of an unsigned array when it is beyond int64 (which would wrap it negative), else None."""
    if ids.dtype.kind != "u" or ids.size == 0 or ids.dtype.itemsize < 8:
        return None
    high = int(ids.max())
    return high if high > np.iinfo(np.int64).max else None


def _mask_values(name: str, value: object) -> np.ndarray:
    mask = np.asarray(value)
    if mask.dtype.kind in "iu":
        # Tokenizers hand out int 0/1 attention masks; the meaning is the same.
        if not np.isin(mask, (0, 1)).all():
            raise InputError(f"{name} of integer type must hold only 0 and 1")
        return mask.astype(bool)
    if mask.dtype != np.bool_:
        raise InputError(f"{name} must be bool (True = real token), got {mask.dtype}")
    return mask


def _ragged_mask(name: str, value: object, ids_shape: tuple[int, int], width: int) -> np.ndarray:
    """A ragged KV-cache file's mask [batch, total]: row r's first n_r entries real, the rest padding (right
    padding only); a first call's rows (n_r <= seq: no past) may be padded, a later call's hold seq new tokens
    after a past of n_r - seq <= ``width`` (the past's positions); more than one new token after a past only
    for batch 1 (ORT's GroupQueryAttention refuses it on several rows)."""
    mask = _mask_values(name, value)
    batch, seq = ids_shape
    if mask.ndim != 2 or mask.shape[0] != batch or mask.shape[1] < seq:
        raise InputError(f"{name} must have shape [batch, total] with total >= seq (each row's tokens so far, "
                         f"this call's included) = [{batch}, >= {seq}], got {mask.shape}")
    lengths = mask.sum(axis=1)
    holes = np.flatnonzero((mask != right_padding_mask(lengths, mask.shape[1])).any(axis=1))
    if holes.size:
        raise InputError(f"{name} rows {holes.tolist()[:10]} have padding before a real token: a ragged cache file "
                         "takes right padding only (row r's first n_r entries 1, the rest 0)")
    padded = np.flatnonzero((lengths > 0) & (lengths < seq))
    continuing = np.flatnonzero(lengths > seq)
    if padded.size and continuing.size:
        raise InputError(f"{name} rows {padded.tolist()[:10]} hold fewer tokens than this call's {seq} while rows "
                         f"{continuing.tolist()[:10]} have a past: only a first call (no row has a past) may be "
                         "right-padded; later calls give every row seq new tokens")
    if continuing.size and seq > 1 and batch > 1:
        raise InputError(f"{seq} new tokens per row after a past need batch 1 in a ragged cache file (ONNX Runtime's "
                         f"GroupQueryAttention refuses several rows): give rows {continuing.tolist()[:10]} one call "
                         "each, or one token per call")
    beyond = np.flatnonzero(lengths - seq > width)
    if beyond.size:
        raise InputError(f"{name} rows {beyond.tolist()[:10]} have a past of {int(lengths[beyond[0]] - seq)} tokens "
                         f"(n - seq), more than the {width} positions the past_key_values inputs hold")
    return np.ascontiguousarray(mask)


def _padding_mask(name: str, value: object, kv_shape: tuple[int, int], kv_name: str) -> np.ndarray:
    mask = _mask_values(name, value)
    if mask.shape != tuple(kv_shape):
        raise InputError(
            f"{name} must have shape [batch, kv_len] = {tuple(kv_shape)} to match {kv_name}, got {mask.shape}"
        )
    return np.ascontiguousarray(mask)


def _check_real_tokens(signature: Signature, masks: Mapping[str, np.ndarray]) -> None:
    """Every row holds a real token on each masked axis: one that some mask of the axis calls real."""
    names_by_axis: dict[str, list[str]] = {}
    for name in signature.padding_masks:
        names_by_axis.setdefault(signature.axis_of(name), []).append(name)
    for names in names_by_axis.values():
        empty_rows = np.flatnonzero(~np.logical_or.reduce([masks[name] for name in names]).any(axis=1))
        if empty_rows.size:
            raise InputError(f"{' and '.join(names)} rows {empty_rows.tolist()[:10]} have no real token: every "
                             "item needs at least one")
