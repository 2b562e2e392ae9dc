"""The one batch planner: variable-length items grouped into padded batches, and cut back after the run.

Used by ``BatchRunner`` (offline, token budget and batch size) and by the HTTP
server's micro-batcher (online, with a padding budget too). Everything follows
the Signature's axes: an item is one array [length, d_model] per sequence
input, each length on a named axis (``seq``; ``q_seq``/``kv_seq``;
``tgt_seq``/``mem_seq``).

Whether padding an axis changes the result depends on the model
(``Signature.paddable_axes``): an axis read only as queries can always be
padded; keys can be padded when a padding mask marks them, or when the
attention over them is causal (right padding comes after every real query).
Items whose unpaddable axes differ never share a batch.

Image and audio inputs have no length axis: every item's is the same shape (the
validator holds them to the model's sizes), so a batch stacks them, pads nothing,
and only the batch size bounds it. A model whose inputs are all such (ViT,
Whisper's encoder) has no lengths at all: its items batch in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mha_deploy.batch.base import Item, Result
from mha_deploy.inputs import right_padding_mask
from mha_deploy.metadata import ModelMetadata
from mha_deploy.signature import Signature

# Padding an item by up to this many positions is cheaper than a run of its own,
# whatever the share: a run costs about as much as that many extra positions on a CPU.
PAD_SLACK_TOKENS = 8


def item_lengths(item: Item, signature: Signature) -> dict[str, int]:
    """Length axis -> length, for one item (empty for an item of images or audio only)."""
    return {signature.axis_of(name): item[name].shape[0] for name in signature.sequence_inputs}


# Attention scores one padded batch may materialise (see BatchLimits.max_score_bytes).
DEFAULT_MAX_SCORE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class BatchLimits:
    """What one batch may hold."""

    batch_size: int | None = None  # items
    max_batch_tokens: int | None = None  # padded positions on any axis: items x longest
    # Share of padded positions allowed on any axis (beyond PAD_SLACK_TOKENS per item); None: any.
    max_padding: float | None = None
    # A batch whose masked keys are padded runs ORT's masked attention kernel, which
    # materialises [batch, heads, q_len, kv_len] scores; a batch of equal key lengths
    # takes the flash path and does not. ``score_bytes`` is heads x the dtype's size,
    # the cost of one (query, key) pair; padded batches are cut to stay within
    # ``max_score_bytes``, so long sequences run in exact-length groups or alone.
    # Causal attention (--fuse mha) runs GroupQueryAttention whatever the padding, and
    # materialises its scores only while they take at most 64 MB (the causal_gqa fusion's
    # If), tiled beyond: within the default budget either way. So does the standard Attention
    # op that every mask mode runs up to 256 keys and 64 MB of scores (the short_sequence
    # fusion's If), padded or not. The count here is then an
    # upper bound, never short: it may cut a long padded causal batch that would have run
    # tiled, which costs batching, not memory. The planner sees the Signature, not the
    # fused graph, and the same causal Signature exported with --fuse onnx or none does
    # materialise every batch's scores.
    max_score_bytes: int | None = None
    score_bytes: int = 0


class _Group:
    """A batch being filled: its items and, per axis, the longest and the total length."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.longest: dict[str, int] = {}
        self.total: dict[str, int] = {}

    def admits(
        self, lengths: dict[str, int], limits: BatchLimits, paddable: frozenset[str], signature: Signature
    ) -> bool:
        if not self.indices:
            return True
        count = len(self.indices) + 1
        if limits.batch_size is not None and count > limits.batch_size:
            return False
        max_scores = limits.max_score_bytes
        if max_scores is not None and self.score_bytes(lengths, limits, signature) > max_scores:
            return False
        for axis, length in lengths.items():
            longest, total = max(self.longest[axis], length), self.total[axis] + length
            if axis not in paddable and length != self.longest[axis]:
                return False
            padded = count * longest
            if limits.max_batch_tokens is not None and padded > limits.max_batch_tokens:
                return False
            padding = padded - total
            if limits.max_padding is not None and padding > max(limits.max_padding * padded, PAD_SLACK_TOKENS * count):
                return False
        return True

    def score_bytes(self, lengths: dict[str, int], limits: BatchLimits, signature: Signature) -> int:
        """Attention scores the group with ``lengths`` added would materialise: 0 when no masked key is padded."""
        masked = {signature.axis_of(mask) for mask in signature.padding_masks}
        count = len(self.indices) + 1
        padded = any(
            max(self.longest[axis], length) * count != self.total[axis] + length
            for axis, length in lengths.items()
            if axis in masked
        )
        if not padded:
            return 0
        q_len = max(self.longest[signature.query_axis], lengths[signature.query_axis])
        kv_len = max(self.longest[signature.key_axis], lengths[signature.key_axis])
        return count * q_len * kv_len * limits.score_bytes

    def add(self, index: int, lengths: dict[str, int]) -> None:
        self.indices.append(index)
        for axis, length in lengths.items():
            self.longest[axis] = max(self.longest.get(axis, 0), length)
            self.total[axis] = self.total.get(axis, 0) + length


