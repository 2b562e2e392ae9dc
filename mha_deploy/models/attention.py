"""The reference multi-head attention, exactly as the users' models compute it."""

from __future__ import annotations

import math

import torch
from torch import nn

from mha_deploy.errors import ModelConfigError

# The reference replaces masked scores by this value before the softmax. It is
# part of the numerics users rely on (it is not -inf, so a fully masked row
# gives a uniform distribution instead of NaN).
MASK_FILL_VALUE = -1e9


class MultiHeadAttention(nn.Module):
    """Multi-head attention with four projections, biased unless ``bias=False``.

    ``forward(query, key, value, mask=None)`` takes ``[batch, q_len, d_model]``
    query and ``[batch, kv_len, d_model]`` key/value; ``mask`` broadcasts to
    ``[batch, heads, q_len, kv_len]`` with 0/False meaning "masked". Returns
    ``(output [batch, q_len, d_model], attn_weights [batch, heads, q_len, kv_len])``.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.1, bias: bool = True):
        super().__init__()
        if d_model <= 0 or num_heads <= 0:
            raise ModelConfigError(f"d_model and num_heads must be positive, got {d_model} and {num_heads}")
        if d_model % num_heads != 0:
            raise ModelConfigError(
                f"d_model ({d_model}) must be divisible by num_heads ({num_heads}); "
                f"each head gets d_model / num_heads features"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, d_model, bias=bias)
        self.W_v = nn.Linear(d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # [batch, seq, d_model] -> [batch, heads, seq, d_k]
        return x.view(batch, seq, self.num_heads, self.d_k).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = x.shape
        # [batch, heads, seq, d_k] -> [batch, seq, d_model]
        return x.transpose(1, 2).contiguous().view(batch, seq, self.d_model)

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        # [batch, heads, q_len, kv_len]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, MASK_FILL_VALUE)
        attn_weights = torch.softmax(scores, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return torch.matmul(attn_weights, v), attn_weights

    def forward(self, query, key, value, mask=None):
        q = self.split_heads(self.W_q(query))
        k = self.split_heads(self.W_k(key))
        v = self.split_heads(self.W_v(value))
        context, attn_weights = self.scaled_dot_product_attention(q, k, v, mask)
        return self.W_o(self.merge_heads(context)), attn_weights
