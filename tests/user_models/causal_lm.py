"""A small causal language model over token ids: the attention is a function, the mask the padding view
and'ed with torch.tril, post-norm blocks, an LM head over the vocabulary."""

import math

import torch
import torch.nn.functional as F
from torch import nn

INPUTS = ("tokens:tokens", "mask:padding-mask")


def scaled_dot_product_attention(q, k, v, mask=None, dropout=None):
    d_k = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = F.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, v), p_attn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h = n_heads
        self.d_k = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask):
        b, t, c = x.shape
        q = self.w_q(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        k = self.w_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.w_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        y, _attn = scaled_dot_product_attention(q, k, v, mask, self.drop)  # the weights go unused
        return self.w_o(y.transpose(1, 2).contiguous().view(b, t, c))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.ln2 = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = self.ln1(x + self.attn(x, mask))
        return self.ln2(x + self.mlp(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d_model=32, n_heads=4, n_layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads) for _ in range(n_layers))
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, tokens, mask):
        t = tokens.size(1)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=tokens.device))
        attn_mask = mask.unsqueeze(1).unsqueeze(2) & causal  # [batch, 1, t, t]
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x, attn_mask)
        return self.lm_head(x)


def build():
    torch.manual_seed(1)
    return TinyLM()
