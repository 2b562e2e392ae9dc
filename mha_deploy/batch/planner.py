"""Padding variable-length items into batches, and cutting the results back.

Whether padding keys changes the result depends on the model: with a
``key_padding_mask`` input it never does; with causal self-attention right
padding does not either (padded keys come after every real query); with no
mask at all keys cannot be padded, so such batches hold items of one length.
Query rows never influence each other, so queries can always be padded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mha_deploy.batch.base import Item
from mha_deploy.errors import InputError
from mha_deploy.metadata import Signature


def require_batchable(signature: Signature) -> None:
    """Batching pads one sequence per item: a decoder's two (target and memory) are not supported."""
    if signature.model == "decoder":
        raise InputError(
            "decoder models take two sequences per item (x and memory), which the batch runner and the "
            "HTTP server do not pad; call MHASession.run with padded batches and both padding masks"
        )


def check_batch_limits(batch_size: int | None, max_tokens: int | None) -> None:
    """A batch is bounded by items, by padded positions, or both; each bound at least 1."""
    if batch_size is not None and batch_size < 1:
        raise InputError(f"batch size must be at least 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"max tokens must be at least 1, got {max_tokens}")
    if batch_size is None and max_tokens is None:
        raise InputError("give a batch size, a token budget (max tokens), or both")


def query_name(signature: Signature) -> str:
    return "x" if signature.attention == "self" else "query"


def key_name(signature: Signature) -> str:
    return "x" if signature.attention == "self" else "key"


def can_pad_keys(signature: Signature) -> bool:
    return signature.has_padding_mask or (signature.attention == "self" and signature.is_causal)


def item_lengths(item: Item, signature: Signature) -> tuple[int, int]:
    """(query length, key length) of one item."""
    return item[query_name(signature)].shape[0], item[key_name(signature)].shape[0]


def plan_batches(
    items: Sequence[Item],
    signature: Signature,
    batch_size: int | None = 16,
    max_tokens: int | None = None,
    sort: bool = True,
) -> Iterator[list[int]]:
    """Indices of ``items`` grouped into batches.

    A batch holds at most ``batch_size`` items and, when ``max_tokens`` is set,
    at most ``max_tokens`` padded positions (items × longest query, and items ×
    longest key for cross-attention); an item longer than the budget goes alone.
    With ``sort`` the items are ordered by length first, so that a batch holds
    items of similar length and little of it is padding; without it batches
    follow the order of ``items`` (the naive baseline).
    """
    check_batch_limits(batch_size, max_tokens)
    lengths = [item_lengths(item, signature) for item in items]
    order = range(len(items))
    if sort:
        order = sorted(order, key=lambda i: (lengths[i][1], lengths[i][0]))
    pad_keys = can_pad_keys(signature)
    batch: list[int] = []
    longest_q = longest_kv = 0
    for index in order:
        q_len, kv_len = lengths[index]
        if batch:
            grown_q, grown_kv = max(longest_q, q_len), max(longest_kv, kv_len)
            full = (
                (batch_size is not None and len(batch) == batch_size)
                or (max_tokens is not None and (len(batch) + 1) * max(grown_q, grown_kv) > max_tokens)
                or (not pad_keys and kv_len != longest_kv)
            )
            if full:
                yield batch
                batch, longest_q, longest_kv = [], 0, 0
        batch.append(index)
        longest_q, longest_kv = max(longest_q, q_len), max(longest_kv, kv_len)
    if batch:
        yield batch


def _pad(arrays: list[np.ndarray]) -> np.ndarray:
    longest = max(a.shape[0] for a in arrays)
    out = np.zeros((len(arrays), longest, arrays[0].shape[1]), dtype=arrays[0].dtype)
    for row, array in enumerate(arrays):
        out[row, : array.shape[0]] = array
    return out


@dataclass
class Batch:
    feeds: dict[str, np.ndarray]
    q_lengths: list[int]
    kv_lengths: list[int]

    @property
    def real_tokens(self) -> int:
        return sum(self.q_lengths)

    @property
    def padded_tokens(self) -> int:
        return len(self.q_lengths) * self.feeds[next(iter(self.feeds))].shape[1]


def collate(items: Sequence[Item], signature: Signature) -> Batch:
    """Right-pad ``items`` into one batch of feeds, with a key_padding_mask when the model takes one."""
    feeds = {name: _pad([item[name] for item in items]) for name in signature.sequence_inputs}
    kv_lengths = [item[key_name(signature)].shape[0] for item in items]
    if signature.has_padding_mask:
        kv_len = feeds[key_name(signature)].shape[1]
        feeds["key_padding_mask"] = np.arange(kv_len)[None, :] < np.array(kv_lengths)[:, None]
    q_lengths = [item[query_name(signature)].shape[0] for item in items]
    return Batch(feeds, q_lengths, kv_lengths)


def split_outputs(outputs: dict[str, np.ndarray], batch: Batch) -> list[dict[str, np.ndarray]]:
    """Per item, the outputs without padding: output [q_len, d_model], attn_weights [heads, q_len, kv_len]."""
    results = []
    for row, (q_len, kv_len) in enumerate(zip(batch.q_lengths, batch.kv_lengths, strict=True)):
        result = {"output": outputs["output"][row, :q_len]}
        if "attn_weights" in outputs:
            result["attn_weights"] = outputs["attn_weights"][row, :, :q_len, :kv_len]
        results.append(result)
    return results
