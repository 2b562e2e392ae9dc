"""A GPT in the tutorial form: learned token and position embeddings (``nn.Embedding(max_len, d)`` indexed by
``torch.arange(t)``), the reference attention (four linears, heads split with view + transpose,
``masked_fill(mask == 0, -1e9)``), pre-norm blocks and an LM head. ``build_bench`` is the generation
benchmark's model: d_model 512, 8 heads, 6 layers, a 32k vocabulary, 1024 positions."""

import math

import torch
import torch.nn.functional as F
from torch import nn

INPUTS = ("tokens:tokens", "mask:padding-mask")


def attention(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, -1e9)
    return torch.matmul(F.softmax(scores, dim=-1), v)


class MultiHeadedAttention(nn.Module):
    def __init__(self, d_model, h):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x, mask):
        b = x.size(0)
        q, k, v = (lin(x).view(b, -1, self.h, self.d_k).transpose(1, 2) for lin in self.linears[:3])
        y = attention(q, k, v, mask)
        return self.linears[-1](y.transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k))


class Block(nn.Module):
    def __init__(self, d_model, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiHeadedAttention(d_model, h)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=60, d_model=32, h=4, layers=2, max_len=512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens, mask):
        t = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        causal = torch.tril(torch.ones(t, t, device=tokens.device)).unsqueeze(0)  # [1, t, t]
        attn_mask = mask.unsqueeze(1).unsqueeze(1) * causal.unsqueeze(1)  # [batch, 1, t, t], 0 = hidden
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.head(self.ln_f(x))


def build():
    torch.manual_seed(11)
    return GPT().eval()


def build_bench():
    torch.manual_seed(11)
    return GPT(vocab=32000, d_model=512, h=8, layers=6, max_len=1024).eval()
