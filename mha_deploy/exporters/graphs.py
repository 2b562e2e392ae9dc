"""torch modules whose forward is exactly the exported model's I/O contract.

They wrap a reference ``MultiHeadAttention`` and turn the contract's inputs
(``key_padding_mask`` bool [batch, kv_len], True = real token; causal baked in)
into the reference's broadcastable 0 = masked mask. Run eagerly they are also
the torch side of every parity check.
"""

from __future__ import annotations

import torch
from torch import nn

from mha_deploy.metadata import Signature
from mha_deploy.models.attention import MultiHeadAttention


def build_attention_mask(
    key_padding_mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device=None, past_len=0
) -> torch.Tensor | None:
    """The reference mask, broadcastable to [batch, heads, q_len, kv_len]; None when nothing is masked.

    ``past_len``: how many cached keys come before the queries (KV cache), so query i sits at position
    past_len + i of the keys.
    """
    mask = None
    if key_padding_mask is not None:
        # [batch, kv_len] -> [batch, 1, 1, kv_len]
        mask = key_padding_mask.to(torch.bool)[:, None, None, :]
    if causal:
        # Built from positions rather than torch.tril so that the exported graph
        # keeps q_len and kv_len symbolic.
        q_pos = torch.arange(q_len, device=device)[:, None] + past_len
        kv_pos = torch.arange(kv_len, device=device)[None, :]
        causal_mask = kv_pos <= q_pos  # [q_len, kv_len]
        mask = causal_mask if mask is None else mask & causal_mask
    return mask


class _AttentionGraph(nn.Module):
    def __init__(self, mha: MultiHeadAttention, signature: Signature):
        super().__init__()
        self.mha = mha
        self.signature = signature

    def _attend(self, query, key, value, key_padding_mask):
        mask = build_attention_mask(
            key_padding_mask, query.shape[1], key.shape[1], self.signature.is_causal, query.device
        )
        output, attn_weights = self.mha(query, key, value, mask)
        return (output, attn_weights) if self.signature.return_weights else output


class SelfAttentionGraph(_AttentionGraph):
    def forward(self, x, key_padding_mask=None):
        return self._attend(x, x, x, key_padding_mask)


class CrossAttentionGraph(_AttentionGraph):
    def forward(self, query, key, value, key_padding_mask=None):
        return self._attend(query, key, value, key_padding_mask)


def split_keys_values(mha: MultiHeadAttention, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mha``'s keys and values of ``source`` [batch, seq, d_model], heads split: what a cache holds."""
    return mha.split_heads(mha.W_k(source)), mha.split_heads(mha.W_v(source))


def attend_to_heads(mha: MultiHeadAttention, query: torch.Tensor, keys, values, mask) -> torch.Tensor:
    """``mha``'s output for ``query`` [batch, q_len, d_model] over keys/values already projected and split
    into heads ([batch, heads, kv_len, d_k], e.g. from a cache)."""
    context, _ = mha.scaled_dot_product_attention(mha.split_heads(mha.W_q(query)), keys, values, mask)
    return mha.W_o(mha.merge_heads(context))


def attend_with_cache(mha: MultiHeadAttention, x, past_key, past_value, key_padding_mask):
    """Causal self-attention of ``x`` over the cache: ``(output, present_key, present_value)``, present =
    past ++ the new tokens' keys/values. Query i of ``x`` sits at position past_seq + i, so it sees every
    cached key the mask marks real and the new keys at or before it: exactly its row of one causal forward
    over the whole sequence."""
    new_key, new_value = split_keys_values(mha, x)
    # [batch, heads, past_seq, d_k] ++ [batch, heads, seq, d_k] -> [batch, heads, total_seq, d_k]
    present_key = torch.cat([past_key, new_key], dim=2)
    present_value = torch.cat([past_value, new_value], dim=2)
    mask = build_attention_mask(
        key_padding_mask, x.shape[1], present_key.shape[2], True, x.device, past_len=past_key.shape[2]
    )
    return attend_to_heads(mha, x, present_key, present_value, mask), present_key, present_value


class KVCacheSelfAttentionGraph(_AttentionGraph):
    """Causal self-attention over a cache: ``(x, past_key, past_value[, key_padding_mask])`` ->
    ``(output, present_key, present_value)`` (``attend_with_cache``). Every call's graph, the plain one."""

    def forward(self, x, past_key, past_value, key_padding_mask=None):
        return attend_with_cache(self.mha, x, past_key, past_value, key_padding_mask)


def attention_graph(mha: MultiHeadAttention, signature: Signature) -> _AttentionGraph:
    """The eval-mode module to export for ``signature``."""
    if signature.kv_cache:
        return KVCacheSelfAttentionGraph(mha, signature).eval()
    graph_cls = SelfAttentionGraph if signature.attention == "self" else CrossAttentionGraph
    return graph_cls(mha, signature).eval()
