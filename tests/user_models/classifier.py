"""A text classifier over token ids: learned positions, pre-norm blocks, masked mean pooling, a linear head.

The attention is the reference one (W_q/W_k/W_v/W_o, masked_fill(mask == 0, -1e9)), its mask a
[batch, 1, 1, seq] view of the padding input.
"""

import math

import torch
from torch import nn

INPUTS = ("input_ids:tokens", "attention_mask:padding-mask")


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.1):
        super().__init__()
        assert d_model % num_heads == 0
        self.d_k = d_model // num_heads
        self.num_heads = num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        q = self.W_q(q).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = self.W_k(k).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = self.W_v(v).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.d_k)
        return self.W_o(out)


class Block(nn.Module):
    def __init__(self, d_model, num_heads, d_ff):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, mask)
        return x + self.ff(self.norm2(x))


class TextClassifier(nn.Module):
    def __init__(self, vocab_size=50, d_model=32, num_heads=4, num_layers=2, num_classes=3, max_len=512):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, num_heads, 4 * d_model) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        x = self.embed(input_ids) + self.pos(positions)
        mask = attention_mask.unsqueeze(1).unsqueeze(2)  # [batch, 1, 1, seq]
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        weights = attention_mask.unsqueeze(-1).float()
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def build():
    torch.manual_seed(0)
    return TextClassifier()


def build_wide():
    # wide enough for the export to pack its tokens (build()'s width is too narrow for that to pay)
    torch.manual_seed(0)
    return TextClassifier(d_model=256, num_heads=4, num_layers=1)
