"""Post-norm Transformer encoder/decoder stacks built from the reference ``MultiHeadAttention``.

Masks follow the reference convention: broadcastable to [batch, heads, q_len,
kv_len], 0/False = masked (``exporters.graphs.build_attention_mask`` builds
them from a key padding mask and a causal flag).
"""

from __future__ import annotations

import torch
from torch import nn

from mha_deploy.errors import ModelConfigError
from mha_deploy.models.attention import MultiHeadAttention

# A mask as the reference takes it, or no mask.
Mask = torch.Tensor | None


class PositionwiseFeedForward(nn.Module):
    """Linear -> ReLU -> Linear, applied to each position independently."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(torch.relu(self.linear1(x))))


class EncoderLayer(nn.Module):
    """Self-attention + Add&LayerNorm, then feed-forward + Add&LayerNorm (post-norm)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: [batch, seq, d_model]
        attended, _ = self.self_attn(x, x, x, mask)
        x = self.norm1(x + self.dropout(attended))
        return self.norm2(x + self.dropout(self.feed_forward(x)))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder memory, feed-forward; each with Add&LayerNorm."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        self_mask: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [batch, tgt_len, d_model], memory: [batch, mem_len, d_model]
        return self.combine(
            x,
            lambda h: self.self_attn(h, h, h, self_mask)[0],
            lambda h: self.cross_attn(h, memory, memory, memory_mask)[0],
        )

    def combine(self, x: torch.Tensor, self_attend, cross_attend) -> torch.Tensor:
        """The layer around its two attentions, each a function of the hidden state [batch, tgt_len, d_model]
        (a KV-cache export attends over cached keys instead: ``exporters.stack_graphs``)."""
        x = self.norm1(x + self.dropout(self_attend(x)))
        x = self.norm2(x + self.dropout(cross_attend(x)))
        return self.norm3(x + self.dropout(self.feed_forward(x)))


def _check_sizes(num_layers: int, d_ff: int) -> None:
    # The attention checks d_model and num_heads itself.
    if num_layers <= 0:
        raise ModelConfigError(f"num_layers must be positive, got {num_layers}")
    if d_ff <= 0:
        raise ModelConfigError(f"d_ff (the feed-forward width) must be positive, got {d_ff}")


class _Stack(nn.Module):
    """``num_layers`` layers of ``layer_type``, each with its own weights."""

    layer_type: type[nn.Module]

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        _check_sizes(num_layers, d_ff)
        self.d_model, self.num_heads = d_model, num_heads
        self.layers = nn.ModuleList(self.layer_type(d_model, num_heads, d_ff, dropout) for _ in range(num_layers))


class Encoder(_Stack):
    """``num_layers`` ``EncoderLayer``s; ``forward(x, mask=None)``."""

    layer_type = EncoderLayer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


class Decoder(_Stack):
    """``num_layers`` ``DecoderLayer``s; ``forward(x, memory, self_mask=None, memory_mask=None)``."""

    layer_type = DecoderLayer

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, self_mask: Mask = None, memory_mask: Mask = None
    ) -> torch.Tensor:
        # The same arguments as DecoderLayer.forward, passed to each layer in turn.
        for layer in self.layers:
            x = layer(x, memory, self_mask, memory_mask)
        return x
