"""``IncrementalDecoder``: incremental decoding over a KV-cache model (``mha-deploy export --kv-cache``). No torch.

The model's contract is concatenation: each call takes ``past_key``/``past_value``
[batch, heads, past_seq, d_k] and returns ``present_*`` = past ++ the new tokens'
keys/values. The decoder feeds each call's present back as the next call's past,
keeps the padding mask (a model with ``key_padding_mask``: True = real, covering
past_seq + seq) and each row's real length, and lets rows leave the batch.

A decoder stack (``--model decoder --kv-cache``) has such a pair per layer for its
self-attention, and one more for its cross-attention: memory's keys/values, which
the first call computes from ``memory`` and every later call passes back
unchanged. The decoder keeps memory (and its mask) and feeds them again.

Every row of a batch shares one cache width (past_seq). A row whose prefill was
padded keeps its padding as masked holes in the cache; later tokens are appended
after them, so rows of different lengths decode together, each seeing exactly its
own real tokens.

What a call copies:

- the model writes past ++ new into present (contrib MultiHeadAttention
  concatenates internally, the plain graph with a Concat): one copy of the cache
  per call, the price of the concatenation contract.
- ``capacity=None``: ORT allocates each present; the previous one is freed when
  the next call replaces it. Nothing else is copied.
- ``capacity=N``: two preallocated buffers per cache tensor, each for the batch
  at N tokens; each call reads past from one (a contiguous view, no copy) and ORT
  writes present straight into the other (``MHASession.run_into``), then they
  swap. No allocation per call, so memory stays flat. A call beyond N tokens
  grows both buffers (doubling, one copy of the cache).
- a decoder stack's encoder caches: the graph returns them as they came (an
  Identity), one copy of memory's keys/values per call; with ``capacity``, into
  two buffers of memory's size, so that nothing is allocated.
- ``leave``: the rows that stay are copied once into the other buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mha_deploy.errors import InputError, OptionError
from mha_deploy.inputs import right_padding_mask
from mha_deploy.runtime.validation import zero_padding
from mha_deploy.signature import MEMORY_AXIS, TOTAL_AXIS

if TYPE_CHECKING:
    from mha_deploy.metadata import ModelMetadata
    from mha_deploy.runtime.session import MHASession


def refuse_kv_cache(metadata: ModelMetadata, user: str) -> None:
    """Raise ``OptionError`` for a KV-cache model: ``user`` batches independent requests, a cache is state."""
    if metadata.signature.kv_cache:
        raise OptionError(
            f"{user} runs independent items, and a KV-cache model carries state from call to call: decode with "
            "MHASession.decoder(), or export without --kv-cache"
        )


class IncrementalDecoder:
    """Prefill a batch, then step it; rows leave when their sequence is finished.

    A decoder holds one batch's state: use one per thread (they can share the session).

    >>> decoder = session.decoder(capacity=1024)
    >>> out = decoder.prefill(x, key_padding_mask=mask)   # x [batch, seq, d_model]
    >>> out = decoder.step(x_next)                        # x_next [batch, new, d_model], every token real
    >>> decoder.leave([0])                                # row 0 is done; ``ids`` says which rows remain
    """

    def __init__(self, session: MHASession, capacity: int | None = None):
        signature = session.signature
        if not signature.kv_cache:
            raise OptionError(
                f"{session.source} has no KV cache: export it with --kv-cache (--mask causal or padding-causal)"
            )
        if signature.model == "custom":
            raise OptionError(
                f"{session.source} is a causal LM over token ids (export --module --kv-cache): this decoder steps "
                "float sequences; generate with mha_deploy.runtime.kv_stepper.KVCacheStepper, or run it with "
                "session.run on input_ids, attention_mask and past_key_values.*"
            )
        if capacity is not None and capacity < 1:
            raise OptionError(f"capacity must be at least 1 token, got {capacity}")
        self.session = session
        self.capacity = capacity
        metadata = session.metadata
        self._head_shape = (metadata.num_heads, metadata.d_model // metadata.num_heads)
        self._dtype = np.dtype(metadata.dtype)
        self._x_name = signature.query_input
        self._mask_name = signature.mask_of(self._x_name)
        self._masked = self._mask_name is not None
        self._pairs = signature.cache_pairs
        self._growing = frozenset(signature.growing_caches)
        # A decoder stack's memory and its mask: given with the prefill, fed again on every call.
        self._memory_name = signature.memory_input
        self._memory_mask_name = signature.mask_of(self._memory_name)
        self._reset(0)

    # --- the state ---------------------------------------------------------------------------

    def _reset(self, batch: int) -> None:
        self.ids = np.arange(batch)  # the prefill row each batch row came from
        self.mask = np.zeros((batch, 0), bool)  # [batch, width]: True = real token in the cache
        self._memory: dict[str, np.ndarray] = {}  # a decoder's memory (+ memory_padding_mask), row by row
        self._past = {name: self._empty(batch) for name in self._pairs}
        # capacity mode: per cache tensor, the buffer holding past and the one present is written into
        self._buffers: dict[str, list[np.ndarray]] = {}
        self._rows_allocated = batch

    def _empty(self, batch: int) -> np.ndarray:
        return np.zeros((batch, *self._head_shape[:1], 0, self._head_shape[1]), self._dtype)

    @property
    def batch(self) -> int:
        return len(self.ids)

    @property
    def width(self) -> int:
        """The cache's length (past_seq of the next call), padding holes included."""
        return self.mask.shape[1]

    @property
    def lengths(self) -> np.ndarray:
        """Real tokens each row has seen so far."""
        return self.mask.sum(axis=1)

    @property
    def cache(self) -> dict[str, np.ndarray]:
        """The current caches (past input name -> [batch, heads, width, d_k]; a decoder's encoder caches are
        [batch, heads, mem_seq, d_k]), views into the decoder's buffers."""
        return dict(self._past)

    # --- calls -------------------------------------------------------------------------------

    def prefill(
        self,
        x: np.ndarray,
        key_padding_mask: np.ndarray | None = None,
        lengths: np.ndarray | list[int] | None = None,
        memory: np.ndarray | None = None,
        memory_padding_mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Start a new batch from ``x`` [batch, seq, d_model]; returns output [batch, seq, d_model].

        Padding: ``key_padding_mask`` bool [batch, seq] (True = real, any side), or ``lengths`` (real tokens
        first, right padding), or neither (every token real). A model without key_padding_mask (--mask
        causal) takes only batches whose rows are all real.

        A decoder stack (``--model decoder --kv-cache``) also takes ``memory`` [batch, mem_seq, d_model], and
        ``memory_padding_mask`` [batch, mem_seq] when exported with --mask padding (default: every memory
        token real). The first call turns memory into each layer's encoder cache; later calls read those.
        """
        x = np.asarray(x)
        if x.ndim != 3:
            raise InputError(f"x must have rank 3 [batch, seq, d_model], got shape {x.shape}")
        mask = _prefill_mask(x.shape[:2], key_padding_mask, lengths)
        if not self._masked and not mask.all():
            raise InputError(
                "this model has no key_padding_mask, so every prefill token must be real; export with "
                "--mask padding-causal --kv-cache to decode rows of different lengths together"
            )
        memories = self._memory_feeds(x.shape[0], memory, memory_padding_mask)
        self._reset(x.shape[0])
        self._memory = memories
        return self._call(x, mask)

    def _memory_feeds(self, batch: int, memory, memory_padding_mask) -> dict[str, np.ndarray]:
        if self._memory_name is None:
            if memory is not None or memory_padding_mask is not None:
                raise InputError("this model has no memory: memory and memory_padding_mask are for a decoder stack")
            return {}
        if memory is None:
            raise InputError("a decoder stack's prefill needs memory [batch, mem_seq, d_model]: what it attends to")
        memory = np.asarray(memory)
        if memory.ndim != 3 or memory.shape[0] != batch:
            raise InputError(f"memory must be [batch={batch}, mem_seq, d_model], got shape {memory.shape}")
        feeds = {self._memory_name: memory}
        if self._memory_mask_name is not None:
            mask = np.ones(memory.shape[:2], bool) if memory_padding_mask is None else np.asarray(memory_padding_mask)
            feeds[self._memory_mask_name] = mask
        elif memory_padding_mask is not None:
            raise InputError("this model has no memory_padding_mask: export it with --mask padding to pad memory")
        return feeds

    def step(self, x: np.ndarray) -> np.ndarray:
        """Append ``x`` [batch, new, d_model] (every token real) to every row; returns output [batch, new, d_model]."""
        if self.batch == 0:
            raise InputError("no sequence to step: call prefill first (or every row has left)")
        x = np.asarray(x)
        if x.ndim != 3 or x.shape[0] != self.batch:
            raise InputError(f"x must be [batch={self.batch}, new, d_model], a row per active sequence; got {x.shape}")
        return self._call(x, np.ones(x.shape[:2], bool))

    def leave(self, rows) -> None:
        """Drop batch rows ``rows``: indices into the current batch (``ids`` maps them to prefill rows), or a
        bool mask with one value per row (True = leave)."""
        drop = np.zeros(self.batch, bool)
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            # Read as indices, [False, True, False] would be rows 0, 1, 0.
            if rows.shape != (self.batch,):
                raise InputError(f"a bool mask of rows needs one value per row ({self.batch}), got shape {rows.shape}")
            rows = np.flatnonzero(rows)
        elif rows.size and rows.dtype.kind not in "iu":
            raise InputError(f"rows must be integer indices (or a bool mask), got {rows.dtype} values {rows.tolist()}")
        rows = rows.astype(int).ravel()
        if rows.size and (rows.min() < -self.batch or rows.max() >= self.batch):
            raise InputError(f"rows {rows.tolist()} out of range for a batch of {self.batch}")
        drop[rows] = True
        keep = np.flatnonzero(~drop)
        self.ids, self.mask = self.ids[keep], self.mask[keep]
        self._memory = {name: array[keep] for name, array in self._memory.items()}
        for name, past in self._past.items():
            if not self._buffers:
                self._past[name] = past[keep]
                continue
            # Copy the staying rows into the spare buffer (one copy of what stays) and make it current.
            current, spare = self._buffers[name]
            view = _prefix(spare, (len(keep), *past.shape[1:]))
            np.take(past, keep, axis=0, out=view)
            self._buffers[name] = [spare, current]
            self._past[name] = view

    def _call(self, x: np.ndarray, new_mask: np.ndarray) -> np.ndarray:
        mask = np.concatenate([self.mask, new_mask], axis=1)
        feeds = {self._x_name: x, **self._memory, **self._past}
        if self._masked:
            feeds[self._mask_name] = mask
        if self.capacity is None:
            result = self.session.run(feeds)
            self._past = {name: result[present] for name, present in self._pairs.items()}
        else:
            targets = {
                present: self._present_buffer(name, self._present_shape(name, mask.shape[1]))
                for name, present in self._pairs.items()
            }
            result = self.session.run_into(feeds, targets)
            for name in self._pairs:
                self._buffers[name].reverse()  # present's buffer holds the next call's past
            self._past = {name: targets[present] for name, present in self._pairs.items()}
        self.mask = mask
        self._zero_holes()
        return result["output"]

    def _zero_holes(self) -> None:
        """Zeros in the cache wherever the mask has padding (the keys/values of padded prefill tokens), written
        in place: validate_inputs would otherwise copy the whole cache on every call to make them inert."""
        masks = {TOTAL_AXIS: self.mask}
        if self._memory_mask_name is not None:
            masks[MEMORY_AXIS] = self._memory[self._memory_mask_name]
        tensors = self.session.signature.tensors
        for name, present in self._pairs.items():
            zero_padding(self._past[name], tensors[present], masks, in_place=True)

    def _present_shape(self, name: str, width: int) -> tuple[int, ...]:
        """The present output of cache ``name`` after a call: ``width`` long, or memory-long (encoder caches)."""
        length = width if name in self._growing else self._memory[self._memory_name].shape[1]
        return (self.batch, self._head_shape[0], length, self._head_shape[1])

    def _present_buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A view of ``shape`` at the start of the buffer past is not in, (re)allocating when too small.
        Growing caches get ``capacity`` tokens (doubled when exceeded); encoder caches exactly memory's length,
        allocated by the prefill (the only call after which they are not empty)."""
        needed = int(np.prod(shape))
        pair = self._buffers.get(name)
        if pair is None or pair[1].size < needed:
            if name not in self._growing:
                tokens = shape[2]
            else:
                tokens = max(self.capacity, shape[2]) if pair is None else max(2 * self.capacity, shape[2])
                if pair is not None:
                    self.capacity = tokens  # grown: later calls size against the new capacity
            size = self._rows_allocated * self._head_shape[0] * tokens * self._head_shape[1]
            past = self._past[name]
            # past may live in the old buffer: give it a fresh one of the new size too (one copy).
            fresh_past, spare = _resident(size, self._dtype), _resident(size, self._dtype)
            view = _prefix(fresh_past, past.shape)
            view[...] = past
            self._past[name] = view
            self._buffers[name] = [fresh_past, spare]
        return _prefix(self._buffers[name][1], shape)


def _resident(size: int, dtype: np.dtype) -> np.ndarray:
    """A buffer whose pages are all written now: the OS maps untouched pages lazily, so an unwritten buffer
    would grow the process token by token, and a preallocated cache should cost its memory up front."""
    buffer = np.empty(size, dtype)
    buffer.fill(0)
    return buffer


def _prefix(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) elements of a flat buffer as a C-contiguous array of ``shape`` (a view)."""
    return buffer[: int(np.prod(shape))].reshape(shape)


def _prefill_mask(shape: tuple[int, int], key_padding_mask, lengths) -> np.ndarray:
    batch, seq = shape
    if key_padding_mask is not None and lengths is not None:
        raise InputError("give key_padding_mask or lengths, not both")
    if lengths is not None:
        lengths = np.asarray(lengths, dtype=int).ravel()
        if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > seq:
            raise InputError(f"lengths must be {batch} values in [1, {seq}], got {lengths.tolist()}")
        return right_padding_mask(lengths, seq)
    if key_padding_mask is None:
        return np.ones(shape, bool)
    mask = np.asarray(key_padding_mask)
    if mask.shape != shape:
        raise InputError(f"key_padding_mask must be [batch, seq] = {shape}, got {mask.shape}")
    return mask.astype(bool)