def score_bytes(metadata: ModelMetadata) -> int:
    """Bytes one (query, key) pair costs in a materialised score tensor: heads x the model's float size."""
    return metadata.num_heads * np.dtype(metadata.dtype).itemsize


def plan_batches(
    items: Sequence[Item], signature: Signature, limits: BatchLimits, sort: bool = True
) -> list[list[int]]:
    """Indices of ``items`` grouped into batches within ``limits``.

    With ``sort`` the items are ordered by length first (keys, then queries), so
    that a batch holds items of similar length and little of it is padding;
    without it batches follow the order of ``items`` (the naive baseline). An
    item longer than the token budget goes alone.
    """
    lengths = [item_lengths(item, signature) for item in items]
    axes = signature.sequence_axes[::-1]  # key axes first: they are the ones that may not be paddable
    order = range(len(items))
    if sort:
        order = sorted(order, key=lambda i: tuple(lengths[i][axis] for axis in axes))
    paddable = signature.paddable_axes
    batches: list[list[int]] = []
    group = _Group()
    for index in order:
        if not group.admits(lengths[index], limits, paddable, signature):
            batches.append(group.indices)
            group = _Group()
        group.add(index, lengths[index])
    if group.indices:
        batches.append(group.indices)
    return batches


def _pad(arrays: list[np.ndarray], longest: int) -> np.ndarray:
    out = np.zeros((len(arrays), longest, *arrays[0].shape[1:]), dtype=arrays[0].dtype)
    for row, array in enumerate(arrays):
        out[row, : array.shape[0]] = array
    return out


@dataclass
class Batch:
    feeds: dict[str, np.ndarray]
    lengths: list[dict[str, int]]  # per item: axis -> real length
    query_axis: str | None  # None: a model without a length axis, whose items count one each

    @property
    def real_tokens(self) -> int:
        if self.query_axis is None:
            return len(self.lengths)
        return sum(lengths[self.query_axis] for lengths in self.lengths)

    @property
    def padded_tokens(self) -> int:
        if self.query_axis is None:
            return len(self.lengths)
        return len(self.lengths) * max(lengths[self.query_axis] for lengths in self.lengths)


def collate(items: Sequence[Item], signature: Signature) -> Batch:
    """Right-pad ``items`` into one batch of feeds, with the padding masks the model takes; images and audio
    stacked as they are."""
    lengths = [item_lengths(item, signature) for item in items]
    longest = {axis: max(item[axis] for item in lengths) for axis in signature.sequence_axes}
    feeds = {
        name: _pad([item[name] for item in items], longest[signature.axis_of(name)])
        for name in signature.sequence_inputs
    }
    feeds.update({name: np.stack([item[name] for item in items]) for name in signature.fixed_shape_inputs})
    for mask_name in signature.padding_masks:
        axis = signature.axis_of(mask_name)
        feeds[mask_name] = right_padding_mask([item[axis] for item in lengths], longest[axis])
    return Batch(feeds, lengths, signature.query_axis)


def split_outputs(outputs: dict[str, np.ndarray], batch: Batch, signature: Signature) -> list[Result]:
    """Per item, each output cut to the item's real lengths on every length axis. An output spanning the batch
    (``Signature.batch_outputs``: CLIP's logits_per_image) is no item's: an item's row of it would depend on which
    items the planner put beside it, so it is left out (``left_out_note`` says so)."""
    results = []
    for row, lengths in enumerate(batch.lengths):
        result = {}
        for spec in signature.item_outputs:
            cut = tuple(slice(0, lengths[axis]) if axis in lengths else slice(None) for axis in spec.axes[1:])
            result[spec.name] = outputs[spec.name][row][cut]
        results.append(result)
    return results


def left_out_note(signature: Signature) -> str | None:
    """What a run over items (``infer``, the batch runner) does not write, and why; None when it writes every
    output."""
    spanning = signature.batch_outputs
    if not spanning:
        return None
    return (f"{', '.join(spanning)} not written: each spans the whole batch of a call (every item against every "
            "other), and items here are batched by length as the runner chooses, so an item's row would depend on "
            "its batch-mates; the per-item outputs are written (compute the cross terms from them, e.g. "
            "exp(logit_scale) * image_embeds @ text_embeds.T), or run the batch you mean with MHASession or serve")
