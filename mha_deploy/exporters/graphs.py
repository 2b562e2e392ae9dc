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
    key_padding_mask: torch.Tensor | None, q_len: int, kv_len: int, causal: bool, device=None
) -> torch.Tensor | None:
    """The reference mask, broadcastable to [batch, heads, q_len, kv_len]; None when nothing is masked."""
    mask = None
    if key_padding_mask is not None:
        # [batch, kv_len] -> [batch, 1, 1, kv_len]
        mask = key_padding_mask.to(torch.bool)[:, None, None, :]
    if causal:
        # Built from positions rather than torch.tril so that the exported graph
        # keeps q_len and kv_len symbolic.
        q_pos = torch.arange(q_len, device=device)[:, None]
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


def attention_graph(mha: MultiHeadAttention, signature: Signature) -> _AttentionGraph:
    """The eval-mode module to export for ``signature``."""
    graph_cls = SelfAttentionGraph if signature.attention == "self" else CrossAttentionGraph
    return graph_cls(mha, signature).eval()
